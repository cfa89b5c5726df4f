#!/usr/bin/env python3
"""flashlm's attention from PyTorch, side by side with F.scaled_dot_product_attention, on one GPU.

1. Attention alone: flashlm.attention(layout="bhsd") against SDPA's flash and cuDNN backends, forward and
   forward+backward, bf16, causal and not (median of triton's do_bench).
2. Packed variable-length sequences (--varlen): flashlm.flash_attn_varlen_func on the pack (offsets on the GPU,
   and on the CPU, which spares the per-call read-back) against SDPA on the same sequences padded to the
   longest: flash and cuDNN without a mask (the padded work's cost; their rows are right under a causal mask
   only, since without one a query also sees the padding keys) and the memory-efficient backend with a
   padding mask (right either way, and the rows flashlm's output is checked against). TFLOP/s count the
   useful (unpadded) work.
3. The CS336 LM train step (shared/bench/lm_peers.py's run()) with every F.scaled_dot_product_attention
   call of the model replaced by flashlm.attention, against the unmodified model.

  FLASHLM_LIBRARY=.../libflashlm.so PYTHONPATH=python python3 scripts/torch_attention_bench.py \
      --peers /path/to/shared/bench --out torch-swap.json
  # attention alone, a GQA shape (64 query heads, 8 key/value heads):
  ... scripts/torch_attention_bench.py --peers /path/to/shared/bench --models "" --shapes 1x64x16384x128x8
  # varlen against padded SDPA only:
  ... scripts/torch_attention_bench.py --peers /path/to/shared/bench --models "" --shapes "" --varlen default
"""
import argparse
import importlib
import json
import math
import os
import statistics
import sys
import types

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashlm

BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}


def attention_flops(b, h, n, d, causal, backward):
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    return flops * (3.5 if backward else 1.0)  # backward = 2.5x forward, as SPEC §2 counts


