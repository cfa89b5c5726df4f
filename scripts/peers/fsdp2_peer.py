#!/usr/bin/env python3
"""The CS336 leaderboard step in PyTorch FSDP2, one process per rank under torchrun, as flashlm's JSON.

  # the leaderboard step on two GPUs: cs336-8b, one sequence of 32768 tokens per rank, pure bf16, every block
  # and LM-head chunk checkpointed, AdamW
  python3 -m torch.distributed.run --nproc-per-node 2 scripts/peers/fsdp2_peer.py --out peers-fsdp2.json
  # the same with fp32 sharded masters and bf16 compute (flashlm's --precision bf16 under --ddp fsdp)
  python3 -m torch.distributed.run --nproc-per-node 2 scripts/peers/fsdp2_peer.py --precision bf16 --out -
  # a tiny check on the CPU (gloo), what CI runs at world 1 and 2
  python3 -m torch.distributed.run --nproc-per-node 2 scripts/peers/fsdp2_peer.py --device cpu --model tiny \\
      --context 64 --precision fp32 --warmup 1 --steps 2 --out -

The model is scripts/peers/cs336_lm.py's (flashlm's: RMSNorm pre-norm blocks, interleaved RoPE, SwiGLU, untied
head, no biases), built on the meta device and sharded with torch.distributed.fsdp.fully_shard per block and
once more at the root (the embedding, final norm and head), then materialised on this rank's device. Blocks
reshard after their forward (ZeRO-3, as flashlm's FSDP frees a gathered part after use; --no-reshard keeps
them, ZeRO-2). Precisions: bf16-pure (parameters, gradients and AdamW state in bf16, gathered and reduced in
bf16: the leaderboard's model.to(bfloat16), flashlm's --precision bf16-pure); bf16 (fp32 sharded masters
and AdamW state, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): flashlm's --precision bf16
with FSDP); fp32. Attention is SDPA's cuDNN backend on a GPU, as in the one-GPU leaderboard peer
(--sdpa flash or default for the others). Started without torchrun it runs as a world of one.

Timing as the other peers: CUDA events around each step on a GPU (scripts/peers/common.time_ms), rank 0's
steps after --warmup; the record (rank 0 writes it) carries bench's fields with impl = torch-fsdp2, batch =
the global batch (--batch sequences on each of world_size ranks), the peak memory of every rank
(torch.cuda.max_memory_allocated) and MFU per GPU by SPEC's and the useful count. Exits 77 (CTest's skip
code), printing why, when this torch has no fully_shard.
"""
import argparse
import contextlib
import datetime
import os
import socket
import sys

import torch
import torch.distributed as dist

from common import is_oom, moments, pick_device, time_ms, write_report
from cs336_lm import LM, PEAK_FLOPS, RMSNorm, SIZES

SKIP = 77


def import_fsdp2():
    """(fully_shard, MixedPrecisionPolicy): public from torch 2.6, under _composable from 2.4; else why not.

    Any exception counts as "not there": Debian's torch 1.13 fails to import its own torch.distributed.fsdp
    under Python 3.11 with a ValueError from dataclasses."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        return fully_shard, MixedPrecisionPolicy
    except Exception as e:
        first = e
    try:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
        return fully_shard, MixedPrecisionPolicy
    except Exception:
        return f"{type(first).__name__}: {first}"


def start_world(device_name, timeout_s):
    """This rank's (rank, world, device) from torchrun's environment, a world of one without it."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_name == "cuda":
        if local >= torch.cuda.device_count():
            sys.exit(f"error: local rank {local}: only {torch.cuda.device_count()} GPUs are visible")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return rank, world, device


def build(a, device, fsdp2):
    """The model sharded over the world and materialised on `device`, and the flops per token of a step."""
    fully_shard, MixedPrecisionPolicy = fsdp2
    with torch.device("meta"):
        model = LM(a.model, a.context, a.layers, checkpoint_blocks=a.checkpoint, loss_chunk=a.loss_chunk)
    flops = model.train_flops_per_token(), model.train_flops_per_token(useful=True)
    if a.precision == "bf16-pure":
        model.to(torch.bfloat16)  # the RoPE tables too, as the leaderboard's model.to(bfloat16) leaves them
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if a.precision == "bf16" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=not a.no_reshard)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            for p in module.parameters(recurse=False):
                local = p.to_local() if hasattr(p, "to_local") else p  # this rank's shard
                if isinstance(module, RMSNorm):
                    local.fill_(1.0)
                else:
                    local.normal_(0.0, 0.02)
    model.reset_rope()
    return model, flops


