"""Runs on every rank: trains through cube, loading and saving checkpoints on the way.

    torchrun --nproc_per_node=N tests/workers/checkpoint_worker.py MODEL POLICY OUTDIR
        [--load DIR] [--save DIR] [--save-after K] [--steps S] [--offset B] [--nmicros M] [--zero Z]

Takes batches ``B, B+1, ...`` of the fixed stream ``batch_stream`` (``M`` per
step). With ``--load``, it overwrites the user model with constants (only the
checkpoint can restore it) and loads the checkpoint into the compiled module
and its AdamW (``cube.build_optimizer(..., zero=Z)``, plain for Z=0). Then it
runs ``S`` steps, saving to ``--save`` after ``K`` of them, and writes the loss
of every step and the loaded ``extra`` to OUTDIR/rank{r}.json.
"""
import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step  # noqa: E402

LR = 1e-3


def batch_stream(sample, n):
    """``n`` batches shaped like ``sample``, the same in every process."""
    gen = torch.Generator().manual_seed(1)
    return [tuple(torch.randn(t.shape, generator=gen) if t.dtype.is_floating_point
                  else torch.randint(0, int(t.max()) + 1, t.shape, generator=gen) for t in sample)
            for _ in range(n)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("policy")
    parser.add_argument("outdir")
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--save-after", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--nmicros", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()

    model, sample = build(args.model)
    if args.load:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01)
    batches = batch_stream(sample, args.offset + args.steps * args.nmicros)[args.offset:]
    loader = iter(batches)
    train_iter = compile_step(model, loader, args.policy, os.path.join(args.outdir, "cache"))
    cmodel = cube.load_model()
    env = cube.init()
    opt = cube.build_optimizer(cmodel, torch.optim.AdamW, zero=args.zero, lr=LR)
    extra = cube.load_checkpoint(args.load, cmodel, opt) if args.load else None
    losses = []
    for i in range(args.steps + 1):
        if args.save and i == args.save_after:
            cube.save_checkpoint(args.save, cmodel, opt, extra={"batches": args.offset + i * args.nmicros})
        if i == args.steps:
            break
        losses.append(train_iter(cmodel, loader).item())
        opt.step()
        opt.zero_grad()
    result = {"rank": env.rank, "world": env.world_size, "losses": losses, "extra": extra,
              "held_numel": sum(p.numel() for p in cmodel.parameters()),
              "full_numel": sum(p.numel() for p in model.parameters())}
    with open(os.path.join(args.outdir, f"rank{env.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
