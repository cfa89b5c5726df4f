#!/usr/bin/env python3
"""Host time per flashlm attention call from PyTorch above the C call itself.

For each entry point, a loop of calls on a tiny problem (so the kernel costs little): microseconds per
call, and the same minus one bare C call on prepacked arguments (the library's own validation and
kernel, which every path pays) = the Python-side overhead. Forward and forward+backward. On CUDA the
calls are asynchronous, so the loop times the host side only (a synchronize before and after).

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


def per_call_us(fn, device, calls, repeats):
    """Median over `repeats` loops of `calls` calls: microseconds per call. On the CPU the clock is the
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
    return statistics.median(samples)


def bare_forward(q, k, v, causal):
    """The C forward on bhsd arguments packed once: what every path pays at least (C checks, the kernel)."""
    o, lse = torch_ops._forward_outputs(q, "bhsd")
    stream = torch_ops._raw_stream(q.get_device()) if q.is_cuda else 0
    fields = [f for t in (q, k, v, o) for f in torch_ops._describe(t, True)]
    fields += [*torch_ops._describe_lse(lse), *torch_ops._options(causal, False, None, False, "flash"), stream]
    buf = L._CallBuffer()  # its own: the package's per-thread buffer is repacked by every other call
    L.FORWARD.pack_into(buf.buffer, 0, *fields)
    args = buf.forward_args
    fn = L.lib.flashlm_attention_forward
    keep = (o, lse, buf)  # the packed pointers must stay valid
    return lambda: fn(*args) if keep else None


def bare_backward(q, k, v, causal):
    o, lse = torch_ops._forward(q, k, v, "bhsd", causal, False, None, False, "flash")
    dout = torch.randn_like(o)
    grads = [torch.empty_like(t) for t in (q, k, v)]
    stream = torch_ops._raw_stream(q.get_device()) if q.is_cuda else 0
    fields = [f for t in (q, k, v, o) for f in torch_ops._describe(t, True)] + list(torch_ops._describe_lse(lse))
    fields += [f for t in (dout, *grads) for f in torch_ops._describe(t, True)]
    fields += [*torch_ops._options(causal, False, None, False, "flash"), stream]
    buf = L._CallBuffer()
    L.BACKWARD.pack_into(buf.buffer, 0, *fields)
    args = buf.backward_args
    fn = L.lib.flashlm_attention_backward
    keep = (o, lse, dout, grads, buf)
    return lambda: fn(*args) if keep else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="1x1x16x16", help="BxHxSxD (bhsd), small so the kernel costs little")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
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
          f"{dtype}; causal; {a.calls} calls x {a.repeats}, median")
    c_fwd = per_call_us(bare_forward(qd, kd, vd, causal), a.device, a.calls, a.repeats)
    c_bwd = per_call_us(bare_backward(qd, kd, vd, causal), a.device, a.calls, a.repeats)
    with torch.no_grad():
        entries = {
            "C call alone (packed once)": (c_fwd, None),
            "torch.ops.flashlm.attention_fwd": (
                per_call_us(lambda: torch.ops.flashlm.attention_fwd(qd, kd, vd, "bhsd", causal, False, None,
                                                                False, "flash"),
                            a.device, a.calls, a.repeats), None),
            "flashlm.scaled_dot_product_attention, no grad": (
                per_call_us(lambda: flashlm.scaled_dot_product_attention(q, k, v, is_causal=causal), a.device, a.calls,
                            a.repeats), None),
            "F.scaled_dot_product_attention, no grad": (
                per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), a.device, a.calls,
                            a.repeats), None),
        }
    entries["flashlm.scaled_dot_product_attention, requires grad"] = (
        per_call_us(lambda: flashlm.scaled_dot_product_attention(q, k, v, is_causal=causal), a.device, a.calls,
                    a.repeats), None)
    entries["C forward + backward alone"] = (c_fwd, c_bwd)

    def fwd_bwd(f):
        return lambda: torch.autograd.grad(f(q, k, v, is_causal=causal), (q, k, v), dout)

    entries["flashlm.scaled_dot_product_attention fwd+bwd"] = (
        per_call_us(fwd_bwd(flashlm.scaled_dot_product_attention), a.device, a.calls // 2, a.repeats), "fb")
    entries["F.scaled_dot_product_attention fwd+bwd"] = (
        per_call_us(fwd_bwd(F.scaled_dot_product_attention), a.device, a.calls // 2, a.repeats), "fb")
    rows = []
    print("\n| entry point | µs per call | above the C call(s) µs |")
    print("|---|---|---|")
    for name, (us, kind) in entries.items():
        if name == "C forward + backward alone":
            us, above = c_fwd + c_bwd, 0.0
        elif kind == "fb":
            above = us - c_fwd - c_bwd
        else:
            above = us - c_fwd
        peer = name.startswith("F.")
        rows.append(dict(entry=name, us_per_call=us, above_c_us=None if peer else above))
        print(f"| {name} | {us:.2f} | {'(peer: its own kernel)' if peer else f'{above:.2f}'} |")
    if a.out:
        json.dump(dict(tool="torch_op_overhead", device=a.device, torch=torch.__version__, shape=a.shape,
                       dtype=str(dtype), rows=rows), open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
