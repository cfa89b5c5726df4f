#!/usr/bin/env python3
"""flashlm's CPU flash attention beside PyTorch's CPU scaled_dot_product_attention, in one process.

fp32, BHSD tensors, forward (no autograd) and forward + backward. The two implementations' repetitions
alternate (flashlm, torch, flashlm, torch, ...) so that load from other processes on a shared machine falls
on both alike; the table gives the median of each and the ratio torch / flashlm (> 1: flashlm is faster).
Threads: OMP_NUM_THREADS sets both OpenMP pools (flashlm's and torch's) at start-up, so run once per count:

  OMP_NUM_THREADS=1 FLASHLM_LIBRARY=build/src/libflashlm.so PYTHONPATH=python \\
      python3 scripts/cpu_attention_bench.py --reps 5
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

import flashlm

# B x H x N x D and causal: the four shapes of issue 21 and their d128 counterparts.
SHAPES = [
    (1, 8, 1024, 64, True), (1, 8, 4096, 64, True), (1, 8, 4096, 64, False), (4, 12, 512, 64, True),
    (1, 8, 1024, 128, True), (1, 8, 4096, 128, True), (1, 8, 4096, 128, False), (4, 12, 512, 128, True),
]


def parse_shape(text):
    b, h, n, d, *rest = text.split("x")
    return int(b), int(h), int(n), int(d), bool(rest and rest[0] == "causal")


def timed(fn, clock):
    start = clock()
    fn()
    return (clock() - start) * 1e3


def runners(b, h, n, d, causal):
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, h, n, d, generator=g) for _ in range(4))

    def flashlm_fwd():
        flashlm.attention_forward(q, k, v, causal=causal, layout="bhsd")

    def torch_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd(attend):
        def run():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            attend(qg, kg, vg).backward(do)
        return run

    return {
        "fwd": (flashlm_fwd, torch_fwd),
        "fwd+bwd": (fwd_bwd(lambda a, b_, c: flashlm.attention(a, b_, c, causal=causal, layout="bhsd")),
                    fwd_bwd(lambda a, b_, c: F.scaled_dot_product_attention(a, b_, c, is_causal=causal))),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of each (after one warm-up)")
    ap.add_argument("--shapes", nargs="*", help="BxHxNxD[xcausal] (default: the eight of issue 21)")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="wall: elapsed time; thread: the calling thread's CPU time (1 thread only: it ignores "
                         "the time other processes take from a shared machine's cores, and other threads' work)")
    args = ap.parse_args()
    if not 1 <= args.reps <= 1000:
        raise SystemExit("error: --reps must be in 1..1000")
    shapes = [parse_shape(s) for s in args.shapes] if args.shapes else SHAPES
    if args.clock == "thread" and torch.get_num_threads() != 1:
        raise SystemExit("error: --clock thread needs one thread (OMP_NUM_THREADS=1)")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter

    threads = os.environ.get("OMP_NUM_THREADS", "default")
    print(f"torch {torch.__version__}, torch threads {torch.get_num_threads()}, OMP_NUM_THREADS {threads}, "
          f"load average {os.getloadavg()[0]:.1f}, clock {args.clock}")
    print("| B×H×N×D | causal | pass | flashlm ms | torch ms | ratio torch/flashlm |")
    print("|---|---|---|---|---|---|")
    for b, h, n, d, causal in shapes:
        for name, (ours, theirs) in runners(b, h, n, d, causal).items():
            ours(), theirs()  # warm-up
            mine, peer = [], []
            for _ in range(args.reps):
                mine.append(timed(ours, clock))
                peer.append(timed(theirs, clock))
            m, p = statistics.median(mine), statistics.median(peer)
            print(f"| {b}×{h}×{n}×{d} | {'yes' if causal else 'no'} | {name} | {m:.1f} | {p:.1f} | {p / m:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
