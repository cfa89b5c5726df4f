#!/usr/bin/env python3
"""Host time per flashlm attention call from PyTorch above the C call itself.

For each entry point, a loop of calls on a tiny problem (so the kernel costs little): microseconds per
call, and the same minus one bare C call on prepacked arguments (the library's own validation and
kernel, which every path pays) = the Python-side overhead. Forward and forward+backward. Calls that
record a graph also pay torch's autograd machinery, which any Python-defined operator pays: the last
column subtracts that floor too (a do-nothing autograd.Function with the same allocations), leaving what
flashlm's own code adds. On CUDA the calls are asynchronous, so the loop times the host side only (a
synchronize before and after).

  OMP_NUM_THREADS=1 FLASHLM_LIBRARY=.../libflashlm.so PYTHONPATH=python python3 scripts/torch_op_overhead.py \
      --device cpu
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

import flashlm
from flashlm import _lib as L
from flashlm import torch_ops


def per_call_us(fn, device, calls, repeats, statistic=statistics.median):
    """The median (or `statistic`) over `repeats` loops of `calls` calls: microseconds per call. On the CPU the clock is the
    thread's CPU time (OMP_NUM_THREADS=1 keeps the kernel on this thread), so that other processes on a
    shared machine do not count; on CUDA wall time of the host loop."""
    clock = time.perf_counter if device == "cuda" else time.thread_time
    for _ in range(max(10, calls // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = clock()
        for _ in range(calls):
            fn()
        t1 = clock()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((t1 - t0) / calls * 1e6)
    return statistic(samples)


def bare_forward(q, k, v, causal):
    """The C forward on bhsd arguments packed once: what every path pays at least (C checks, the kernel)."""
    o, lse = torch_ops._forward_outputs(q, "bhsd")
    stream = torch_ops._stream(q)
    fields = [f for t in (q, k, v, o) for f in torch_ops._describe(t, True)]
    fields += [*torch_ops._describe_lse(lse), *torch_ops._options(causal, False, None, False, "flash"), stream,
               *torch_ops._NO_VARIANT, *torch_ops._NO_EXTRA_POINTERS]
    call = L.PackedCall(L.FORWARD, fields)  # its own, outside the package's per-thread ones
    args = call.args
    fn = L.lib.flashlm_attention_forward
    keep = (o, lse, call)  # the packed pointers must stay valid
    return lambda: fn(*args) if keep else None


def bare_backward(q, k, v, causal):
    o, lse = torch_ops._forward(q, k, v, "bhsd", causal, False, None, False, "flash")
    dout = torch.randn_like(o)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    stream = torch_ops._stream(q)
    fields = [f for t in (q, k, v, o) for f in torch_ops._describe(t, True)] + list(torch_ops._describe_lse(lse))
    fields += [f for t in (dout, *grads) for f in torch_ops._describe(t, True)]
    fields += [*torch_ops._options(causal, False, None, False, "flash"), stream, *torch_ops._NO_VARIANT,
               *torch_ops._NO_EXTRA_POINTERS]
    call = L.PackedCall(L.BACKWARD, fields)
    args = call.args
    fn = L.lib.flashlm_attention_backward
    keep = (o, lse, dout, grads, call)
    return lambda: fn(*args) if keep else None


class _DoNothing(torch.autograd.Function):
    """The autograd floor: what any attention written as a Python autograd.Function pays with torch's own
    machinery alone (Function.apply, a context saving five tensors, the engine calling backward), with
    flashlm's allocations (o, lse; dq, dk, dv) and no C call."""

    @staticmethod
    def forward(ctx, q, k, v, layout, causal, bottom_right, scale, deterministic, impl):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (layout, causal, bottom_right, scale, deterministic, impl)
        return o

    @staticmethod
    def backward(ctx, dout):
        q, k, v, o, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None, None, None, None, None, None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="1x1x16x16", help="BxHxSxD (bhsd), small so the kernel costs little")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--statistic", default="median", choices=("median", "min"),
                    help="of the loops' times per call; min on a shared machine, where other load only adds")
    ap.add_argument("--out", default=None, help="JSON file for the rows")
    a = ap.parse_args()
    b, h, n, d = (int(x) for x in a.shape.split("x"))
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    q, k, v = (torch.randn(b, h, n, d, device=a.device, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    qd, kd, vd = (t.detach() for t in (q, k, v))
    causal = True
    print(f"flashlm {flashlm.__version__} ({L.path}); torch {torch.__version__}; custom ops {torch_ops.HAS_CUSTOM_OPS}; "
          f"device {a.device}{' ' + torch.cuda.get_device_name() if a.device == 'cuda' else ''}; shape {a.shape} "
          f"{dtype}; causal; {a.calls} calls x {a.repeats}, {a.statistic}")

    def time_it(fn, calls=a.calls):
        return per_call_us(fn, a.device, calls, a.repeats, min if a.statistic == "min" else statistics.median)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(q, k, v, is_causal=causal), (q, k, v), dout)

    def nothing(q, k, v, is_causal):
        return _DoNothing.apply(q, k, v, "bhsd", is_causal, False, None, False, "flash")

    c_fwd = time_it(bare_forward(qd, kd, vd, causal))
    c_bwd = time_it(bare_backward(qd, kd, vd, causal))
    floor_fwd = time_it(lambda: nothing(q, k, v, causal))
    floor_fb = time_it(fwd_bwd(nothing), a.calls // 2)
    # (name, µs per call, the C calls' µs it contains, the autograd floor's µs it contains; None: a peer)
    rows = [("C forward alone (packed once)", c_fwd, c_fwd, 0.0),
            ("C forward + backward alone", c_fwd + c_bwd, c_fwd + c_bwd, 0.0),
            ("autograd floor: do-nothing autograd.Function, forward", floor_fwd, 0.0, floor_fwd),
            ("autograd floor: do-nothing autograd.Function, fwd + autograd.grad", floor_fb, 0.0, floor_fb)]
    with torch.no_grad():
        bwd_tensors = torch.ops.flashlm.attention_fwd(qd, kd, vd, "bhsd", causal, False, None, False, "flash")
        rows += [
            ("torch.ops.flashlm.attention_fwd, no grad",
             time_it(lambda: torch.ops.flashlm.attention_fwd(qd, kd, vd, "bhsd", causal, False, None, False, "flash")),
             c_fwd, 0.0),
            ("torch.ops.flashlm.attention_bwd, no grad (what a compiled backward calls)",
             time_it(lambda: torch.ops.flashlm.attention_bwd(dout, qd, kd, vd, *bwd_tensors, "bhsd", causal, False,
                                                             None, False, "flash")), c_bwd, 0.0),
            ("flashlm.scaled_dot_product_attention, no grad",
             time_it(lambda: flashlm.scaled_dot_product_attention(q, k, v, is_causal=causal)), c_fwd, 0.0),
            ("F.scaled_dot_product_attention, no grad",
             time_it(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), None, None)]
    rows += [
        ("flashlm.scaled_dot_product_attention, requires grad",
         time_it(lambda: flashlm.scaled_dot_product_attention(q, k, v, is_causal=causal)), c_fwd, floor_fwd),
        ("flashlm.scaled_dot_product_attention, fwd + autograd.grad",
         time_it(fwd_bwd(flashlm.scaled_dot_product_attention), a.calls // 2), c_fwd + c_bwd, floor_fb),
        ("F.scaled_dot_product_attention, fwd + autograd.grad",
         time_it(fwd_bwd(F.scaled_dot_product_attention), a.calls // 2), None, None)]
    print("\n| entry point | µs per call | above the C call(s) µs | above the C call(s) and the autograd floor µs |")
    print("|---|---|---|---|")
    records = []
    for name, us, c_us, floor_us in rows:
        peer = c_us is None
        above = None if peer else us - c_us
        own = None if peer else us - c_us - floor_us
        records.append(dict(entry=name, us_per_call=us, above_c_us=above, above_c_and_floor_us=own))
        cells = "(peer: its own kernel) | —" if peer else f"{above:.2f} | {own:.2f}"
        print(f"| {name} | {us:.2f} | {cells} |")
    if a.out:
        json.dump(dict(tool="torch_op_overhead", device=a.device, torch=torch.__version__, shape=a.shape,
                       statistic=a.statistic, calls=a.calls, repeats=a.repeats,
                       dtype=str(dtype), rows=records), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
