#!/usr/bin/env python3
"""PyTorch's F.scaled_dot_product_attention on the shapes of `flashlm attention-bench --decode`, as its JSON.

  python3 scripts/peers/decode_peers.py --backends flash,cudnn,efficient,math --out peers-decode.json
  ./build/tools/flashlm attention-bench --decode --format json > ours-decode.json

SDPA has no paged cache: it gets the gathered one, contiguous [batch, kv_heads, cache, head_dim] K and V (the
layout that favours it), one query per sequence (--nq), GQA through enable_gqa, no causal mask (nq = 1 sees
every key; with nq > 1 a bottom-right mask would be needed, which is_causal does not give, so the records say
causal false). Each record has the fields of attention-bench --decode's (ms, gbps of K and V read, peak_pct of
--peak-gbps), impl "sdpa-<backend>", the median of --reps timed calls after --warmup: ms with the L2 flushed
before each call (the host's share hidden, as attention-bench --decode's ms), call_ms each call alone.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from common import DTYPES, is_oom, pick_device, time_ms, write_report

BACKEND_NAMES = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def measure(backend, batch, cache, heads, kv_heads, d, nq, dtype, device, warmup, reps, peak_gbps):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rec = dict(impl=f"sdpa-{backend}", batch=batch, cache_len=cache, heads=heads, kv_heads=kv_heads, head_dim=d,
               page_size=0, nq=nq, causal=False, dtype=[k for k, v in DTYPES.items() if v == dtype][0],
               device=device.type, status="ok")
    try:
        q = torch.randn(batch, heads, nq, d, device=device, dtype=dtype)
        k = torch.randn(batch, kv_heads, cache, d, device=device, dtype=dtype)
        v = torch.randn(batch, kv_heads, cache, d, device=device, dtype=dtype)
        gqa = {"enable_gqa": True} if kv_heads != heads else {}
        with sdpa_kernel(getattr(SDPBackend, BACKEND_NAMES[backend])):
            call = lambda: F.scaled_dot_product_attention(q, k, v, **gqa)  # noqa: E731
            call_ms = time_ms(call, device, warmup, reps)
            ms = time_ms(call, device, 0, reps, flush_l2=True) if device.type == "cuda" else call_ms
    except RuntimeError as e:  # a backend that does not take this shape, or memory
        rec["status"] = "oom" if is_oom(e) else "unsupported"
        rec["message"] = str(e).splitlines()[0][:200]
        return rec
    finally:
        q = k = v = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    rec["ms"] = statistics.median(ms)
    rec["call_ms"] = statistics.median(call_ms)
    kv_bytes = 2 * batch * cache * kv_heads * d * torch.finfo(dtype).bits // 8
    rec["gbps"] = kv_bytes / rec["ms"] / 1e6
    rec["peak_pct"] = 100 * rec["gbps"] / peak_gbps
    return rec


def ints(text):
    return [int(x) for x in text.split(",")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--cache", default="4096,16384,65536,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--backends", default="flash,cudnn,efficient")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-gbps", type=float, default=4800.0)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    device = pick_device(a.device)
    records = []
    for backend in a.backends.split(","):
        if backend not in BACKEND_NAMES:
            raise SystemExit(f"error: --backends: unknown backend '{backend}' (expected {', '.join(BACKEND_NAMES)})")
        for batch in ints(a.batch):
            for cache in ints(a.cache):
                r = measure(backend, batch, cache, a.heads, a.kv_heads, a.d, a.nq, DTYPES[a.dtype], device, a.warmup,
                            a.reps, a.peak_gbps)
                records.append(r)
                print(f"{r['impl']} b={batch} cache={cache}: {r.get('ms', r['status'])} ms "
                      f"{r.get('gbps', 0):.0f} GB/s", flush=True)
    write_report(a.out, "peers/decode_peers", device, records, reps=a.reps, warmup=a.warmup, peak_gbps=a.peak_gbps)


if __name__ == "__main__":
    main()
