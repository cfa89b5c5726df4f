#!/usr/bin/env python3
"""The glue of the multi-GPU CS336 leaderboard step (scripts/gpu-check.sh two-gpu): flashlm runs that step through
`mpirun -np N flashlm train --ddp fsdp`, whose output is a metrics log rather than bench's JSON.

  leaderboard.py tokens --vocab 151936 --count 1048576 OUT.bin
      Random token ids as a token file flashlm reads (llm.c's uint32 format above 65536 ids; nanoGPT's
      uint16 below): uniform ids, where train's `--data synthetic` (uint32 beyond vocab 65536 since
      issue 35) is a Markov chain.
  leaderboard.py record METRICS.jsonl --model cs336-8b --context 32768 --batch-per-rank 1 --world 2 \\
      --precision bf16 --variant fsdp [--log TRAIN.log] [--gpu-memory SAMPLES.csv] [--skip 1] --out OURS.json
      One record in bench's field names (model, context, batch = the global batch, precision, pass = step,
      mean/std/median ms of the steps after the first --skip, tokens/s, MFU per GPU by SPEC's and the useful
      count, world_size, variant) from train's --log, so compare.py sets it beside scripts/peers/fsdp2_peer.py's.
      --log (train's output) gives the recomputation plan the memory plan chose; --gpu-memory (nvidia-smi
      --query-gpu=index,memory.used --format=csv,noheader,nounits -lms N) the peak MiB each GPU showed.
  leaderboard.py summary REPORT.json...
      One markdown row per record of the step (its status where not ok) in any of the reports (flashlm bench's, this record's, the
      peers'): implementation, GPUs, precision, median ms, useful MFU, peak MiB per rank; and flashlm's
      step on N GPUs over its step on one where both are there.
Exits 2 on bad arguments, 1 on a runtime error and when `record` found no timed step (its record says why).
"""
import argparse
import json
import os
import random
import re
import sys

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
from prepare_data import token_file_bytes  # noqa: E402  (scripts/prepare_data.py owns the file formats)

MAX_TOKENS = 1 << 30


def tokens(a):
    rng = random.Random(a.seed)
    ids = [rng.randrange(a.vocab) for _ in range(a.count)]
    with open(a.out, "wb") as f:
        f.write(token_file_bytes(ids, a.vocab))


def read_steps(path):
    """ms_per_step of each logged step, in step order (train --log-every 1 logs every one)."""
    steps = []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise SystemExit(f"error: {path}:{n}: not JSON ({e})")
                if isinstance(row, dict) and "ms_per_step" in row and "step" in row:
                    steps.append((int(row["step"]), float(row["ms_per_step"])))
    except OSError as e:
        raise SystemExit(f"error: {path}: {e}")
    return [ms for _, ms in sorted(steps)]


def gpu_peaks(path):
    """The largest memory.used (MiB) each GPU index showed in nvidia-smi's CSV samples."""
    peaks = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.split(",")]
            if len(cells) == 2 and cells[0].isdigit() and cells[1].isdigit():
                peaks[int(cells[0])] = max(peaks.get(int(cells[0]), 0), int(cells[1]))
    return [peaks[i] for i in sorted(peaks)]


def record(a):
    from common import moments  # (torch)
    from cs336_lm import LM, PEAK_FLOPS  # the flops count is the peers' own
    import torch
    with torch.device("meta"):
        model = LM(a.model, a.context)
    rec = dict(impl=a.impl, variant=a.variant, model=a.model, context=a.context, batch=a.world * a.batch_per_rank,
               batch_per_rank=a.batch_per_rank, world_size=a.world, precision=a.precision, device=a.device,
               recompute=a.recompute, status="ok")
    rec["pass"] = "step"
    if a.log:
        with open(a.log, errors="replace") as f:
            text = f.read()
        plan = re.search(r"memory plan \(recompute ([^)]+)\)", text)
        if plan:
            rec["recompute"] = plan.group(1)
        refused = re.search(r"^error: .*", text, re.M)
        if refused:
            rec["message"] = refused.group(0)[:300]
    ms = read_steps(a.metrics) if os.path.exists(a.metrics) else []
    timed = ms[a.skip:]
    if not timed:  # refused by the memory plan (its message names the shortfall), or died on the way
        rec.setdefault("message", f"{a.metrics}: no step after the first {a.skip} was logged")
        rec["status"] = "oom" if "memory" in rec["message"] else "error"
    else:
        rec.update(moments(timed), steps_ms=timed)
        seconds = rec["median_ms"] / 1e3
        rec["tokens_per_s"] = rec["batch"] * a.context / seconds
    if timed and a.device == "cuda":
        per_gpu = a.batch_per_rank * a.context / seconds / PEAK_FLOPS
        rec["mfu"] = model.train_flops_per_token() * per_gpu
        rec["mfu_useful"] = model.train_flops_per_token(useful=True) * per_gpu
    if a.gpu_memory and os.path.exists(a.gpu_memory):
        peaks = gpu_peaks(a.gpu_memory)
        if peaks:
            rec["peak_mib_per_rank"] = peaks[:a.world]
            rec["peak_mib"] = max(rec["peak_mib_per_rank"])
            rec["peak_source"] = "nvidia-smi memory.used (the CUDA context and NCCL included)"
    doc = dict(tool="peers/leaderboard record", command=sys.argv, records=[rec])
    text = json.dumps(doc, indent=1) + "\n"
    if a.out in ("", "-"):
        sys.stdout.write(text)
    else:
        with open(a.out, "w") as f:
            f.write(text)
    print(f"{a.impl} {a.variant} world {a.world} {a.precision}: {rec.get('median_ms', rec['status'])} ms",
          file=sys.stderr)
    return rec["status"] == "ok"


