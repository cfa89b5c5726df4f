#!/usr/bin/env python3
"""PyTorch's FlexAttention with a sliding window (a block mask) and soft-capping (a score_mod), on the shapes of
`flashlm attention-bench --window L,R --softcap C`, as its JSON.

  flashlm attention-bench --batch 1 --heads 32 --seq 32768 --d 128 --causal=1 --window 4096,0 --impl flash \\
      --dtype bf16 --format json --out ours-window.json
  python3 scripts/peers/flex_attention_peer.py --shapes 1x32x32768x128 --causal 1 --window 4096,0 --out flex-window.json
  python3 scripts/peers/compare.py attention ours-window.json flex-window.json --peer flex

  (soft-capping: --shapes 1x16x8192x256 --softcap 50 on both sides)

The window is flash-attn's window_size (query i sees keys i - L .. i + R, -1 leaving a side unbounded; causal
makes R 0), top-left aligned (the queries and keys have one length here). Each record is attention-bench's
(impl "flex", window_left, window_right, softcap, fwd_ms, bwd_ms = the backward alone, peak memory), TFLOP/s
counted as attention-bench counts them: the FlashAttention papers' square or half square, or with a window
4 · B · H · D per visible (query, key) pair. The median of --reps timed calls after --warmup, on fresh random
inputs; flex_attention is compiled (torch.compile) unless --no-compile (the CPU dry run). FlexAttention has no
backward on the CPU: there the records hold the forward only.
"""
import argparse
import statistics

import torch

from common import DTYPES, is_oom, pick_device, time_ms, write_report


def parse_shapes(text):
    out = []
    for item in text.split(","):
        parts = [int(x) for x in item.split("x")]
        if len(parts) not in (4, 5) or min(parts) < 1:
            raise SystemExit(f"error: --shapes: '{item}' is not BxHxNxD or BxHxNxDxHk")
        b, h, n, d = parts[:4]
        out.append((b, h, n, d, parts[4] if len(parts) == 5 else h))
    return out


def parse_window(text):
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"error: --window: expected L,R (two integers), got '{text}'")
    if left < -1 or right < -1:
        raise SystemExit(f"error: --window: each side is -1 (unbounded) or a number of keys >= 0, got '{text}'")
    return left, right


def forward_flops(b, h, n, d, causal, left, right):
    """attention-bench's count (src/bench/attention_bench.cpp): the papers' formula without a window, else
    4 * B * H * D per visible pair."""
    right = 0 if causal else right
    if left < 0 and (causal or right < 0):
        return 4 * b * h * n * n * d / (2 if causal else 1)
    pairs = 0
    for i in range(n):
        lo = 0 if left < 0 else min(max(i - left, 0), n)
        hi = n if right < 0 else min(max(i + right + 1, 0), n)
        pairs += max(0, hi - lo)
    return 4 * b * h * d * pairs


def band_mask_mod(causal, left, right):
    right = 0 if causal else right

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= 0  # all true, as a tensor
        if left >= 0:
            keep = keep & (kv_idx >= q_idx - left)
        if right >= 0:
            keep = keep & (kv_idx <= q_idx + right)
        return keep

    return mask_mod


def softcap_score_mod(cap):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def measure(shape, causal, window, cap, dtype, device, warmup, reps, compile_flex):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    b, h, n, d, hk = shape
    left, right = window
    rec = dict(impl="flex", batch=b, heads=h, kv_heads=hk, seq_q=n, seq_k=n, head_dim=d, causal=causal,
               window_left=left, window_right=right, softcap=cap,
               dtype=[k for k, v in DTYPES.items() if v == dtype][0], device=device.type, status="ok")
    banded = left >= 0 or (not causal and right >= 0) or causal
    try:
        block_mask = None
        if banded:
            block_mask = create_block_mask(band_mask_mod(causal, left, right), None, None, n, n, device=device.type)
        score_mod = softcap_score_mod(cap) if cap > 0 else None
        attend = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
        backward = device.type == "cuda"  # FlexAttention has no backward on the CPU
        q = torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=backward)
        k = torch.randn(b, hk, n, d, device=device, dtype=dtype, requires_grad=backward)
        v = torch.randn(b, hk, n, d, device=device, dtype=dtype, requires_grad=backward)
        kwargs = dict(block_mask=block_mask, score_mod=score_mod, enable_gqa=hk != h)
        fwd = time_ms(lambda: attend(q, k, v, **kwargs), device, warmup, reps)
        bwd = None
        if backward:
            torch.cuda.reset_peak_memory_stats(device)
            out = attend(q, k, v, **kwargs)
            grad = torch.randn_like(out)
            bwd = time_ms(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device, warmup, reps)
            rec["peak_bwd_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    except RuntimeError as e:  # a shape it does not take, or memory
        rec["status"] = "oom" if is_oom(e) else "unsupported"
        rec["message"] = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        return rec
    flops = forward_flops(b, h, n, d, causal, left, right)
    rec.update(fwd_ms=statistics.median(fwd), fwd_tflops=flops / statistics.median(fwd) / 1e9)
    if bwd is not None:
        rec.update(bwd_ms=statistics.median(bwd), bwd_tflops=2.5 * flops / statistics.median(bwd) / 1e9)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", required=True, help="BxHxNxD[xHk],...")
    ap.add_argument("--causal", default="1", help="0, 1 or 0,1")
    ap.add_argument("--window", default="-1,-1", help="L,R as flash-attn's window_size (-1: unbounded)")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap * tanh(score / softcap); 0 is off")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="eager flex_attention (unfused; the CPU dry run)")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    if a.softcap < 0 or a.softcap != a.softcap:
        raise SystemExit(f"error: --softcap: expected a number >= 0, got {a.softcap}")
    device = pick_device(a.device)
    window = parse_window(a.window)
    records = []
    for shape in parse_shapes(a.shapes):
        for causal in (c == "1" for c in a.causal.split(",")):
            records.append(measure(shape, causal, window, a.softcap, DTYPES[a.dtype], device, a.warmup, a.reps,
                                   not a.no_compile))
            r = records[-1]
            if r["status"] == "ok":
                bwd = (f"bwd {r['bwd_ms']:.3f} ms ({r['bwd_tflops']:.1f} TFLOP/s)" if "bwd_ms" in r
                       else "no backward on the cpu")
                print(f"flex {shape} causal={int(causal)} window={window} softcap={a.softcap}: fwd {r['fwd_ms']:.3f} ms "
                      f"({r['fwd_tflops']:.1f} TFLOP/s), {bwd}", flush=True)
            else:
                print(f"flex {shape} causal={int(causal)}: {r['status']} ({r.get('message', '')})", flush=True)
    write_report(a.out, "peers/flex_attention_peer", device, records, reps=a.reps, warmup=a.warmup)


if __name__ == "__main__":
    main()
