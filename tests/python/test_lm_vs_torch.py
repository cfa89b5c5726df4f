"""flashlm's CPU Transformer LM against the same model written in PyTorch: logits, loss and every
gradient within 1e-5 relative in fp32, and the losses of 10 AdamW steps (CS336's AdamW, written out
below, with gradient clipping)."""
import math
import os
import struct
import subprocess

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

LM_IO = os.environ.get("FLASHLM_LM_IO")
pytestmark = pytest.mark.skipif(not LM_IO, reason="FLASHLM_LM_IO (the lm_io harness) not set")


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, theta):
    """Rotates interleaved pairs (x[..., 2i], x[..., 2i+1]) of [batch, seq, heads, head_dim] by t·theta^(-2i/d)."""
    b, t, h, d = x.shape
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float()[None, :, None, :], ang.sin().float()[None, :, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d, heads, theta):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.output_proj = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.heads, self.theta = heads, theta

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, d // self.heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = rope(q, self.theta), rope(k, self.theta)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.softmax(s, dim=-1) @ v
        return self.output_proj(o.transpose(1, 2).reshape(b, t, d))


class FFN(nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False), nn.Linear(d, f, bias=False)

    def forward(self, x):
        u = self.w1(x)
        return self.w2(u * torch.sigmoid(u) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, f, heads, theta, eps):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.ffn = RMSNorm(d, eps), Attention(d, heads, theta), RMSNorm(d, eps), FFN(d, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class LM(nn.Module):
    def __init__(self, vocab, d, f, layers, heads, theta, eps):
        super().__init__()
        self.token_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d, f, heads, theta, eps) for _ in range(layers))
        self.ln_final = RMSNorm(d, eps)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.token_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.ln_final(x))


def adamw_step(params, state, lr, b1, b2, eps, wd, step):
    """CS336's AdamW: bias-corrected step size, then decoupled weight decay on the updated weights."""
    with torch.no_grad():
        alpha = lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step)
        for p in params:
            m, v = state.setdefault(p, (torch.zeros_like(p), torch.zeros_like(p)))
            m.mul_(b1).add_(p.grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            p.sub_(alpha * m / (v.sqrt() + eps))
            p.sub_(lr * wd * p)


def rel(a, b):
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-30)


def test_cpu_lm_matches_pytorch(tmp_path):
    torch.manual_seed(0)
    vocab, ctx, d, f, layers, heads, batch, seq, steps = 97, 32, 64, 96, 2, 4, 3, 19, 10
    theta, eps = 10000.0, 1e-5
    lr, b1, b2, adam_eps, wd, clip = 3e-3, 0.9, 0.95, 1e-8, 0.1, 1.0
    model = LM(vocab, d, f, layers, heads, theta, eps)
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial norm gains, so their gradients are exercised
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name.endswith("ln_final.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    tokens = torch.randint(0, vocab, (batch, seq), dtype=torch.int32)
    targets = torch.randint(0, vocab, (batch, seq), dtype=torch.int32)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())

    blob = struct.pack("<9q", vocab, ctx, d, f, layers, heads, batch, seq, steps)
    blob += struct.pack("<8d", theta, eps, lr, b1, b2, adam_eps, wd, clip)
    blob += tokens.numpy().tobytes() + targets.numpy().tobytes()
    blob += b"".join(params[n].detach().numpy().astype("<f4").tobytes() for n in names)
    (tmp_path / "in.bin").write_bytes(blob)
    subprocess.run([LM_IO, str(tmp_path / "in.bin"), str(tmp_path / "out.bin")], check=True)
    out = (tmp_path / "out.bin").read_bytes()

    logits = model(tokens.long())
    loss = nn.functional.cross_entropy(logits.view(-1, vocab), targets.long().view(-1))
    loss.backward()

    n_logits = batch * seq * vocab
    ours_logits = torch.frombuffer(bytearray(out[: 4 * n_logits]), dtype=torch.float32).view_as(logits)
    pos = 4 * n_logits
    (ours_loss,) = struct.unpack_from("<d", out, pos)
    pos += 8
    assert rel(ours_logits, logits.detach()) < 1e-5
    assert abs(ours_loss - loss.item()) / loss.item() < 1e-5
    for n in names:
        p = params[n]
        ours = torch.frombuffer(bytearray(out[pos: pos + 4 * p.numel()]), dtype=torch.float32).view_as(p)
        pos += 4 * p.numel()
        assert rel(ours, p.grad) < 1e-5, f"gradient of {n}: relative error {rel(ours, p.grad):.2e}"

    ours_losses = struct.unpack_from(f"<{steps}d", out, pos)
    state, theirs = {}, []
    for step in range(1, steps + 1):
        model.zero_grad()
        l = nn.functional.cross_entropy(model(tokens.long()).view(-1, vocab), targets.long().view(-1))
        l.backward()
        theirs.append(l.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        adamw_step(list(model.parameters()), state, lr, b1, b2, adam_eps, wd, step)
    for s, (a, b) in enumerate(zip(ours_losses, theirs)):
        assert abs(a - b) / b < 1e-5, f"step {s}: loss {a} vs {b}"
    assert theirs[-1] < theirs[0]
