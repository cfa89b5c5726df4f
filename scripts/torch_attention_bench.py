#!/usr/bin/env python3
"""flashlm's attention from PyTorch, side by side with F.scaled_dot_product_attention, on one GPU.

1. Attention alone: flashlm.attention(layout="bhsd") against SDPA's flash and cuDNN backends, forward and
   forward+backward, bf16, causal and not. Device time per call: back-to-back calls between CUDA events
   (median of 5); host time per call: the same loop timed on the host without waiting for the GPU. Then
   flashlm's speed against each peer, and the small LM's shape (4x12x512x64 causal) against the bar
   (>= 0.9x SDPA flash forward + backward).
2. Packed variable-length sequences (--varlen, CUDA): flashlm.flash_attn_varlen_func on the pack (offsets on
   the GPU, and on the CPU, which spares the per-call read-back) against SDPA on the same sequences padded
   to the longest: flash and cuDNN without a mask (the padded work's cost; their rows are right under a
   causal mask only, since without one a query also sees the padding keys) and the memory-efficient
   backend with a padding mask (right either way, and the rows flashlm's output is checked against).
   TFLOP/s count the useful (unpadded) work.
3. With --models: the CS336 LM (scripts/peers/cs336_lm.py, timed by scripts/peers/lm_peers.py's measure())
   with every F.scaled_dot_product_attention call of the model replaced by flashlm, against the unmodified
   model: forward, forward + backward and the train step.

  FLASHLM_LIBRARY=.../libflashlm_attention.so PYTHONPATH=python python3 scripts/torch_attention_bench.py \
      --shapes 4x12x512x64 --out small-lm.json                   # the small LM's shape alone
  ... scripts/torch_attention_bench.py --grid fa --out torch-attention.json   # + the fa grid
  ... scripts/torch_attention_bench.py --shapes "" --models small
  # a GQA shape (64 query heads, 8 key/value heads):
  ... scripts/torch_attention_bench.py --shapes 1x64x16384x128x8
  # varlen against padded SDPA only:
  ... scripts/torch_attention_bench.py --shapes "" --varlen default
  # on the CPU (fp32, against SDPA's CPU backend): a check that it runs, as CI does
  ... scripts/torch_attention_bench.py --device cpu --shapes 1x2x64x16,1x4x32x16x2
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import time
import types

import torch
import torch.nn.functional as F

import flashlm

SMALL_LM = (4, 12, 512, 64, 12)  # the CS336 small model's attention: batch 4, 12 heads, context 512, d 64


def attention_flops(b, h, n, d, causal, backward):
    flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    return flops * (3.5 if backward else 1.0)  # backward = 2.5x forward, as SPEC §2 counts


def attention_fn(impl, causal, gqa):
    if impl == "flashlm":
        return lambda q, k, v: flashlm.attention(q, k, v, causal=causal, layout="bhsd")
    if impl == "sdpa":  # whichever backend SDPA picks (the CPU's)
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]

    def sdpa(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return sdpa


def device_ms(fn, device, calls, repeats=5):
    """Median over `repeats` of the time per call of `calls` back-to-back calls: on CUDA between two CUDA
    events (the GPU's time, the host queueing ahead of it), on the CPU wall time."""
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples)


def host_us(fn, device, calls, repeats=5):
    """Host time per call with the GPU fed ahead: the wall time of issuing `calls` calls back to back,
    without waiting for them (a synchronize before, none inside the timed loop; the queue is drained after).
    When it is below the device time per call the GPU, not the host, sets the pace."""
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / calls)
        if device == "cuda":
            torch.cuda.synchronize()
    return statistics.median(samples)


def calls_for(ms):
    """Enough back-to-back calls for ~50 ms of timing, 5 at least."""
    return max(5, min(2000, int(50 / max(ms, 1e-3))))


def attention_alone(shapes, impls, device, dtype):
    rows = []
    for (b, h, n, d, hk) in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(b, heads, n, d, device=device, dtype=dtype, requires_grad=True)
                       for heads in (h, hk, hk))
            dout = torch.randn_like(q)
            for impl in impls:
                f = attention_fn(impl, causal, hk != h)

                def fwd():
                    return f(q, k, v)

                def fwd_bwd():
                    return torch.autograd.grad(f(q, k, v), (q, k, v), dout)
                try:
                    for g in (fwd, fwd_bwd):  # warm-up (and a failure for a backend that cannot run it)
                        for _ in range(3):
                            g()
                    first = device_ms(fwd, device, 3, repeats=1)
                    times = {}
                    for name, g, scale in (("fwd", fwd, 1), ("fwd_bwd", fwd_bwd, 3)):
                        calls = calls_for(first * scale)
                        times[name + "_ms"] = device_ms(g, device, calls)
                        times[name + "_host_us"] = host_us(g, device, calls)
                except Exception as e:  # an unsupported shape for a backend is a row, not the end
                    print(f"| {b} | {h}/{hk} | {n} | {d} | {int(causal)} | {impl} | failed: {repr(e)[:80]} |")
                    continue
                r = dict(batch=b, heads=h, kv_heads=hk, seq=n, head_dim=d, causal=causal, impl=impl, **times,
                         fwd_tflops=attention_flops(b, h, n, d, causal, False) / times["fwd_ms"] / 1e9,
                         fwd_bwd_tflops=attention_flops(b, h, n, d, causal, True) / times["fwd_bwd_ms"] / 1e9)
                rows.append(r)
                print(f"| {b} | {h}/{hk} | {n} | {d} | {int(causal)} | {impl} | {r['fwd_ms']:.3f} | "
                      f"{r['fwd_bwd_ms']:.3f} | {r['fwd_tflops']:.1f} | {r['fwd_bwd_tflops']:.1f} | "
                      f"{r['fwd_host_us']:.1f} | {r['fwd_bwd_host_us']:.1f} |", flush=True)
    return rows


