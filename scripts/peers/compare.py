#!/usr/bin/env python3
"""Speed ratios of flashlm's JSON against the peers' (scripts/peers/*_peers.py), measured in one session.

  compare.py attention OURS.json PEERS.json [--ours flash] --peer sdpa-flash --peer sdpa-cudnn [--min-seq 1024]
  compare.py lm        OURS.json PEERS.json --peer torch-eager --peer torch-compile
  compare.py ddp       OURS.json PEERS.json [--ours bucketed] --peer torch-ddp
  compare.py ddp       OURS-NP1.json,OURS-NP2.json PEERS.json,FSDP2-W1.json,FSDP2-W2.json --ours fsdp --peer torch-fsdp2

A ratio is the peer's time over ours, so above 1 means flashlm is faster: attention per pass (fwd_ms,
bwd_ms) for each shape (batch, heads, kv_heads, seq, head_dim, causal, dtype); the LM per (model, context,
batch, precision, pass, world_size: 1 where a record names none) on mean_ms, where a stated AdamW moment
format of ours ("bf16, bf16-sr moments": `--optimizer-state`) is matched with the peer's plain precision
("bf16"; torch's AdamW keeps fp32 moments) and shown in the row; DDP per world size on median_ms. OURS
and PEERS may each be several reports joined by commas (one run per world size, say). Prints a markdown
table with the geometric mean of each column. Exits 1 when no row of ours has a peer to compare with, 2 on
bad arguments. Attention rows also match on the sliding window and soft-capping (window_left, window_right,
softcap: attention-bench --window/--softcap, flex_attention_peer.py).
"""
import argparse
import json
import math
import sys

KINDS = {
    # kind: (fields that identify a row, the field naming the implementation, default ours, timed fields)
    "attention": (("batch", "heads", "kv_heads", "seq_q", "seq_k", "head_dim", "causal", "window_left", "window_right",
                   "softcap", "dtype"), "impl", "flash", ("fwd_ms", "bwd_ms")),
    "lm": (("model", "context", "batch", "precision", "pass", "world_size"), "impl", None, ("mean_ms",)),
    "ddp": (("world_size",), "variant", "bucketed", ("median_ms",)),
}


# What a record that names no such field means (no window and no soft-capping: records from before them).
DEFAULTS = {"kv_heads": 1, "world_size": 1, "window_left": -1, "window_right": -1, "softcap": 0}


def load(paths, kind, impl):
    keys, impl_field, _, _ = KINDS[kind]
    records = []
    for path in paths.split(","):
        try:
            with open(path) as f:
                records += json.load(f)["records"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"error: {path}: not a report with records ({e})")
    out = {}
    for r in records:
        if r.get("status", "ok") != "ok" or (impl is not None and r.get(impl_field) != impl):
            continue
        key = tuple(key_value(kind, r, k) for k in keys)
        out.setdefault(key, r)
    return out


def key_value(kind, record, field):
    value = record.get(field, DEFAULTS.get(field))
    if kind == "lm" and field == "precision" and isinstance(value, str):
        return value.split(",")[0]  # "bf16, bf16 moments" -> "bf16": the compute precision
    return value


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("ours")
    ap.add_argument("peers")
    ap.add_argument("--ours", dest="ours_impl", help="our implementation's name (attention: flash; ddp: bucketed)")
    ap.add_argument("--peer", action="append", required=True)
    ap.add_argument("--min-seq", type=int, default=0, help="attention: only shapes with seq_q >= this")
    a = ap.parse_args()
    keys, _, default_ours, timed = KINDS[a.kind]
    mine = load(a.ours, a.kind, a.ours_impl or default_ours)
    if a.kind == "attention" and a.min_seq:
        mine = {k: r for k, r in mine.items() if r["seq_q"] >= a.min_seq}
    if not mine:
        print(f"error: no ok records of ours in {a.ours}", file=sys.stderr)
        sys.exit(1)
    theirs = {p: load(a.peers, a.kind, p) for p in a.peer}
    columns = [(p, t) for p in a.peer for t in timed]
    print("| " + " | ".join(keys) + " | " + " | ".join(f"ours {t}" for t in timed) + " | " +
          " | ".join(f"{p} {t} ratio" for p, t in columns) + " |")
    print("|" + "---|" * (len(keys) + len(timed) + len(columns)))
    ratios = {c: [] for c in columns}
    for key, r in sorted(mine.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        cells = []
        for p, t in columns:
            peer = theirs[p].get(key)
            if peer and peer.get(t) and r.get(t):
                ratios[(p, t)].append(peer[t] / r[t])
                cells.append(f"{peer[t] / r[t]:.2f}")
            else:
                cells.append("—")
        ours_cells = [f"{r[t]:.3f}" if r.get(t) is not None else "—" for t in timed]
        shown = [r.get(k, x) if k == "precision" else x for k, x in zip(keys, key)]  # ours' full precision
        print("| " + " | ".join(str(x) for x in shown) + " | " + " | ".join(ours_cells) + " | " + " | ".join(cells) + " |")
    means = [geomean(ratios[c]) for c in columns]
    print("| geomean" + " |" * (len(keys) + len(timed) - 1) + " | " +
          " | ".join(f"{m:.2f}" if m else "—" for m in means) + " |")
    if not any(ratios.values()):
        print(f"error: no row of ours in {a.ours} has a peer row in {a.peers}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