def attention_fn(impl, causal, gqa):
    if impl == "flashlm":
        return lambda q, k, v: flashlm.attention(q, k, v, causal=causal, layout="bhsd")

    def sdpa(q, k, v):
        with sdpa_kernel([BACKENDS[impl]]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return sdpa


def attention_alone(shapes, impls):
    rows = []
    for (b, h, n, d, hk) in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(b, heads, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for heads in (h, hk, hk))
            dout = torch.randn_like(q)
            for impl in impls:
                f = attention_fn(impl, causal, hk != h)
                try:
                    fwd = do_bench(lambda: f(q, k, v), warmup=25, rep=100, return_mode="median")
                    fb = do_bench(lambda: torch.autograd.grad(f(q, k, v), (q, k, v), dout), warmup=25, rep=100,
                                  return_mode="median")
                except Exception as e:  # an unsupported shape for a backend is a row, not the end
                    print(f"| {b} | {h}/{hk} | {n} | {d} | {int(causal)} | {impl} | failed: {repr(e)[:80]} |")
                    continue
                r = dict(batch=b, heads=h, kv_heads=hk, seq=n, head_dim=d, causal=causal, impl=impl, fwd_ms=fwd,
                         fwd_bwd_ms=fb,
                         fwd_tflops=attention_flops(b, h, n, d, causal, False) / fwd / 1e9,
                         fwd_bwd_tflops=attention_flops(b, h, n, d, causal, True) / fb / 1e9)
                rows.append(r)
                print(f"| {b} | {h}/{hk} | {n} | {d} | {int(causal)} | {impl} | {fwd:.3f} | {fb:.3f} | "
                      f"{r['fwd_tflops']:.0f} | {r['fwd_bwd_tflops']:.0f} |", flush=True)
    return rows


# Packs of sequence lengths: ragged (one long document, many short ones, 16355 tokens), and eight equal
# sequences (2048 each), where padding costs nothing and the varlen call's own overhead shows.
DEFAULT_PACKS = "8192,4096,2048,1024,512,256,128,64,32,17,1;2048,2048,2048,2048,2048,2048,2048,2048"


def varlen_flops(lengths, h, d, causal, backward):
    return sum(attention_flops(1, h, n, d, causal, backward) for n in lengths)


def varlen_vs_padded(packs, heads, dims):
    """Each pack as flashlm varlen and as SDPA on the padded batch; every sequence causal or not."""
    rows = []
    for lengths in packs:
        b, longest, total = len(lengths), max(lengths), sum(lengths)
        cu = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(b)], dtype=torch.int32)
        for d in dims:
            for causal in (False, True):
                q, k, v = (torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                dout = torch.randn_like(q)
                padded = [torch.zeros(b, heads, longest, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
                for t, src in zip(padded, (q, k, v)):
                    for i, n in enumerate(lengths):
                        t[i, :, :n] = src[int(cu[i]):int(cu[i]) + n].transpose(0, 1)
                pq, pk, pv = (t.requires_grad_(True) for t in padded)
                pdout = torch.randn_like(pq)
                valid = torch.arange(longest, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None]
                mask = valid[:, None, None, :]  # keys past a sequence's end are masked
                if causal:
                    mask = mask & torch.ones(longest, longest, dtype=torch.bool, device="cuda").tril()
                cu_gpu = cu.cuda()

                def flashlm_with(offsets):
                    return lambda: flashlm.flash_attn_varlen_func(q, k, v, offsets, offsets, longest, longest,
                                                                  causal=causal)

                def sdpa_padded(backend, attn_mask=None):
                    def f():
                        with sdpa_kernel([backend]):
                            return F.scaled_dot_product_attention(pq, pk, pv, attn_mask=attn_mask,
                                                                  is_causal=causal and attn_mask is None)
                    return f
                variants = {"flashlm-varlen (gpu offsets)": (flashlm_with(cu_gpu), (q, k, v), dout),
                            "flashlm-varlen (cpu offsets)": (flashlm_with(cu), (q, k, v), dout),
                            "sdpa-flash padded": (sdpa_padded(SDPBackend.FLASH_ATTENTION), (pq, pk, pv), pdout),
                            "sdpa-cudnn padded": (sdpa_padded(SDPBackend.CUDNN_ATTENTION), (pq, pk, pv), pdout),
                            "sdpa-efficient padded+mask": (sdpa_padded(SDPBackend.EFFICIENT_ATTENTION, mask),
                                                           (pq, pk, pv), pdout)}
                name = ",".join(map(str, lengths)) if len(set(lengths)) > 1 else f"{b}x{lengths[0]}"
                with torch.no_grad():  # the masked padded batch's rows, or the timings mean nothing
                    got = flashlm_with(cu)()
                    try:
                        want = sdpa_padded(SDPBackend.EFFICIENT_ATTENTION, mask)()
                    except RuntimeError:
                        want = sdpa_padded(SDPBackend.MATH, mask)()
                    err = max((got[int(cu[i]):int(cu[i]) + n] - want[i, :, :n].transpose(0, 1)).abs().max().item()
                              for i, n in enumerate(lengths))
                print(f"| {name} | {heads} | {d} | {int(causal)} | max abs(flashlm varlen - masked padded sdpa) "
                      f"= {err:.2e} |", flush=True)
                for impl, (f, inputs, g) in variants.items():
                    try:
                        fwd = do_bench(f, warmup=25, rep=100, return_mode="median")
                        fb = do_bench(lambda: torch.autograd.grad(f(), inputs, g), warmup=25, rep=100,
                                      return_mode="median")
                    except Exception as e:
                        print(f"| {name} | {heads} | {d} | {int(causal)} | {impl} | failed: {repr(e)[:80]} |")
                        continue
                    r = dict(lengths=lengths, heads=heads, head_dim=d, causal=causal, impl=impl, fwd_ms=fwd,
                             fwd_bwd_ms=fb, fwd_tflops=varlen_flops(lengths, heads, d, causal, False) / fwd / 1e9,
                             fwd_bwd_tflops=varlen_flops(lengths, heads, d, causal, True) / fb / 1e9)
                    rows.append(r)
                    print(f"| {name} | {heads} | {d} | {int(causal)} | {impl} | {fwd:.3f} | {fb:.3f} | "
                          f"{r['fwd_tflops']:.0f} | {r['fwd_bwd_tflops']:.0f} |", flush=True)
    return rows


class _SwappedFunctional(types.ModuleType):
    """torch.nn.functional with scaled_dot_product_attention routed to flashlm (the model's (B, H, S, D))."""

    def __init__(self):
        super().__init__("flashlm_swapped_functional")

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if torch.is_autocast_enabled():  # SDPA is on autocast's lower-precision list: do as it does
            dtype = torch.get_autocast_gpu_dtype()
            q, k, v = (t.to(dtype) for t in (q, k, v))
        return flashlm.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale)


def lm_step(peers, models, mode, context, batch, repeats):
    """lm_peers.run() with and without the swap, alternating `repeats` times (the eager model is host-bound
    and each run times only a short window): every run is recorded, the table shows the median."""
    sys.path.insert(0, peers)
    lm_peers = importlib.import_module("lm_peers")
    cs336_model = importlib.import_module("cs336_model")
    rows = []
    for size in models:
        runs = {"sdpa": [], "flashlm": []}
        for rep in range(repeats):
            for attn in ("sdpa", "flashlm") if rep % 2 == 0 else ("flashlm", "sdpa"):
                cs336_model.F = _SwappedFunctional() if attn == "flashlm" else F
                try:
                    r = lm_peers.run(size, mode, context, batch)
                except Exception as e:
                    print(f"| {size} | {mode} | {attn} | failed: {repr(e)[:100]} |")
                    continue
                r.update(attention=attn, repeat=rep)
                rows.append(r)
                runs[attn].append(r)
                torch.cuda.empty_cache()
        for attn, rs in runs.items():
            if not rs:
                continue
            med = {k: statistics.median(r[k] for r in rs) for k in ("fwd_ms", "fwd_bwd_ms", "step_ms", "peak_step_mib")}
            print(f"| {size} | {mode} | {attn} | {med['fwd_ms']:.2f} | {med['fwd_bwd_ms']:.2f} | {med['step_ms']:.2f} | "
                  f"{len(rs)} | {med['peak_step_mib']:.0f} |", flush=True)
    cs336_model.F = F
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", required=True, help="directory with lm_peers.py and cs336_model.py")
    ap.add_argument("--models", default="small", help="LM sizes for part 2, comma separated; empty skips it")
    ap.add_argument("--mode", default="bf16", help="lm_peers mode (fp32, bf16, bf16-compile: flashlm's ops trace "
                    "without graph breaks)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="alternating runs of each variant of the LM step")
    ap.add_argument("--shapes", default="4x12x512x64,4x16x1024x64,4x16x4096x64,4x16x1024x128,4x16x4096x128,"
                    "1x16x16384x128", help="attention shapes BxHxSxD or BxHxSxDxHkv (GQA: Hkv key/value heads), "
                    "comma separated; empty: none (4x12x512x64 is the small LM's)")
    ap.add_argument("--grid", default="", help="'fa': add flashlm attention-bench's fa grid (16k tokens, H*D = 2048, "
                    "d 64/128, seq 512..16384)")
    ap.add_argument("--varlen", default="", help="'default' or packs of sequence lengths (';' between packs, ',' "
                    "between lengths) for varlen against padded SDPA; empty: none")
    ap.add_argument("--varlen-heads", type=int, default=16)
    ap.add_argument("--varlen-dims", default="64,128")
    ap.add_argument("--out", default="torch-swap.json")
    a = ap.parse_args()
    shapes = []
    for s in a.shapes.split(","):
        if not s:
            continue
        dims = [int(x) for x in s.split("x")]
        if len(dims) not in (4, 5) or dims[1] % dims[-1]:
            ap.error(f"--shapes: '{s}' is not BxHxSxD or BxHxSxDxHkv with Hkv dividing H")
        shapes.append(tuple(dims) if len(dims) == 5 else (*dims, dims[1]))
    if a.grid == "fa":
        shapes += [(max(1, 16384 // n), 2048 // d, n, d, 2048 // d) for d in (64, 128)
                   for n in (512, 1024, 2048, 4096, 8192, 16384)]
    elif a.grid:
        ap.error(f"--grid: unknown grid '{a.grid}' (fa)")
    print(f"flashlm {flashlm.__version__} from {flashlm._lib.lib._name}; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name()}")
    print("\n| batch | heads (q/kv) | seq | d | causal | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    alone = attention_alone(shapes, ["flashlm", "sdpa-flash", "sdpa-cudnn"])
    packs = []
    for p in (DEFAULT_PACKS if a.varlen == "default" else a.varlen).split(";"):
        if p:
            try:
                packs.append([int(n) for n in p.split(",")])
            except ValueError:
                ap.error(f"--varlen: '{p}' is not comma-separated sequence lengths")
            if min(packs[-1]) < 1:
                ap.error(f"--varlen: '{p}': lengths must be >= 1")
    varlen = []
    if packs:
        print("\n| pack (lengths) | heads | d | causal | impl | fwd ms | fwd+bwd ms | useful fwd TFLOP/s | "
              "useful fwd+bwd TFLOP/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        varlen = varlen_vs_padded(packs, a.varlen_heads, [int(d) for d in a.varlen_dims.split(",")])
    if a.models:
        print(f"\n| model | mode | attention | fwd ms | fwd+bwd ms | step ms | runs (median shown) | peak step MiB |")
        print("|---|---|---|---|---|---|---|---|")
    lm = lm_step(a.peers, a.models.split(","), a.mode, a.context, a.batch, a.repeats) if a.models else []
    json.dump(dict(tool="torch_attention_bench", device=torch.cuda.get_device_name(), torch=torch.__version__,
                   flashlm=flashlm.__version__, attention=alone, varlen=varlen, lm=lm), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
