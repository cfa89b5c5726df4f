#!/usr/bin/env python3
"""PyTorch DistributedDataParallel on the CS336 LM, timed as `flashlm ddp-bench` times ours, as its JSON.

  python3 scripts/peers/ddp_peers.py --model xl --worlds 1,2 --bucket-mb 25 --out peers-ddp.json
  python3 scripts/peers/compare.py ddp ours-ddp.json peers-ddp.json --peer torch-ddp

One process per rank (torch.multiprocessing, NCCL on GPUs, gloo on the CPU), each with --batch sequences of
--context tokens; a bf16-autocast train step (fp32 on the CPU) with DDP's bucketed, overlapped all-reduce
(--bucket-mb) and AdamW. Records carry ddp-bench's fields: variant (torch-ddp), bucket_mb, world_size,
mean/median ms of rank 0's steps, tokens/s over all ranks, scaling_efficiency = the world-1 step over this one.
"""
import argparse
import contextlib
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common import moments, pick_device, time_ms, write_report
from cs336_lm import LM, SIZES


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, port, a, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = LM(a.model, a.context, a.layers).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb,
                                                    device_ids=[rank] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, **({"fused": True} if cuda else {}))
    g = torch.Generator(device="cpu").manual_seed(rank)
    tokens = torch.randint(0, model.vocab, (a.batch, a.context), generator=g).to(device)
    targets = torch.randint(0, model.vocab, (a.batch, a.context), generator=g).to(device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def step():
        with autocast:
            loss = ddp(tokens, targets)  # LM.forward is its loss, so DDP's hooks see the whole step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    ms = time_ms(step, device, a.warmup, a.steps)
    if rank == 0:
        queue.put(ms)
    dist.destroy_process_group()


def run(world, a):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, a, queue)) for r in range(world)]
    for p in procs:
        p.start()
    ms = queue.get()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"error: a rank of world {world} exited with {p.exitcode}")
    return ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="xl", choices=sorted(SIZES))
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--worlds", default="", help="comma list (default: 1 and every visible GPU)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    device = pick_device(a.device)
    worlds = [int(w) for w in a.worlds.split(",")] if a.worlds else sorted({1, max(1, torch.cuda.device_count())})
    if a.device == "cuda" and max(worlds) > torch.cuda.device_count():
        raise SystemExit(f"error: --worlds {a.worlds}: {torch.cuda.device_count()} GPUs are visible")
    records, single = [], None
    for world in worlds:
        rec = dict(variant="torch-ddp", bucket_mb=a.bucket_mb, world_size=world, model=a.model, context=a.context,
                   batch=a.batch, status="ok", **moments(run(world, a)))
        rec["tokens_per_s"] = world * a.batch * a.context / (rec["mean_ms"] / 1e3)
        if world == 1:
            single = rec["median_ms"]
        rec["scaling_efficiency"] = single / rec["median_ms"] if single else None
        records.append(rec)
        print(f"torch-ddp world {world}: {rec['median_ms']:.2f} ms", flush=True)
    write_report(a.out, "peers/ddp_peers", device, records, warmup=a.warmup, steps=a.steps)


if __name__ == "__main__":
    main()
