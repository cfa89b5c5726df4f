#!/usr/bin/env python3
"""One forward and one backward of SDPA's cuDNN backend per shape, for ncu to profile beside flashlm's
kernels (docs/perf.md, "Where the gap to cuDNN is"): bf16, causal unless --causal 0. No warm-up launches, so
that the kernels ncu counts are these.
  python3 scripts/ncu_sdpa.py                                 # b4 h16 n4096 d128 and b4 h32 n4096 d64
  python3 scripts/ncu_sdpa.py --shapes 16x32x1024x64 --causal 1"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--shapes", default="4x16x4096x128,4x32x4096x64", help="comma-separated BxHxNxD")
ap.add_argument("--causal", type=int, choices=[0, 1], default=1)
args = ap.parse_args()

for shape in args.shapes.split(","):
    b, heads, n, d = (int(x) for x in shape.lower().split("x"))
    q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=bool(args.causal))
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"cudnn {shape} causal={args.causal}: done")
