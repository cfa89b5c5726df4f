#!/usr/bin/env python3
"""Whether this PyTorch exposes an FP8 (float8_e4m3fn) scaled-dot-product attention on the GPU, and if it
does, its forward speed on the fa grid (16k tokens, H*D = 2048), in TFLOP/s as attention-bench counts them.

Tried, each reported as 'runs' or with the error it raised:
  sdpa:<backend>  F.scaled_dot_product_attention with float8 q, k, v under one SDPBackend (cuDNN, flash,
                  efficient); the cuDNN FP8 path is what issue 15 asks to measure beside ours.
  quantized       torch.nn.attention's experimental _scaled_dot_product_attention_quantized (per-head
                  descales of 1; FlashAttention-3 behind it where torch has one registered).
  python3 scripts/fp8_sdpa_probe.py [--out fp8_peers.json]
"""
import argparse, json, sys, warnings
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend


def shapes():
    for d in (64, 128):
        for n in (512, 1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                yield max(1, 16384 // n), 2048 // d, n, d, causal


def candidates():
    fns = {}
    for name, backend in (("sdpa:cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa:flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa:efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def f(q, k, v, causal, backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fns[name] = f
    quantized = None
    for mod in ("torch.nn.attention", "torch.nn.attention.experimental"):
        try:
            m = __import__(mod, fromlist=["_scaled_dot_product_attention_quantized"])
            quantized = getattr(m, "_scaled_dot_product_attention_quantized", None) or quantized
        except ImportError:
            continue
        if quantized is not None:
            break
    if quantized is not None:
        def fq(q, k, v, causal):
            b, hk = k.shape[0], k.shape[1]
            one = torch.ones(b, hk, device=q.device, dtype=torch.float32)
            return quantized(q, k, v, is_causal=causal, q_descale=one, k_descale=one, v_descale=one)
        fns["quantized"] = fq
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    warnings.simplefilter("ignore")  # SDPA explains each refused backend in a warning; the error line says it
    fns = candidates()
    q = torch.randn(1, 8, 256, 128, device="cuda").to(torch.float8_e4m3fn)
    working = {}
    for name, f in fns.items():
        try:
            out = f(q, q, q, False)
            torch.cuda.synchronize()
            print(f"{name}: runs (output {out.dtype}, finite {bool(torch.isfinite(out.float()).all())})")
            working[name] = f
        except Exception as e:  # noqa: BLE001 - the message is the finding
            print(f"{name}: no: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
    records = []
    from triton.testing import do_bench
    for name, f in working.items():
        for b, h, n, d, causal in shapes():
            q, k, v = (torch.randn(b, h, n, d, device="cuda").to(torch.float8_e4m3fn) for _ in range(3))
            try:
                ms = do_bench(lambda: f(q, k, v, causal), warmup=10, rep=args.reps, return_mode="median")
            except Exception as e:  # noqa: BLE001
                print(f"{name} b{b} h{h} n{n} d{d} causal {causal}: {type(e).__name__}: {str(e)[:120]}")
                continue
            flops = 4.0 * b * h * n * n * d / (2 if causal else 1)
            tf = flops / ms / 1e9
            records.append({"peer": name, "batch": b, "heads": h, "seq": n, "head_dim": d, "causal": causal,
                            "ms": ms, "tflops": tf})
            print(f"{name:12s} d{d:<4d} n{n:<6d} causal {int(causal)}  {ms:8.3f} ms  {tf:7.1f} TFLOP/s")
    if args.out:
        json.dump(records, open(args.out, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
