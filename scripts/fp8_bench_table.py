#!/usr/bin/env python3
"""The FP8 forward beside the bf16 one from attention-bench JSON records (--dtype fp8,bf16 --forward-only),
optionally beside an older build's FP8 records and scripts/fp8_sdpa_probe.py's peer records: one markdown
row per shape (TFLOP/s) and the geometric means of fp8/bf16 over seq >= 1024 and over d128 seq >= 4096.
  python3 scripts/fp8_bench_table.py new.json [--old old.json] [--peers fp8_peers.json]
"""
import argparse, json, math


def by_shape(report, dtype):
    out = {}
    for r in report["records"] if isinstance(report, dict) else report:
        if r.get("dtype") == dtype and r.get("status", "ok") == "ok" and r.get("fwd_tflops"):
            out[(r["head_dim"], r["seq_q"], bool(r["causal"]))] = r["fwd_tflops"]
    return out


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("new")
    ap.add_argument("--old")
    ap.add_argument("--peers")
    a = ap.parse_args()
    new = json.load(open(a.new))
    fp8, bf16 = by_shape(new, "fp8_e4m3"), by_shape(new, "bf16")
    old = by_shape(json.load(open(a.old)), "fp8_e4m3") if a.old else {}
    peers = {}
    if a.peers:
        for r in json.load(open(a.peers)):
            peers.setdefault(r["peer"], {})[(r["head_dim"], r["seq"], bool(r["causal"]))] = r["tflops"]
    head = "| d | seq | causal | fp8 | bf16 | fp8/bf16 |" + (" old fp8 | new/old |" if old else "")
    head += "".join(f" {p} | fp8/{p} |" for p in peers)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    ratios, goal = [], []
    for key in sorted(fp8):
        d, n, c = key
        row = f"| {d} | {n} | {int(c)} | {fp8[key]:.0f} | {bf16.get(key, float('nan')):.0f} |"
        r = fp8[key] / bf16[key] if key in bf16 else float("nan")
        row += f" {r:.2f} |"
        if n >= 1024 and key in bf16:
            ratios.append(r)
            if d == 128 and n >= 4096:
                goal.append(r)
        if old:
            row += f" {old.get(key, float('nan')):.0f} | {fp8[key] / old[key] if key in old else float('nan'):.2f} |"
        for p, t in peers.items():
            row += f" {t.get(key, float('nan')):.0f} | {fp8[key] / t[key] if key in t else float('nan'):.2f} |"
        print(row)
    print(f"\ngeomean fp8/bf16, seq >= 1024: {geomean(ratios):.3f} ({len(ratios)} shapes); "
          f"d128 seq >= 4096: {geomean(goal):.3f} ({len(goal)} shapes)")


if __name__ == "__main__":
    main()
