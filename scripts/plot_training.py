#!/usr/bin/env python3
"""Draws the loss curve of `flashlm train --log metrics.jsonl`: the training loss of every step (and its
moving mean) and the validation loss of every evaluation, against the step; one or more logs, one colour each.

    python3 scripts/plot_training.py metrics.jsonl [other.jsonl ...] -o loss.png [--smooth 20]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotlib import pyplot  # noqa: E402


def read_log(path):
    train, val = [], []
    if not os.path.isfile(path):
        sys.exit(f"error: {path}: no such file")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"error: {path}:{n}: not a JSON line ({e})")
            if "val_loss" in r:
                val.append((r["step"], r["val_loss"]))
            elif "loss" in r:
                train.append((r["step"], r["loss"]))
    if not train and not val:
        sys.exit(f"error: {path}: no loss records (is it the file of train --log?)")
    return train, val


def moving_mean(ys, k):
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    ap.add_argument("--smooth", type=int, default=20, help="steps in the training loss's moving mean (1: none)")
    a = ap.parse_args()
    if a.smooth < 1:
        sys.exit("error: --smooth must be at least 1")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    names = [os.path.basename(p) for p in a.logs]
    for i, path in enumerate(a.logs):
        train, val = read_log(path)
        # The file name, or the whole path where two logs share a name.
        name = names[i] if names.count(names[i]) == 1 else path
        colour = f"C{i % 10}"
        if train:
            steps, losses = zip(*train)
            ax.plot(steps, losses, color=colour, alpha=0.25, linewidth=0.8)
            ax.plot(steps, moving_mean(list(losses), a.smooth), color=colour, label=f"{name} train (mean of {a.smooth})")
        if val:
            steps, losses = zip(*val)
            ax.plot(steps, losses, color=colour, marker="o", linestyle="--", label=f"{name} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.set_title("flashlm train")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.savefig(a.out, dpi=120, bbox_inches="tight")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