def summary(a):
    def cell(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "—"

    ours = {}  # world size: flashlm's fastest step there
    print("| impl | GPUs | model | ctx | batch | precision | recompute | median ms | useful MFU | peak MiB per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for path in a.reports:
        try:
            with open(path) as f:
                records = json.load(f)["records"]
        except (OSError, ValueError, KeyError) as e:
            print(f"| {path}: not read ({e}) |" + " |" * 9)
            continue
        for r in records:
            if r.get("pass") != "step" and "step_ms" not in r:
                continue
            median = r.get("median_ms", r.get("step_ms"))
            if r.get("status", "ok") != "ok":
                median = r["status"]
            impl = r.get("impl", "flashlm")  # bench's records name no impl
            if impl == "flashlm" and not isinstance(median, str):
                ours[r.get("world_size", 1)] = min(median, ours.get(r.get("world_size", 1), median))
            peaks = r.get("peak_mib_per_rank") or ([r["peak_mib"]] if r.get("peak_mib") else [])
            variant = r.get("variant")
            print(f"| {impl}{'/' + variant if variant and variant != impl else ''} | {r.get('world_size', 1)} | "
                  f"{r.get('model', '?')} | {r.get('context', '?')} | {r.get('batch', '?')} | "
                  f"{r.get('precision', '?')} | "
                  f"{r.get('recompute', '?')} | {cell(median, '.1f') if not isinstance(median, str) else median} | "
                  f"{cell(r.get('mfu_useful'), '.3f')} | {', '.join(f'{p:.0f}' for p in peaks) or '—'} |")
    if 1 in ours and len(ours) > 1:
        for world in sorted(w for w in ours if w > 1):
            print(f"\nflashlm's step on {world} GPUs / on one: {ours[world]:.1f} / {ours[1]:.1f} ms = "
                  f"{ours[world] / ours[1]:.3f} (issue 19's first bar at two GPUs: <= 0.55)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tokens")
    t.add_argument("--vocab", type=int, required=True)
    t.add_argument("--count", type=int, default=1 << 20)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("out")
    r = sub.add_parser("record")
    r.add_argument("metrics")
    r.add_argument("--model", required=True)
    r.add_argument("--context", type=int, required=True)
    r.add_argument("--batch-per-rank", type=int, required=True)
    r.add_argument("--world", type=int, required=True)
    r.add_argument("--precision", required=True)
    r.add_argument("--variant", default="fsdp")
    r.add_argument("--impl", default="flashlm")
    r.add_argument("--recompute", default="none", help="the plan asked for (--log gives the one chosen)")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--log")
    r.add_argument("--gpu-memory")
    r.add_argument("--skip", type=int, default=1, help="steps not timed (the first carries one-time setup)")
    r.add_argument("--out", default="-")
    s = sub.add_parser("summary")
    s.add_argument("reports", nargs="+")
    a = ap.parse_args()
    if a.command == "tokens" and not (2 <= a.vocab <= 1 << 31 and 2 <= a.count <= MAX_TOKENS):
        ap.error(f"--vocab {a.vocab} / --count {a.count}: expected 2..2^31 ids and 2..{MAX_TOKENS} tokens")
    if a.command == "record" and (a.world < 1 or a.batch_per_rank < 1 or a.context < 1 or a.skip < 0):
        ap.error("--world, --batch-per-rank and --context must be >= 1, --skip >= 0")
    ok = {"tokens": tokens, "record": record, "summary": summary}[a.command](a)
    sys.exit(1 if ok is False else 0)  # record: 1 when the run gave no timed step


if __name__ == "__main__":
    main()
