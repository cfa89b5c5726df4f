#!/usr/bin/env python3
"""One forward and one backward of SDPA's cuDNN backend per shape, for ncu to profile beside flashlm's
kernels (scripts/gpu-hopper-fwd4.sh): b4 h16 n4096 d128 and b4 h32 n4096 d64, bf16, causal. No warm-up
launches, so that the kernels ncu counts are these."""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

for heads, d in ((16, 128), (32, 64)):
    q, k, v = (torch.randn(4, heads, 4096, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"cudnn h{heads} d{d}: done")
