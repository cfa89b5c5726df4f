#!/usr/bin/env python3
"""The CS336 LM in PyTorch, eager or torch.compile'd, timed as `flashlm bench` times ours, as its JSON.

  python3 scripts/peers/lm_peers.py --models small,xl --modes bf16,bf16-compile --out peers-lm.json
  python3 scripts/peers/compare.py lm ours-lm.json peers-lm.json --peer torch-eager --peer torch-compile
  # FP8 (flashlm bench --precision fp8), small and xl at context 512, batch 4:
  python3 scripts/peers/lm_peers.py --models small,xl --modes bf16-compile,fp8,fp8-compile --out peers-fp8.json
  # (ours: flashlm bench --device cuda --model small,xl --precision bf16,fp8 --format json --out ours-fp8.json)
  # torchao's float8 training (tensorwise recipe) as the FP8 peer, where torchao is installed:
  python3 scripts/peers/lm_peers.py --models small,xl --modes fp8-torchao-compile --out peers-torchao.json
  # the CS336 leaderboard step (cs336-8b, bf16 parameters and AdamW state, 2 x 32768, every block checkpointed):
  python3 scripts/peers/lm_peers.py --models cs336-8b --context 32768 --batch 2 --modes bf16-pure \\
      --checkpoint --passes step --warmup 1 --steps 2 --out peers-leaderboard.json

Modes: fp32; bf16 (autocast: fp32 parameters and AdamW state, bf16 compute: flashlm's --precision bf16);
bf16-pure (model.to(bfloat16): --precision bf16-pure); fp8 (bf16 autocast with the blocks' linear layers as
FP8 GEMMs through torch._scaled_mm, tensorwise scaled: --precision fp8; fp8_linear.py, --fp8-gradients);
fp8-torchao (bf16 autocast with the blocks' linear layers converted by torchao.float8's
convert_to_float8_training, recipe "tensorwise": e4m3 forward, e5m2 gradients, dynamic scaling); each with "-compile" for torch.compile. Passes: fwd
(forward + loss), fwd-bwd, step (+ fused AdamW on CUDA). --checkpoint puts every block and LM-head chunk
under torch.utils.checkpoint (flashlm's --recompute blocks). Records carry bench's fields (model, context,
batch, precision, pass, mean/std/median ms, tokens/s, MFU by SPEC's and the useful count, peak MiB) and
impl = torch-eager or torch-compile.
"""
import argparse
import contextlib

import torch

from common import is_oom, moments, pick_device, time_ms, write_report
from cs336_lm import LM, PEAK_FLOPS, SIZES
from fp8_linear import convert_blocks


def measure(size, mode, pass_name, a, device):
    precision = mode.removesuffix("-compile")
    compiled = mode.endswith("-compile")
    rec = dict(impl="torch-compile" if compiled else "torch-eager", model=size, context=a.context, batch=a.batch,
               precision=precision, pass_=pass_name, recompute="blocks" if a.checkpoint else "none",
               device=device.type, status="ok")
    rec["pass"] = rec.pop("pass_")
    try:
        torch.manual_seed(0)
        model = LM(size, a.context, a.layers, a.checkpoint).to(device)
        if precision == "bf16-pure":
            model.to(torch.bfloat16)
        if precision == "fp8":
            convert_blocks(model, a.fp8_gradients)
        if precision == "fp8-torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                       module_filter_fn=lambda module, fqn: fqn.startswith("blocks"))
        fused = {"fused": True} if device.type == "cuda" else {}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused)
        tokens = torch.randint(0, model.vocab, (a.batch, a.context), device=device)
        targets = torch.randint(0, model.vocab, (a.batch, a.context), device=device)
        if compiled:
            # Each measurement compiles afresh, as a process of its own would, with static shapes: otherwise
            # the next model's loss (the same code object) recompiles under the previous model's guards and
            # may count against Dynamo's recompile limit or turn shapes dynamic.
            torch._dynamo.reset()
        loss_fn = torch.compile(model.loss, dynamic=False) if compiled else model.loss
        autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision in ("bf16", "fp8", "fp8-torchao")
                    else contextlib.nullcontext())

        def run():
            with autocast:
                loss = loss_fn(tokens, targets)
            if pass_name == "fwd":
                return
            loss.backward()
            if pass_name == "step":
                opt.step()
            opt.zero_grad(set_to_none=True)

        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rec.update(moments(time_ms(run, device, a.warmup, a.steps)))
    except RuntimeError as e:
        rec["status"] = "oom" if is_oom(e) else "error"
        rec["message"] = str(e).splitlines()[0][:200]
        return rec
    seconds = rec["mean_ms"] / 1e3
    rec["tokens_per_s"] = a.batch * a.context / seconds
    if device.type == "cuda":
        rec["peak_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        if pass_name == "step":
            rec["mfu"] = model.train_flops_per_token() * a.batch * a.context / seconds / PEAK_FLOPS
            rec["mfu_useful"] = model.train_flops_per_token(useful=True) * a.batch * a.context / seconds / PEAK_FLOPS
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,medium,large,xl,2.7B")
    ap.add_argument("--modes", default="fp32,bf16,bf16-compile")
    ap.add_argument("--passes", default="fwd,fwd-bwd,step")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=0, help="override the size's layer count")
    ap.add_argument("--checkpoint", action="store_true", help="every block under torch.utils.checkpoint")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--fp8-gradients", default="e5m2", choices=["e5m2", "e4m3"],
                    help="fp8 modes: the output gradients' FP8 format")
    ap.add_argument("--out", default="-")
    a = ap.parse_args()
    device = pick_device(a.device)
    modes = {"fp32", "bf16", "bf16-pure", "fp8", "fp8-torchao"}
    records = []
    for size in a.models.split(","):
        if size not in SIZES:
            raise SystemExit(f"error: --models: unknown size '{size}' (expected {', '.join(SIZES)})")
        for mode in a.modes.split(","):
            if mode.removesuffix("-compile") not in modes:
                raise SystemExit(f"error: --modes: unknown mode '{mode}'")
            for pass_name in a.passes.split(","):
                if pass_name not in ("fwd", "fwd-bwd", "step"):
                    raise SystemExit(f"error: --passes: unknown pass '{pass_name}'")
                r = measure(size, mode, pass_name, a, device)
                records.append(r)
                print(f"{r['impl']} {size} {mode} {pass_name}: {r.get('mean_ms', r['status'])} ms", flush=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    write_report(a.out, "peers/lm_peers", device, records, warmup=a.warmup, steps=a.steps)


if __name__ == "__main__":
    main()
