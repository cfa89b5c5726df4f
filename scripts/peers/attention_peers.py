#!/usr/bin/env python3
"""PyTorch's F.scaled_dot_product_attention backends on the shapes of `flashlm attention-bench`, as its JSON.

  python3 scripts/peers/attention_peers.py --grid fa --backends flash,cudnn --out peers-fa.json
  python3 scripts/peers/compare.py attention ours-fa.json peers-fa.json --peer sdpa-flash --peer sdpa-cudnn

Grids are flashlm's (`--grid fa`: d 64/128, seq 512..16384, batch x seq = 16384, heads x d = 2048, causal and
not; `--grid seed`: batch 8, one head, d 16..128, seq 256..32768, causal) or `--shapes BxHxNxD[xHk],...`.
Each record is attention-bench's (impl "sdpa-<backend>", fwd_ms, bwd_ms = the backward alone, TFLOP/s by
the FlashAttention papers' count, peak memory), the median of --reps timed calls after --warmup.
Backends: flash, cudnn, efficient, math (math is the one that runs on the CPU). `--d-v DV` gives v (and the
output) a head dim of their own, as attention-bench --d-v does (DeepSeek's 192 / 128); the records then carry
head_dim_v and TFLOP/s count Q·K at D and P·V at DV.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from common import DTYPES, is_oom, pick_device, time_ms, write_report

BACKEND_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def grid_shapes(name):
    if name == "fa":
        return [(max(1, 16384 // n), 2048 // d, n, d, 2048 // d, c)
                for d in (64, 128) for n in (512, 1024, 2048, 4096, 8192, 16384) for c in (False, True)]
    if name == "seed":
        return [(8, 1, n, d, 1, True) for d in (16, 32, 64, 128) for n in (256, 1024, 4096, 8192, 16384, 32768)]
    raise SystemExit(f"error: --grid {name}: expected fa or seed")


def parse_shapes(text, causal):
    out = []
    for item in text.split(","):
        parts = [int(x) for x in item.split("x")]
        if len(parts) not in (4, 5) or min(parts) < 1:
            raise SystemExit(f"error: --shapes: '{item}' is not BxHxNxD or BxHxNxDxHk")
        b, h, n, d = parts[:4]
        out += [(b, h, n, d, parts[4] if len(parts) == 5 else h, c) for c in causal]
    return out


def attention_flops(b, h, n, d, causal, dv=None):
    """Forward FLOPs (SPEC §2): 2·d for Q·K and 2·dv for P·V per visible pair; the papers' 4·d where dv = d."""
    dv = d if dv is None else dv
    return 2 * b * h * n * n * (d + dv) / (2 if causal else 1)


def backward_ratio(d, dv):
    """Backward over forward FLOPs: Q·K again, dQ and dK at d, dO·Vᵀ and Pᵀ·dO at dv (2.5 where dv = d)."""
    return (3 * d + 2 * dv) / (d + dv)


def measure(backend, shape, dtype, device, warmup, reps, dv=None):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    b, h, n, d, hk, causal = shape
    dv = d if dv is None else dv
    q = torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(b, hk, n, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(b, hk, n, dv, device=device, dtype=dtype, requires_grad=True)
    gqa = {"enable_gqa": True} if hk != h else {}
    rec = dict(impl=f"sdpa-{backend}", batch=b, heads=h, kv_heads=hk, seq_q=n, seq_k=n, head_dim=d, head_dim_v=dv,
               causal=causal, dtype=[k for k, v in DTYPES.items() if v == dtype][0], device=device.type, status="ok")
    try:
        with sdpa_kernel(getattr(SDPBackend, BACKEND_NAMES[backend])):
            fwd = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa), device, warmup,
                          reps)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)
            grad = torch.randn_like(out)
            bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device, warmup, reps)
            if device.type == "cuda":
                rec["peak_bwd_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    except RuntimeError as e:  # a backend that does not take this shape, or memory
        rec["status"] = "oom" if is_oom(e) else "unsupported"
        rec["message"] = str(e).splitlines()[0][:200]
        return rec
    flops = attention_flops(b, h, n, d, causal, dv)
    rec.update(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd))
    rec.update(fwd_tflops=flops / rec["fwd_ms"] / 1e9, bwd_tflops=backward_ratio(d, dv) * flops / rec["bwd_ms"] / 1e9)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grid", choices=["fa", "seed"])
    ap.add_argument("--shapes", help="BxHxNxD[xHk],... instead of a grid")
    ap.add_argument("--causal", default="0,1", help="with --shapes: 0, 1 or 0,1")
    ap.add_argument("--backends", default="flash,cudnn")
    ap.add_argument("--d-v", type=int, default=0, help="v's and the output's head dim for every shape (0: its D)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    device = pick_device(a.device)
    if bool(a.grid) == bool(a.shapes):
        raise SystemExit("error: give one of --grid and --shapes")
    if a.d_v < 0:
        raise SystemExit(f"error: --d-v: {a.d_v} is negative")
    shapes = grid_shapes(a.grid) if a.grid else parse_shapes(a.shapes, [c == "1" for c in a.causal.split(",")])
    records = []
    for backend in a.backends.split(","):
        if backend not in BACKEND_NAMES:
            raise SystemExit(f"error: --backends: unknown backend '{backend}' (expected {', '.join(BACKEND_NAMES)})")
        for shape in shapes:
            records.append(measure(backend, shape, DTYPES[a.dtype], device, a.warmup, a.reps, a.d_v or None))
            r = records[-1]
            print(f"{r['impl']} {shape}: {r.get('fwd_ms', r['status'])} / {r.get('bwd_ms', '')} ms", flush=True)
    write_report(a.out, "peers/attention_peers", device, records, reps=a.reps, warmup=a.warmup)


if __name__ == "__main__":
    main()
