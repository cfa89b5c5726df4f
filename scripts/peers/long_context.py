#!/usr/bin/env python3
"""SDPA flash and cuDNN at issue 15's long-context shapes (b1, h32, d128, bf16, causal; seq 32k and 64k):
forward and forward + backward, the median of a few timed calls between CUDA events after warm-up, on
fresh random inputs. The counterpart of `flashlm attention-bench --batch 1 --heads 32 --seq 32768,65536
--d 128 --causal=1` (scripts/gpu-check.sh long); attention_peers.py's grids have no such shape."""
import argparse, json, statistics
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

from common import time_ms


def median_ms(fn, warmup, reps):
    return statistics.median(time_ms(fn, torch.device("cuda"), warmup, reps))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,65536")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="long_context_peers.json")
    args = ap.parse_args()
    rows = []
    for n in (int(s) for s in args.seqs.split(",")):
        q, k, v = (torch.randn(1, 32, n, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        flops = 4 * 32 * n * n * 128 * 0.5  # causal: half the score matrix
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel([backend]):
                fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
                fwd_bwd = lambda: torch.autograd.grad(fwd(), (q, k, v), dout)
                f_ms = median_ms(fwd, args.warmup, args.reps)
                fb_ms = median_ms(fwd_bwd, args.warmup, args.reps)
            r = dict(peer=name, batch=1, heads=32, seq=n, head_dim=128, causal=True, fwd_ms=f_ms,
                     bwd_ms=fb_ms - f_ms, fwd_bwd_ms=fb_ms, fwd_tflops=flops / f_ms / 1e9,
                     bwd_tflops=2.5 * flops / (fb_ms - f_ms) / 1e9)
            rows.append(r)
            print(f"{name} n{n}: fwd {f_ms:.2f} ms ({r['fwd_tflops']:.0f} TF/s), bwd {fb_ms - f_ms:.2f} ms "
                  f"({r['bwd_tflops']:.0f} TF/s), fwd+bwd {fb_ms:.2f} ms")
    with open(args.out, "w") as f:
        json.dump(dict(torch=torch.__version__, gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
