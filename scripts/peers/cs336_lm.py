"""The CS336 Transformer LM in PyTorch, as flashlm implements it (SPEC §1): token embedding, pre-norm blocks
(RMSNorm, causal multi-head attention with interleaved RoPE through F.scaled_dot_product_attention, SwiGLU),
final RMSNorm, untied LM head, no biases. Only for timing: flashlm's parameter names are in
tests/python/test_export_vs_torch.py's model.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SIZES = {  # d_model, d_ff, layers, heads, vocab (SPEC §1; tiny is flashlm's --model tiny)
    "tiny": (32, 64, 2, 4, 10000),
    "small": (768, 3072, 12, 12, 10000),
    "medium": (1024, 4096, 24, 16, 10000),
    "large": (1280, 5120, 36, 20, 10000),
    "xl": (1600, 6400, 48, 25, 10000),
    "2.7B": (2560, 10240, 32, 32, 10000),
    "cs336-8b": (4096, 11008, 34, 32, 151936),
}
PEAK_FLOPS = 989e12  # dense bf16, H100/H200 (SPEC §2)


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):  # interleaved pairs (x[2i], x[2i+1]); x: [batch, heads, seq, head_dim]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, dff, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, dff, bias=False), nn.Linear(d, dff, bias=False)
        self.w2 = nn.Linear(dff, d, bias=False)

    def forward(self, x, cos, sin):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, cos, sin).to(v.dtype), rotate(k, cos, sin).to(v.dtype)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class LM(nn.Module):
    """checkpoint_blocks: every block (and each LM-head + loss chunk) under torch.utils.checkpoint, as the
    CS336 leaderboard's PyTorch reference runs its step."""

    def __init__(self, size, context, layers=0, checkpoint_blocks=False, loss_chunk=4096):
        super().__init__()
        d, dff, n_layers, heads, vocab = SIZES[size]
        self.vocab, self.d, self.layers, self.context = vocab, d, layers or n_layers, context
        self.checkpoint_blocks, self.loss_chunk = checkpoint_blocks, loss_chunk
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, dff, heads) for _ in range(self.layers))
        self.ln_f, self.head = RMSNorm(d), nn.Linear(d, vocab, bias=False)
        self.register_buffer("cos", torch.empty(context, d // heads // 2), persistent=False)
        self.register_buffer("sin", torch.empty(context, d // heads // 2), persistent=False)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self):
        """Fills the RoPE tables in place, in their own dtype and device (again after a meta-device build)."""
        context, half = self.cos.shape
        inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32, device=self.cos.device) / half))
        ang = torch.arange(context, dtype=torch.float32, device=self.cos.device)[:, None] * inv[None, :]
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

    def _head_loss(self, h, targets):
        return F.cross_entropy(self.head(self.ln_f(h)).float().flatten(0, 1), targets.flatten(), reduction="sum")

    def loss(self, tokens, targets):
        h = self.emb(tokens)
        cos, sin = self.cos.to(h.dtype), self.sin.to(h.dtype)
        for b in self.blocks:
            h = checkpoint(b, h, cos, sin, use_reentrant=False) if self.checkpoint_blocks else b(h, cos, sin)
        if not self.checkpoint_blocks:
            return self._head_loss(h, targets) / targets.numel()
        total = 0.0
        for s in range(0, tokens.shape[1], self.loss_chunk):
            part = (h[:, s:s + self.loss_chunk], targets[:, s:s + self.loss_chunk])
            total = total + checkpoint(self._head_loss, *part, use_reentrant=False)
        return total / targets.numel()

    def forward(self, tokens, targets):  # what DDP wraps
        return self.loss(tokens, targets)

    def train_flops_per_token(self, useful=False):
        """SPEC §2: 6 x non-embedding parameters + 12 x layers x context x d_model (6 x ... when useful)."""
        non_embedding = sum(p.numel() for n, p in self.named_parameters() if not n.startswith("emb."))
        return 6 * non_embedding + (6 if useful else 12) * self.layers * self.context * self.d
