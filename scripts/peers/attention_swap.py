#!/usr/bin/env python3
"""The CS336 LM trained as a PyTorch user trains it -- torch.compile(fullgraph=True), bf16 autocast, fused
AdamW -- with its attention one of SDPA flash, SDPA cuDNN or flashlm.scaled_dot_product_attention swapped in:
the train step's median ms for each, and with --profile the step's CUDA time by kernel and the host's
time by event (torch.profiler), to see where one backend's step spends what another's does not (the copies and
casts around the operator, its forward and backward kernels, the host's calls when the GPU waits on them).

  FLASHLM_LIBRARY=build/src/libflashlm_attention.so PYTHONPATH=python python3 scripts/peers/attention_swap.py \\
      --model small --shapes 1024x8,4096x4 --profile --out swap.json

Records: bench's fields (model, context, batch, pass = step, median ms) with impl = torch-compile and
attention = sdpa-flash, sdpa-cudnn or flashlm; with --profile, `kernels`: the top kernels' CUDA ms per step,
`profiled_wall_ms` and `host`: the top host events' self CPU ms per step.
"""
import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cs336_lm
from common import moments, pick_device, time_ms, write_report

BACKENDS = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "flashlm": None}


class _Functional:
    """torch.nn.functional with scaled_dot_product_attention replaced (cs336_lm calls it as F.<name>)."""

    def __init__(self, sdpa):
        self.scaled_dot_product_attention = sdpa

    def __getattr__(self, name):
        return getattr(F, name)


def step_fn(model, opt, tokens, targets):
    loss_fn = torch.compile(model.loss, fullgraph=True, dynamic=False)

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def kernel_table(run, steps, rows):
    """(CUDA ms per step, the `rows` kernels with the most CUDA time over `steps` steps as (name, CUDA ms per
    step, calls per step), the host side: wall ms per step under the profiler and the `rows` host events with the
    most self CPU time -- torch ops, the CUDA runtime calls -- as (name, self CPU ms per step, calls per step)).
    A step whose CUDA time is well below its wall time is bound by the host, and the host rows say by what."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    averages = prof.key_averages()
    events = [e for e in averages if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / 1e3 / steps
    top = [dict(name=e.key[:120], ms=e.device_time_total / 1e3 / steps, calls=e.count / steps) for e in events[:rows]]
    host = [e for e in averages if e.device_type.name == "CPU" and e.self_cpu_time_total > 0]
    host.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    host_top = [dict(name=e.key[:120], ms=e.self_cpu_time_total / 1e3 / steps, calls=e.count / steps)
                for e in host[:rows]]
    return total, top, wall, host_top


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small")
    ap.add_argument("--shapes", default="1024x8,4096x4", help="CONTEXTxBATCH, comma list")
    ap.add_argument("--attention", default="sdpa-flash,sdpa-cudnn,flashlm")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile", action="store_true",
                    help="also the CUDA time by kernel and the host time by event over 3 steps")
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    device = pick_device("cuda")
    # The compiled-graph caches key on the traced graph, which is the same for every SDPA backend: a cached
    # artifact would run the first backend's kernels for the others (seen: sdpa-cudnn ran FlashAttention-2).
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    records = []
    for shape in a.shapes.split(","):
        context, batch = (int(x) for x in shape.split("x"))
        for name in a.attention.split(","):
            if name == "flashlm":
                import flashlm
                cs336_lm.F = _Functional(flashlm.scaled_dot_product_attention)
                backend = None
            else:
                cs336_lm.F = F
                backend = BACKENDS[name]
            torch._dynamo.reset()
            torch.manual_seed(0)
            model = cs336_lm.LM(a.model, context).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            tokens = torch.randint(0, model.vocab, (batch, context), device=device)
            targets = torch.randint(0, model.vocab, (batch, context), device=device)
            rec = dict(impl="torch-compile", attention=name, model=a.model, context=context, batch=batch,
                       precision="bf16", status="ok")
            rec["pass"] = "step"
            with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                run = step_fn(model, opt, tokens, targets)
                rec.update(moments(time_ms(run, device, a.warmup, a.steps)))
                if a.profile:
                    rec["kernels_total_ms"], rec["kernels"], rec["profiled_wall_ms"], rec["host"] = \
                        kernel_table(run, 3, a.rows)
            records.append(rec)
            print(f"{a.model} ctx {context} x {batch} {name:10s} step median {rec['median_ms']:.2f} ms", file=sys.stderr)
            if a.profile:
                # Which attention kernels ran, so that a backend that fell back to another is not reported as itself.
                names = " ".join(k["name"] for k in rec["kernels"]).lower()
                want = {"sdpa-flash": "pytorch_flash", "sdpa-cudnn": "cudnn", "flashlm": "flashlm"}[name]
                rec["backend_seen"] = want in names
                if not rec["backend_seen"]:
                    print(f"  warning: no '{want}' kernel among the top {a.rows}: {name} may not have run", file=sys.stderr)
                print(f"  CUDA time by kernel, per step (total {rec['kernels_total_ms']:.2f} ms):", file=sys.stderr)
                for k in rec["kernels"]:
                    print(f"  {k['ms']:8.3f} ms {k['calls']:6.1f}x  {k['name']}", file=sys.stderr)
                print(f"  host: wall {rec['profiled_wall_ms']:.2f} ms a step under the profiler; self CPU time by "
                      "event, per step:", file=sys.stderr)
                for k in rec["host"]:
                    print(f"  {k['ms']:8.3f} ms {k['calls']:6.1f}x  {k['name']}", file=sys.stderr)
            cs336_lm.F = F
    write_report(a.out, "attention_swap", device, records)


if __name__ == "__main__":
    main()