def ratios(rows, impls):
    """flashlm's speed relative to each peer (peer time / flashlm time) per shape, forward and fwd+bwd."""
    out = []
    key = ("batch", "heads", "kv_heads", "seq", "head_dim", "causal")
    ours = {tuple(r[k] for k in key): r for r in rows if r["impl"] == "flashlm"}
    for r in rows:
        mine = ours.get(tuple(r[k] for k in key))
        if r["impl"] == "flashlm" or mine is None:
            continue
        out.append(dict({k: r[k] for k in key}, peer=r["impl"], fwd=r["fwd_ms"] / mine["fwd_ms"],
                        fwd_bwd=r["fwd_bwd_ms"] / mine["fwd_bwd_ms"]))
    return out


# Packs of sequence lengths: ragged (one long document, many short ones, 16355 tokens), and eight equal
# sequences (2048 each), where padding costs nothing and the varlen call's own overhead shows.
DEFAULT_PACKS = "8192,4096,2048,1024,512,256,128,64,32,17,1;2048,2048,2048,2048,2048,2048,2048,2048"


def varlen_flops(lengths, h, d, causal, backward):
    return sum(attention_flops(1, h, n, d, causal, backward) for n in lengths)


def varlen_vs_padded(packs, heads, dims):
    """Each pack as flashlm varlen and as SDPA on the padded batch; every sequence causal or not (CUDA;
    median of triton's do_bench)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
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


def lm_run(lm_peers, size, mode, context, batch):
    """The three passes of lm_peers.measure() on one model: fwd_ms, fwd_bwd_ms, step_ms (medians of 10 after
    5) and the step's peak."""
    a = argparse.Namespace(context=context, batch=batch, layers=0, checkpoint=False, warmup=5, steps=10)
    device = torch.device("cuda")
    r = {}
    for pass_name, key in (("fwd", "fwd_ms"), ("fwd-bwd", "fwd_bwd_ms"), ("step", "step_ms")):
        rec = lm_peers.measure(size, mode, pass_name, a, device)
        if rec["status"] != "ok":
            raise RuntimeError(f"{pass_name}: {rec['status']}: {rec.get('message', '')}")
        r[key] = rec["median_ms"]
        if pass_name == "step":
            r["peak_step_mib"] = rec["peak_mib"]
    return dict(r, model=size, mode=mode, context=context, batch=batch)


