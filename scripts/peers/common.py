"""What every peer script shares: timing, the run's provenance and the JSON file flashlm's compare reads.

Records use flashlm's own field names (attention-bench's, bench's, ddp-bench's), so compare.py matches a
peer's row with ours by the same keys.
"""
import datetime
import json
import statistics
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def pick_device(name):
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda: no CUDA device is visible")
    return torch.device(name)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


L2_FLUSH_BYTES = 256 << 20


def time_ms(fn, device, warmup, reps, flush_l2=False):
    """Milliseconds of each of `reps` calls of fn after `warmup` untimed ones (CUDA events on a GPU).

    flush_l2 (GPU): read a 256 MiB buffer before each call, outside the timed region, as `flashlm
    attention-bench --decode` does for its `ms`: the operands come from HBM, and the read keeps the GPU busy
    while the host prepares the call, so that the host's share is not counted. A read rather than Triton
    do_bench's memset, whose dirty lines would be written back during the timed call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    flush = (torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=device)
             if flush_l2 and device.type == "cuda" else None)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if flush is not None:
                flush.amax()
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def moments(ms):
    return dict(mean_ms=statistics.fmean(ms), std_ms=statistics.stdev(ms) if len(ms) > 1 else 0.0,
                median_ms=statistics.median(ms))


def is_oom(err):
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)
    return isinstance(err, oom) or "out of memory" in str(err)


def device_label(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def write_report(path, tool, device, records, **extra):
    doc = dict(tool=tool, device=device_label(device), torch=torch.__version__,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               command=sys.argv, records=records, **extra)
    text = json.dumps(doc, indent=1) + "\n"
    if path in ("", "-"):
        sys.stdout.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)
