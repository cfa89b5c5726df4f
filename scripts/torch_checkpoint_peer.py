#!/usr/bin/env python3
"""PyTorch peer for `flashlm bench --recompute ...`: the CS336 LM with every block under
torch.utils.checkpoint (activation recomputation), SDPA attention, on one GPU.

Times a full train step (forward, cross-entropy, backward, fused AdamW) after warm-up and reports the median,
tokens/s, peak memory and MFU by SPEC's count and by the useful (causal-halved attention) count.

  python3 scripts/torch_checkpoint_peer.py --size xl --context 4096 --batch 2 --mode bf16-autocast
  python3 scripts/torch_checkpoint_peer.py --size cs336-8b --context 8192 --batch 1 --mode bf16-pure --layers 4

Modes: bf16-autocast (fp32 parameters and AdamW state, bf16 compute: flashlm's --precision bf16) and bf16-pure
(model.to(torch.bfloat16): flashlm's --precision bf16-pure). --no-checkpoint keeps every activation.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SIZES = {  # d_model, d_ff, layers, heads, vocab (SPEC §1)
    "small": (768, 3072, 12, 12, 10000),
    "medium": (1024, 4096, 24, 16, 10000),
    "large": (1280, 5120, 36, 20, 10000),
    "xl": (1600, 6400, 48, 25, 10000),
    "2.7B": (2560, 10240, 32, 32, 10000),
    "cs336-8b": (4096, 11008, 34, 32, 151936),
}
PEAK = 989e12


class Norm(nn.Module):
    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):  # interleaved pairs (x[2i], x[2i+1]), x: [batch, heads, seq, head_dim]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, d, dff, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = Norm(d), Norm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, dff, bias=False), nn.Linear(d, dff, bias=False)
        self.w2 = nn.Linear(dff, d, bias=False)

    def forward(self, x, cos, sin):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="xl", choices=sorted(SIZES))
    ap.add_argument("--layers", type=int, default=0, help="override the size's layer count")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--mode", default="bf16-autocast", choices=["bf16-autocast", "bf16-pure"])
    ap.add_argument("--no-checkpoint", action="store_true")
    ap.add_argument("--chunk", type=int, default=4096, help="tokens per LM-head + loss chunk (checkpointed)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    d, dff, layers, heads, vocab = SIZES[a.size]
    layers = a.layers or layers
    torch.manual_seed(0)
    dev = "cuda"
    pure = a.mode == "bf16-pure"
    with torch.device(dev):
        emb = nn.Embedding(vocab, d)
        blocks = nn.ModuleList(Block(d, dff, heads) for _ in range(layers))
        ln_f, head = Norm(d), nn.Linear(d, vocab, bias=False)
    model = nn.ModuleList([emb, blocks, ln_f, head])
    if pure:
        model.to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    half = d // heads // 2
    inv = 1.0 / (10000.0 ** (torch.arange(half, device=dev, dtype=torch.float32) / half))
    ang = torch.arange(a.context, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
    cdt = torch.bfloat16
    cos, sin = ang.cos().to(cdt), ang.sin().to(cdt)
    x = torch.randint(0, vocab, (a.batch, a.context), device=dev)
    y = torch.randint(0, vocab, (a.batch, a.context), device=dev)

    def head_loss(h, t):
        return F.cross_entropy(head(ln_f(h)).float().flatten(0, 1), t.flatten(), reduction="sum")

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=not pure):
            h = emb(x)
            for b in blocks:
                h = b(h, cos, sin) if a.no_checkpoint else checkpoint(b, h, cos, sin, use_reentrant=False)
            loss = 0.0
            for s in range(0, a.context, a.chunk):
                part = (h[:, s:s + a.chunk], y[:, s:s + a.chunk])
                loss = loss + (head_loss(*part) if a.no_checkpoint else checkpoint(head_loss, *part, use_reentrant=False))
            loss = loss / y.numel()
        loss.backward()
        opt.step()
        return loss

    times, status = [], "ok"
    torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(a.warmup + a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) * 1e3
            print(f"step {i + 1}: {ms:.1f} ms, loss {loss.item():.4f}", flush=True)
            if i >= a.warmup:
                times.append(ms)
    except torch.OutOfMemoryError as e:
        status = "oom"
        print("oom:", str(e)[:200])
    tokens = a.batch * a.context
    linear = layers * (4 * d * d + 3 * d * dff) + d * vocab
    spec = (6 * linear + 12 * layers * a.context * d) * tokens
    useful = (6 * linear + 6 * layers * a.context * d) * tokens
    med = sorted(times)[len(times) // 2] if times else math.nan
    rec = dict(impl="pytorch", checkpoint=not a.no_checkpoint, mode=a.mode, size=a.size, layers=layers,
               context=a.context, batch=a.batch, params=params, status=status, step_ms=med,
               tokens_per_s=tokens / (med / 1e3), mfu_spec=spec / (med / 1e3) / PEAK,
               mfu_useful=useful / (med / 1e3) / PEAK, peak_mib=torch.cuda.max_memory_allocated() / 2**20,
               torch=torch.__version__, gpu=torch.cuda.get_device_name())
    print(json.dumps(rec))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"records": [rec]}, f, indent=1)


if __name__ == "__main__":
    main()
