#!/usr/bin/env python3
"""Draws the plots of docs/perf.md from the raw records it cites (docs/measurements/), into docs/img/.

    python3 scripts/plot_results.py [--measurements docs/measurements] [--out docs/img]

attention-fa-h200.png: attention TFLOP/s by sequence length over the fa grid (bf16; forward and backward, head
dims 64 and 128, causal dashed), flashlm beside SDPA's cuDNN and flash backends of the same call.
loss-bf16-moments.png: training loss by step with AdamW's moments in fp32, bf16 and bf16 with stochastic
rounding (the CPU runs of the bf16-moments comparison), each model beside another seed of the fp32 run.
lm-step-h200.png: the small and xl train step, flashlm beside PyTorch eager and torch.compile (same call).
"""
import argparse
import csv
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotlib import pyplot  # noqa: E402

FA_OURS = "2026-12-07-h200/s51/c2-ours-fa.json"
FA_PEERS = "2026-12-07-h200/s51/c2-peers-fa.json"
LOSSES = "2026-12-01-adamw-bf16-moments/losses.csv"
LM_OURS = ["2026-12-02-round5/c1-step-fp32.json", "2026-12-02-round5/c1-step-bf16.json"]
LM_PEERS = "2026-12-02-round5/c1-peers-lm.json"


def load(path):
    with open(path) as f:
        return json.load(f)


def plot_attention(plt, measurements, out):
    ours = [dict(r, impl="flashlm") for r in load(os.path.join(measurements, FA_OURS))["records"]]
    names = {"flash": "SDPA flash (FA2)", "cudnn": "SDPA cuDNN", "sdpa-flash": "SDPA flash (FA2)",
             "sdpa-cudnn": "SDPA cuDNN"}  # the peers script's names before and after 2026-12-03
    peers = [dict(r, impl=names.get(r["impl"], r["impl"])) for r in load(os.path.join(measurements, FA_PEERS))["records"]]
    records = [r for r in ours + peers if r.get("status", "ok") == "ok"]
    impls = ["flashlm", "SDPA cuDNN", "SDPA flash (FA2)"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for col, d in enumerate((64, 128)):
        for row, (metric, what) in enumerate((("fwd_tflops", "forward"), ("bwd_tflops", "backward"))):
            ax = axes[row][col]
            for i, impl in enumerate(impls):
                for causal in (False, True):
                    rs = sorted((r for r in records if r["impl"] == impl and r["head_dim"] == d
                                 and bool(r["causal"]) == causal and r.get(metric)), key=lambda r: r["seq_q"])
                    if rs:
                        ax.plot([r["seq_q"] for r in rs], [r[metric] for r in rs], color=f"C{i}", marker="o",
                                markersize=3, linestyle="--" if causal else "-",
                                label=f"{impl}{', causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{what}, d{d}", fontsize=10)
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("sequence length (batch × seq = 16k tokens)")
    axes[0][1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.suptitle("attention, bf16, fa grid, one H200 (2026-12-07, 28a89bf; peers torch 2.11 in the same call)",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "attention-fa-h200.png")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    return path


def plot_losses(plt, measurements, out):
    with open(os.path.join(measurements, LOSSES)) as f:
        rows = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    runs = [("tiny-0.999", "tiny, beta2 0.999"), ("mid-0.999", "mid (4 layers, d256), beta2 0.999"),
            ("small-0.95", "small (vocab 256), beta2 0.95")]
    fig, axes = plt.subplots(1, len(runs), figsize=(13, 4))
    variants = [("fp32", "fp32 moments"), ("bf16", "bf16 moments"), ("bf16-sr", "bf16 moments, stochastic"),
                ("fp32-seed1235", "fp32 moments, another seed")]
    for ax, (prefix, title) in zip(axes, runs):
        for i, (suffix, label) in enumerate(variants):
            name = f"{prefix}-{suffix}"
            if name not in rows[0]:
                continue
            pts = [(s, float(r[name])) for s, r in zip(steps, rows) if r[name]]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", linewidth=0.9,
                    linestyle=":" if "seed" in suffix else "-", label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.suptitle("AdamW moments in fp32 and bf16 (CPU, synthetic data, best loss ln 4 = 1.386; 2026-12-01, 3a19410)",
                 fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "loss-bf16-moments.png")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    return path


def plot_lm(plt, measurements, out):
    bars = {}  # (model, label) -> median ms
    for path, label in zip(LM_OURS, ("flashlm, fp32 moments", "flashlm, bf16 moments")):
        for r in load(os.path.join(measurements, path))["records"]:
            bars[(r["model"], label)] = r["median_ms"]
    names = {"torch-eager": "PyTorch eager", "torch-compile": "torch.compile"}
    for r in load(os.path.join(measurements, LM_PEERS))["records"]:
        bars[(r["model"], names[r["impl"]])] = r["median_ms"]
    labels = ["flashlm, fp32 moments", "flashlm, bf16 moments", "torch.compile", "PyTorch eager"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, model in zip(axes, ("small", "xl")):
        ys = [bars.get((model, label), 0) for label in labels]
        ax.bar(range(len(labels)), ys, color=[f"C{i}" for i in range(len(labels))])
        for x, y in enumerate(ys):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([label.replace(", ", "\n") for label in labels], fontsize=8)
        ax.set_ylabel("ms per train step (median)")
        ax.set_title(f"{model}, context 512, batch 4, bf16", fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("LM train step, one H200 (2026-12-02, b0d2d30; peers torch 2.11 in the same call)", fontsize=10)
    fig.tight_layout()
    path = os.path.join(out, "lm-step-h200.png")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    return path


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measurements", default=os.path.join(here, "..", "docs", "measurements"))
    ap.add_argument("--out", default=os.path.join(here, "..", "docs", "img"))
    a = ap.parse_args()
    plt = pyplot()
    os.makedirs(a.out, exist_ok=True)
    for draw in (plot_attention, plot_losses, plot_lm):
        print("wrote", draw(plt, a.measurements, a.out))


if __name__ == "__main__":
    main()
