#!/usr/bin/env python3
"""Plots the JSON of `flashlm attention-bench` (TFLOP/s against sequence length, one line per impl, dtype,
head dim and mask) or of `flashlm bench` (time per pass for each model size and precision) as a PNG.
Several files may be given (e.g. ours and the PyTorch peers' from scripts/peers/attention_peers.py).

    python3 scripts/plot_bench.py ours.json [peers.json ...] -o plot.png [--metric fwd|bwd]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotlib import pyplot  # noqa: E402



def plot_attention(ax_f, ax_b, records):
    lines = {}
    for r in records:
        if r.get("status", "ok") != "ok":
            continue
        key = (f'{r["source"]} {r["impl"]}', r["dtype"], r["head_dim"], bool(r["causal"]))
        lines.setdefault(key, []).append(r)
    # Colour: implementation and dtype; marker: head dim; dashed: causal.
    impls = sorted({(k[0], k[1]) for k in lines})
    dims = sorted({k[2] for k in lines})
    markers = "os^Dv<>p"
    for (impl, dt, d, causal), rs in sorted(lines.items()):
        rs.sort(key=lambda r: r["seq_q"])
        style = dict(color=f"C{impls.index((impl, dt)) % 10}", marker=markers[dims.index(d) % len(markers)],
                     linestyle="--" if causal else "-", label=f"{impl} {dt} d{d}{' causal' if causal else ''}")
        ax_f.plot([r["seq_q"] for r in rs], [r["fwd_tflops"] for r in rs], **style)
        if any(r.get("bwd_tflops") for r in rs):
            ax_b.plot([r["seq_q"] for r in rs if r.get("bwd_tflops")], [r["bwd_tflops"] for r in rs if r.get("bwd_tflops")],
                      **style)
    for ax, what in ((ax_f, "forward"), (ax_b, "backward")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"attention {what}")
        ax.grid(alpha=0.3)
    # Beside the axes, where no line runs under it.
    ax_b.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)


def plot_lm(ax, records):
    ok = [r for r in records if r.get("status") == "ok"]
    sizes = ["tiny", "small", "medium", "large", "xl", "2.7B"]  # by parameter count; other names after them
    groups = sorted({(r["model"], r["context"], r["precision"], r["attention"]) for r in ok},
                    key=lambda g: (sizes.index(g[0]) if g[0] in sizes else len(sizes), g))
    passes = [p for p in ("fwd", "fwd-bwd", "step") if any(r["pass"] == p for r in ok)]
    width = 0.8 / max(1, len(passes))
    for i, p in enumerate(passes):
        ys, errs = [], []
        for g in groups:
            match = [r for r in ok if (r["model"], r["context"], r["precision"], r["attention"]) == g and r["pass"] == p]
            ys.append(match[0]["mean_ms"] if match else 0)
            errs.append((match[0].get("std_ms") or 0) if match else 0)
        # Error bars: one standard deviation of the timed steps.
        ax.bar([x + i * width for x in range(len(groups))], ys, width, yerr=errs, capsize=3, label=p)
    ax.set_xticks([x + width * (len(passes) - 1) / 2 for x in range(len(groups))])
    ax.set_xticklabels([f"{m}\nctx {c}\n{p} {a}" for m, c, p, a in groups], fontsize=8)
    ax.set_ylabel("ms per step (mean ± std)")
    ax.set_title("flashlm bench")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    ax.grid(alpha=0.3, axis="y")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    plt = pyplot()

    records = []
    for path in a.json:
        doc = json.load(open(path))
        # Our impls and the peers' share names ("flash"): label each line with where it came from.
        source = "flashlm" if str(doc.get("tool", "")).startswith("flashlm") else "torch"
        for r in doc["records"]:
            r["source"] = source
        records += doc["records"]
    if records and "fwd_tflops" in records[0]:
        fig, (ax_f, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
        plot_attention(ax_f, ax_b, records)
    else:
        fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(records) / 3), 5))
        plot_lm(ax, records)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120, bbox_inches="tight")  # "tight" keeps the legends beside the axes in the image
    print(f"wrote {a.out} from {len(records)} records")


if __name__ == "__main__":
    main()