def lm_step(peers, models, mode, context, batch, repeats):
    """The LM's passes with and without the swap, alternating `repeats` times (the eager model is host-bound
    and each run times only a short window): every run is recorded, the table shows the median."""
    sys.path.insert(0, peers)
    lm_peers = importlib.import_module("lm_peers")
    cs336_model = importlib.import_module("cs336_lm")
    rows = []
    for size in models:
        runs = {"sdpa": [], "flashlm": []}
        for rep in range(repeats):
            for attn in ("sdpa", "flashlm") if rep % 2 == 0 else ("flashlm", "sdpa"):
                cs336_model.F = _SwappedFunctional() if attn == "flashlm" else F
                try:
                    r = lm_run(lm_peers, size, mode, context, batch)
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
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="cuda (bf16, against SDPA flash and cuDNN) or cpu (fp32, against SDPA's CPU backend: a "
                    "check that the script runs, as CI does, not a measurement)")
    ap.add_argument("--peers", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers"),
                    help="directory with lm_peers.py and cs336_lm.py (for --models; default scripts/peers)")
    ap.add_argument("--models", default="", help="LM sizes for part 2, comma separated (CUDA); empty skips it")
    ap.add_argument("--mode", default="bf16", help="lm_peers mode (fp32, bf16, bf16-compile: flashlm's ops trace "
                    "without graph breaks)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="alternating runs of each variant of the LM step")
    ap.add_argument("--shapes", default="4x12x512x64,4x16x1024x64,4x16x4096x64,4x16x1024x128,4x16x4096x128,"
                    "1x16x16384x128", help="attention shapes BxHxSxD or BxHxSxDxHkv (GQA: Hkv key/value heads), "
                    "comma separated; empty: none (4x12x512x64, the first, is the small LM's)")
    ap.add_argument("--grid", default="", help="'fa': add flashlm attention-bench's fa grid (16k tokens, H*D = 2048, "
                    "d 64/128, seq 512..16384)")
    ap.add_argument("--varlen", default="", help="'default' or packs of sequence lengths (';' between packs, ',' "
                    "between lengths) for varlen against padded SDPA (CUDA); empty: none")
    ap.add_argument("--varlen-heads", type=int, default=16)
    ap.add_argument("--varlen-dims", default="64,128")
    ap.add_argument("--out", default="torch-swap.json")
    a = ap.parse_args()
    if a.device not in ("cuda", "cpu"):
        ap.error(f"--device: '{a.device}' is not cuda or cpu")
    if a.models and a.device != "cuda":
        ap.error("--models: the LM step runs on CUDA")
    shapes = []
    for s in a.shapes.split(","):
        if not s:
            continue
        try:
            dims = [int(x) for x in s.split("x")]
        except ValueError:
            dims = []
        if len(dims) not in (4, 5) or min(dims) < 1 or (len(dims) == 5 and dims[1] % dims[4]):
            ap.error(f"--shapes: '{s}' is not BxHxSxD or BxHxSxDxHkv (positive, Hkv dividing H)")
        shapes.append(tuple(dims) if len(dims) == 5 else (*dims, dims[1]))
    if a.grid == "fa":
        shapes += [(max(1, 16384 // n), 2048 // d, n, d, 2048 // d) for d in (64, 128)
                   for n in (512, 1024, 2048, 4096, 8192, 16384)]
    elif a.grid:
        ap.error(f"--grid: unknown grid '{a.grid}' (fa)")
    device_name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    impls = ["flashlm", "sdpa-flash", "sdpa-cudnn"] if a.device == "cuda" else ["flashlm", "sdpa"]
    print(f"flashlm {flashlm.__version__} from {flashlm._lib.path}; torch {torch.__version__}; {device_name}; {dtype}")
    if a.device == "cuda":
        print("\nms: device time per call of back-to-back calls (CUDA events); host µs: issuing one call with the "
              "GPU fed ahead (below the ms figure: the GPU sets the pace)")
    else:
        print("\nms and host µs: wall time per call on the CPU (the same figure twice)")
    print("\n| batch | heads (q/kv) | seq | d | causal | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s "
          "| fwd host µs | fwd+bwd host µs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    alone = attention_alone(shapes, impls, a.device, dtype)
    speed = ratios(alone, impls)
    if speed:
        print("\n| batch | heads (q/kv) | seq | d | causal | peer | flashlm speed fwd (peer ms / ours) | fwd+bwd |")
        print("|---|---|---|---|---|---|---|---|")
        for r in speed:
            print(f"| {r['batch']} | {r['heads']}/{r['kv_heads']} | {r['seq']} | {r['head_dim']} | {int(r['causal'])} | "
                  f"{r['peer']} | {r['fwd']:.2f} | {r['fwd_bwd']:.2f} |")
        bar = [r for r in speed if (r["batch"], r["heads"], r["seq"], r["head_dim"], r["kv_heads"]) == SMALL_LM
               and r["causal"] and r["peer"] == "sdpa-flash"]
        if bar:
            verdict = "met" if bar[0]["fwd_bwd"] >= 0.9 else "NOT met"
            print(f"\nsmall LM shape 4x12x512x64 causal, fwd+bwd vs SDPA flash: {bar[0]['fwd_bwd']:.2f}x "
                  f"(bar >= 0.9x: {verdict})")
    packs = []
    for p in (DEFAULT_PACKS if a.varlen == "default" else a.varlen).split(";"):
        if p:
            try:
                packs.append([int(n) for n in p.split(",")])
            except ValueError:
                ap.error(f"--varlen: '{p}' is not comma-separated sequence lengths")
            if min(packs[-1]) < 1:
                ap.error(f"--varlen: '{p}': lengths must be >= 1")
    if packs and a.device != "cuda":
        ap.error("--varlen: runs on CUDA")
    varlen = []
    if packs:
        print("\n| pack (lengths) | heads | d | causal | impl | fwd ms | fwd+bwd ms | useful fwd TFLOP/s | "
              "useful fwd+bwd TFLOP/s |")
        print("|---|---|---|---|---|---|---|---|---|")
        varlen = varlen_vs_padded(packs, a.varlen_heads, [int(d) for d in a.varlen_dims.split(",")])
    if a.models:
        print("\n| model | mode | attention | fwd ms | fwd+bwd ms | step ms | runs (median shown) | peak step MiB |")
        print("|---|---|---|---|---|---|---|---|")
    lm = lm_step(a.peers, a.models.split(","), a.mode, a.context, a.batch, a.repeats) if a.models else []
    json.dump(dict(tool="torch_attention_bench", device=device_name, torch=torch.__version__,
                   flashlm=flashlm.__version__, attention=alone, speed=speed, varlen=varlen, lm=lm),
              open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
