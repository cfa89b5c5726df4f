#!/usr/bin/env python3
"""PyTorch eager on the CPU beside `flashlm bench --device cpu --pass step`: the CS336 LM's full train step.

The model is the CS336 Transformer LM as flashlm builds it (token embedding, pre-norm blocks of RMSNorm,
causal multi-head attention with RoPE through SDPA, SwiGLU; final RMSNorm, untied LM head, no biases), at
flashlm's `--model tiny|small` sizes with the same vocabulary, context and batch. One step: zero the
gradients, forward, cross-entropy, backward, clip the gradient norm to 1, AdamW (lr 1e-4, betas 0.9/0.95,
weight decay 0.1: flashlm's bench defaults), fp32.

Both run in this one invocation, alternating (flashlm, torch, flashlm, torch, ...) so that load from other
processes falls on both alike. With --clock cpu (the default) a step is timed by CPU time, not elapsed
time: torch's by this thread's CPU time (time.thread_time; needs --threads 1), flashlm's as the difference
in the child process's CPU time (getrusage) between runs of `--warmup W --steps 1` and of
`--warmup W --steps 1+N` (the medians over the repetitions), divided by N (the set-up they share cancels). That ignores the time other
processes take from a shared machine's cores. --clock wall times elapsed time (flashlm's own median).

  python3 scripts/peers/cpu_lm_peer.py --flashlm build/tools/flashlm --size tiny --context 512 --batch 4
  python3 scripts/peers/cpu_lm_peer.py --flashlm build/tools/flashlm --size small --context 128 --batch 4 --steps 3
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SIZES = {"tiny": (32, 64, 2, 4, 10000), "small": (768, 3072, 12, 12, 10000)}  # d_model, d_ff, layers, heads, vocab


def build_model(torch, d_model, d_ff, layers, heads, vocab, context, theta=10000.0, eps=1e-5):
    nn, F = torch.nn, torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d_model))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    half = d_model // heads // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(context, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()

    def rope(x):  # x: [B, H, S, Dh], rotating adjacent pairs (x[2i], x[2i+1])
        s = x.shape[-2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        c, n = cos[:s], sin[:s]
        return torch.stack((x1 * c - x2 * n, x1 * n + x2 * c), dim=-1).flatten(-2)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = RMSNorm(), RMSNorm()
            self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))
            self.w1, self.w3 = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_model, d_ff, bias=False)
            self.w2 = nn.Linear(d_ff, d_model, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.ln1(x)
            q, k, v = (p(h).view(b, s, heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, s, d_model))
            h = self.ln2(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = RMSNorm(), nn.Linear(d_model, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    return LM()


def torch_step_runner(torch, args):
    d_model, d_ff, layers, heads, vocab = SIZES[args.size]
    torch.manual_seed(0)
    model = build_model(torch, d_model, d_ff, layers, heads, vocab, args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, vocab, (args.batch, args.context), generator=g)
    targets = torch.randint(0, vocab, (args.batch, args.context), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(tokens).view(-1, vocab), targets.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def children_cpu_s():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def flashlm_run(args, steps):
    """Runs flashlm's bench; returns (its median step ms, the child's CPU seconds)."""
    cmd = [args.flashlm, "bench", "--device", "cpu", "--model", args.size, "--context", str(args.context),
           "--batch", str(args.batch), "--pass", "step", "--warmup", str(args.warmup), "--steps", str(steps),
           "--threads", str(args.threads), "--format", "json", "--quiet"]
    # flashlm's --threads sets OpenMP's pool; OpenBLAS (pthreads build) keeps its own, sized here alike.
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(args.threads))
    before = children_cpu_s()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    cpu = children_cpu_s() - before
    report = json.loads(out)
    return float(report["records"][0]["median_ms"]), cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flashlm", required=True, help="path of the flashlm binary")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="threads for both (torch.set_num_threads, --threads)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repetition")
    ap.add_argument("--reps", type=int, default=3, help="alternating repetitions of each; the median is reported")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    args = ap.parse_args()
    for name, lo, hi in (("context", 1, 65536), ("batch", 1, 1024), ("threads", 1, 1024), ("warmup", 0, 1000),
                         ("steps", 1, 1000), ("reps", 1, 100)):
        if not lo <= getattr(args, name) <= hi:
            raise SystemExit(f"error: --{name} must be in {lo}..{hi}")
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("error: --clock cpu needs --threads 1 (CPU time of several threads is not a step time)")
    if not os.access(args.flashlm, os.X_OK):
        raise SystemExit(f"error: --flashlm: '{args.flashlm}' is not an executable")

    import torch
    torch.set_num_threads(args.threads)
    step = torch_step_runner(torch, args)
    for _ in range(args.warmup):
        step()

    ours, theirs, short, long = [], [], [], []
    for _ in range(args.reps):
        if args.clock == "cpu":
            short.append(flashlm_run(args, 1)[1])
            long.append(flashlm_run(args, 1 + args.steps)[1])
            ours.append((long[-1] - short[-1]) / args.steps * 1e3)
        else:
            ours.append(flashlm_run(args, args.steps)[0])
        clock = time.thread_time if args.clock == "cpu" else time.perf_counter
        times = []
        for _ in range(args.steps):
            t0 = clock()
            step()
            times.append((clock() - t0) * 1e3)
        theirs.append(statistics.median(times))

    # CPU clock: the medians of the short and the long runs, differenced (a per-repetition difference is at
    # the mercy of one slow set-up on a loaded machine).
    m = ((statistics.median(long) - statistics.median(short)) / args.steps * 1e3 if args.clock == "cpu"
         else statistics.median(ours))
    p = statistics.median(theirs)
    print(f"torch {torch.__version__}, threads {args.threads}, clock {args.clock}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| model | ctx | batch | flashlm step ms | torch eager step ms | ratio torch/flashlm |")
    print("|---|---|---|---|---|---|")
    print(f"| {args.size} | {args.context} | {args.batch} | {m:.1f} | {p:.1f} | {p / m:.2f} |")
    print(f"flashlm per rep: {', '.join(f'{x:.1f}' for x in ours)}; torch per rep: "
          f"{', '.join(f'{x:.1f}' for x in theirs)}", file=sys.stderr)


if __name__ == "__main__":
    main()
