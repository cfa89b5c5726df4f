"""flashlm's CPU Transformer LM against the same model written in PyTorch: logits, loss and every
gradient within 1e-5 relative in fp32, and the losses of 10 AdamW steps (CS336's AdamW, written out
below, with gradient clipping)."""
import math
import os
import struct
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from load_in_pytorch import LM  # noqa: E402  (the CS336 model in PyTorch, with flashlm's parameter names)
nn = torch.nn

LM_IO = os.environ.get("FLASHLM_LM_IO")
pytestmark = pytest.mark.skipif(not LM_IO, reason="FLASHLM_LM_IO (the lm_io harness) not set")


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