def measure(a, rank, world, device, fsdp2):
    # variant: ddp-bench's field, so that compare.py's ddp kind finds this row too (--peer torch-fsdp2)
    rec = dict(impl="torch-fsdp2", variant="torch-fsdp2", model=a.model, context=a.context, batch=world * a.batch,
               batch_per_rank=a.batch, world_size=world, precision=a.precision,
               recompute="blocks" if a.checkpoint else "none",
               reshard_after_forward=not a.no_reshard, device=device.type, status="ok")
    rec["pass"] = "step"
    try:
        torch.manual_seed(0)
        model, (flops, useful) = build(a, device, fsdp2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
        g = torch.Generator(device="cpu").manual_seed(rank)  # each rank its own sequences
        tokens = torch.randint(0, model.vocab, (a.batch, a.context), generator=g).to(device)
        targets = torch.randint(0, model.vocab, (a.batch, a.context), generator=g).to(device)
        losses = []
        rec["sdpa"] = sdpa = a.sdpa or ("cudnn" if device.type == "cuda" else "default")
        from torch.nn.attention import SDPBackend, sdpa_kernel  # (torch >= 2.3, as fully_shard is)
        backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}.get(sdpa)

        def step():
            # the recomputed forward runs inside backward(), so the backend choice covers both
            with sdpa_kernel([backend]) if backend else contextlib.nullcontext():
                loss = model(tokens, targets)  # through the root module, so FSDP's hooks see the whole step
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        ms = time_ms(step, device, a.warmup, a.steps)
        rec.update(moments(ms), steps_ms=ms)
        rec["loss"] = float(losses[-1])
    except RuntimeError as e:
        rec["status"] = "oom" if is_oom(e) else "error"
        rec["message"] = str(e).splitlines()[0][:200]
        print(f"rank {rank}: {rec['status']}: {rec['message']}", file=sys.stderr, flush=True)
        return rec  # the other ranks may wait in a collective: torchrun's and the group's timeouts end them
    seconds = rec["median_ms"] / 1e3
    rec["tokens_per_s"] = world * a.batch * a.context / seconds
    if device.type == "cuda":
        peaks = [None] * world
        dist.all_gather_object(peaks, torch.cuda.max_memory_allocated(device) / 2**20)
        rec["peak_mib_per_rank"] = peaks
        rec["peak_mib"] = max(peaks)
        per_gpu = a.batch * a.context / seconds / PEAK_FLOPS  # every rank runs its own sequences
        rec["mfu"], rec["mfu_useful"] = flops * per_gpu, useful * per_gpu
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cs336-8b", choices=sorted(SIZES))
    ap.add_argument("--layers", type=int, default=0, help="override the size's layer count")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1, help="sequences per rank")
    ap.add_argument("--precision", default="bf16-pure", choices=["bf16-pure", "bf16", "fp32"])
    ap.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                    help="keep every activation (default: every block and LM-head chunk under checkpoint)")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="tokens per checkpointed LM-head + loss chunk")
    ap.add_argument("--sdpa", choices=["default", "cudnn", "flash"],
                    help="attention backend (default: cudnn on a GPU, as the one-GPU leaderboard peer; "
                         "'default': PyTorch's own choice)")
    ap.add_argument("--no-reshard", action="store_true", help="blocks keep their gathered weights until backward")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=600, help="collective timeout of the process group")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    for name in ("layers", "context", "batch", "loss_chunk", "warmup", "steps"):
        if getattr(a, name) < (0 if name in ("layers", "warmup") else 1):
            ap.error(f"--{name.replace('_', '-')} {getattr(a, name)}: out of range")
    fsdp2 = import_fsdp2()
    if isinstance(fsdp2, str):
        print(f"skipped: torch {torch.__version__} has no usable torch.distributed.fsdp.fully_shard (FSDP2, "
              f"torch >= 2.4): {fsdp2[:200]}")
        sys.exit(SKIP)
    pick_device(a.device)
    rank, world, device = start_world(a.device, a.timeout_s)
    rec = measure(a, rank, world, device, fsdp2)
    if rank == 0:
        print(f"torch-fsdp2 world {world} {a.model} {a.precision}: {rec.get('median_ms', rec['status'])} ms",
              file=sys.stderr, flush=True)
        write_report(a.out, "peers/fsdp2_peer", device, [rec], warmup=a.warmup, steps=a.steps)
    dist.destroy_process_group()
    if rec["status"] != "ok":
        sys.exit(1)


if __name__ == "__main__":
    main()
