#!/usr/bin/env python3
"""Draws a flashlm allocation timeline (flashlm bench --memory-timeline FILE.json) as a PNG: bytes in use
over time per device, phases (forward / backward / optimizer) shaded, the peak marked and labelled with
the allocation that reached it.

    python3 scripts/plot_memory_timeline.py timeline.json timeline.png [--device cuda] [--title "..."]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plotlib import pyplot  # noqa: E402



def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("timeline")
    ap.add_argument("png")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the one with the most events)")
    ap.add_argument("--title", default=None)
    ap.add_argument("--full", action="store_true",
                    help="show the whole log; by default a long set-up before the first phase is cut off")
    a = ap.parse_args()
    plt = pyplot()

    events = json.load(open(a.timeline))["events"]
    if not events:
        sys.exit(f"{a.timeline}: no events")
    devices = [e["device"] for e in events]
    device = a.device or max(set(devices), key=devices.count)
    ev = [e for e in events if e["device"] == device]
    t = [e["t_ms"] for e in ev]
    mib = [e["current_bytes"] / 2**20 for e in ev]

    fig, ax = plt.subplots(figsize=(11, 5))
    ax.step(t, mib, where="post", color="black", linewidth=1.2, label=f"{device} memory in use")
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868"}
    start = 0
    for i in range(1, len(ev) + 1):  # shade each run of events that share a phase
        if i == len(ev) or ev[i]["phase"] != ev[start]["phase"]:
            phase = ev[start]["phase"] or "setup"
            end_t = t[i] if i < len(ev) else t[-1]
            ax.axvspan(t[start], end_t, color=colors.get(phase, "#cccccc"), alpha=0.25, linewidth=0)
            start = i
    handles = [plt.Rectangle((0, 0), 1, 1, color=c, alpha=0.25) for c in colors.values()]
    peak = max(range(len(ev)), key=lambda i: ev[i]["current_bytes"])
    ax.plot(t[peak], mib[peak], "rv", markersize=9)
    ax.annotate(f"peak {mib[peak]:.1f} MiB\n({ev[peak]['phase'] or 'setup'}: {ev[peak]['tag']})",
                (t[peak], mib[peak]), textcoords="offset points", xytext=(10, -30), fontsize=9, color="red")
    # Building a large model (weights initialised on the host) can take seconds before the first phase;
    # start the axis shortly before the first forward so that the passes are readable.
    first = next((i for i, e in enumerate(ev) if e["phase"]), None)
    if not a.full and first is not None and t[first] - t[0] > 0.2 * (t[-1] - t[0]):
        span = t[-1] - t[first]
        ax.set_xlim(t[first] - 0.15 * span, t[-1] + 0.05 * span)
        ax.text(0.01, 0.02, f"set-up (model construction) from {t[0]:.0f} ms to {t[first]:.0f} ms not shown "
                f"(--full shows it); {mib[first]:.0f} MiB allocated when the first pass starts",
                transform=ax.transAxes, fontsize=8, color="#555555")
    ax.set_xlabel("time (ms)")
    ax.set_ylabel("MiB allocated")
    ax.set_title(a.title or f"flashlm allocation timeline ({device})")
    ax.legend([ax.lines[0]] + handles, [f"{device} memory in use"] + list(colors), loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=120)
    print(f"wrote {a.png}: {len(ev)} events, peak {mib[peak]:.1f} MiB at {t[peak]:.1f} ms")


if __name__ == "__main__":
    main()
