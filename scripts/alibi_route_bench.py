#!/usr/bin/env python3
"""ALiBi and attention sinks on one GPU: flashlm.attention with alibi_slopes and learnable_sink, forward and
forward + backward, on whichever kernels the dispatch picks (on sm_90 the Hopper kernels unless
FLASHLM_HOPPER_ALIBI_SINK=0, else mma.sync), beside the same shapes without ALiBi and sinks. Run it once per
route to compare them:

  FLASHLM_LIBRARY=build/src/libflashlm_attention.so PYTHONPATH=python \\
      FLASHLM_HOPPER_ALIBI_SINK=0 python3 scripts/alibi_route_bench.py --out mma-sync.json
  ... FLASHLM_HOPPER_ALIBI_SINK=1 python3 scripts/alibi_route_bench.py --out hopper.json

CUDA events over back-to-back calls, median of --reps after --warmup; TFLOP/s counts causal work as half.
"""
import argparse
import json
import math
import os
import statistics

import torch

import flashlm


def time_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="4x16x4096x64,4x16x4096x128,1x16x16384x128,2x16x4096x256",
                    help="BATCHxHEADSxSEQxHEAD_DIM, comma list")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    route = os.environ.get("FLASHLM_HOPPER_ALIBI_SINK", "")
    dev = torch.device("cuda")
    records = []
    for shape in a.shapes.split(","):
        b, h, s, d = (int(x) for x in shape.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
                   for _ in range(3))
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], device=dev, dtype=torch.float32)
        sink = torch.randn(h, device=dev, dtype=torch.float32, generator=g).requires_grad_()
        dout = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g)
        flops = 4.0 * b * h * s * s * d / 2  # causal
        for variant in ("plain", "alibi+sink"):
            extra = dict(alibi_slopes=slopes, learnable_sink=sink) if variant != "plain" else {}

            def fwd():
                with torch.no_grad():
                    flashlm.attention(q, k, v, layout="bhsd", causal=True, **extra)

            def fwd_bwd():
                o = flashlm.attention(q, k, v, layout="bhsd", causal=True, **extra)
                o.backward(dout)

            rec = dict(shape=shape, variant=variant, route=route or "default",
                       fwd_ms=time_ms(fwd, a.warmup, a.reps))
            try:
                rec["fwd_bwd_ms"] = time_ms(fwd_bwd, a.warmup, a.reps)
            except Exception as e:  # a head dim whose backward the route lacks
                rec["fwd_bwd_ms"] = math.nan
                rec["error"] = str(e)[:200]
            rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
            records.append(rec)
            print(f"{shape:18s} {variant:11s} route={rec['route']:7s} fwd {rec['fwd_ms']:8.3f} ms "
                  f"({rec['fwd_tflops']:5.0f} TFLOP/s)  fwd+bwd {rec['fwd_bwd_ms']:8.3f} ms", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, records=records), f, indent=1)


if __name__ == "__main__":
    main()
