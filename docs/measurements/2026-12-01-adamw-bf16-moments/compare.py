#!/usr/bin/env python3
"""The loss curves of `flashlm train --log` runs with bf16 AdamW moments against the fp32-moment run of the
same seed (docs/perf.md, "bf16 AdamW moments on the CPU"): per run, the last evaluation's loss, the mean
training loss of the last 50 steps, and the mean and largest per-step |loss - fp32's loss|.

    python3 compare.py DIR     # DIR holds <config>-<beta2>-<state>.jsonl as run.sh names them
    python3 compare.py DIR --csv losses.csv   # also every step's training loss, one column per run
"""
import argparse
import glob
import json
import os


def read_log(path):
    train, val = {}, []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "val_loss" in r:
                val.append((r["step"], r["val_loss"]))
            elif "loss" in r:
                train[r["step"]] = r["loss"]
    return train, val


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--csv")
    a = ap.parse_args()
    runs = {os.path.basename(p)[:-6]: read_log(p) for p in sorted(glob.glob(os.path.join(a.dir, "*.jsonl")))}
    # Finished runs only: they end with an evaluation at their last step.
    runs = {name: run for name, run in runs.items() if run[1] and run[1][-1][0] == max(run[0])}
    print("| run | final val loss | train loss, last 50 steps | mean \\|Δ\\| vs fp32 | max \\|Δ\\| vs fp32 |")
    print("|---|---|---|---|---|")
    for name, (train, val) in runs.items():
        config, beta2, state = name.split("-", 2)
        ref_name = f"{config}-{beta2}-fp32"
        ref = runs[ref_name][0]
        steps = sorted(train)
        last = steps[-50:]
        tail = sum(train[s] for s in last) / len(last)
        if name == ref_name:
            diffs = "—", "—"
        else:
            d = [abs(train[s] - ref[s]) for s in steps if s in ref]
            diffs = f"{sum(d) / len(d):.1e}", f"{max(d):.1e}"
        print(f"| {name} | {val[-1][1]:.4f} | {tail:.4f} | {diffs[0]} | {diffs[1]} |")
    if a.csv:
        names = list(runs)
        steps = sorted(set().union(*(runs[n][0].keys() for n in names)))
        with open(a.csv, "w") as f:
            f.write("step," + ",".join(names) + "\n")
            for s in steps:
                f.write(f"{s}," + ",".join(f"{runs[n][0][s]:.6f}" if s in runs[n][0] else "" for n in names) + "\n")


if __name__ == "__main__":
    main()
