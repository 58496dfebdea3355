"""Runs on every rank: trains through cube, loading and saving checkpoints on the way.

    torchrun --nproc_per_node=N tests/workers/checkpoint_worker.py MODEL POLICY OUTDIR
        [--load DIR] [--save DIR] [--save-after K] [--steps S] [--offset B] [--nmicros M] [--zero Z]

Takes batches ``B, B+1, ...`` of the fixed stream ``batch_stream`` (``M`` per
step). With ``--load``, it overwrites the user model with constants (only the
checkpoint can restore it) and loads the checkpoint into the compiled module
and its AdamW (``cube.build_optimizer(..., zero=Z)``, plain for Z=0; Z=3 also
compiles a ZeRO-3 plan). Then it runs ``S`` steps, saving to ``--save`` after
``K`` of them, and writes the loss of every step and the loaded ``extra`` to
OUTDIR/rank{r}.json. ``train`` is the same as a function, for
``cube.debug.run`` (every rank in one process).
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


def train(model_name, policy, cache_dir, load=None, saves=None, steps=1, offset=0, nmicros=1, zero=0):
    """This rank's run: compile (``zero=3`` compiles a ZeRO-3 plan), load ``load``, train ``steps``
    steps and save to ``saves[k]`` after ``k`` of them; returns the losses and what was held."""
    saves = saves or {}
    model, sample = build(model_name)
    if load:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01)
    parts = batch_stream(sample, offset + steps * nmicros)[offset:]
    # one global batch a step: ``nmicros`` of the stream's batches joined (a pipeline cuts it back)
    batches = [tuple(torch.cat(ts) for ts in zip(*parts[i * nmicros:(i + 1) * nmicros])) for i in range(steps)]
    loader = iter(batches)
    train_iter = compile_step(model, loader, policy, cache_dir, zero=3 if zero == 3 else 0)
    cmodel = cube.load_model(train_iter)
    env = cube.init()
    opt = cube.build_optimizer(cmodel, torch.optim.AdamW, zero=zero, lr=LR)
    extra = cube.load_checkpoint(load, cmodel, opt) if load else None
    losses = []
    for i in range(steps + 1):
        if i in saves:
            cube.save_checkpoint(saves[i], cmodel, opt, extra={"batches": offset + i * nmicros})
        if i == steps:
            break
        losses.append(train_iter(cmodel, loader).item())
        opt.step()
        opt.zero_grad()
    return {"rank": env.rank, "world": env.world_size, "losses": losses, "extra": extra,
            "held_numel": sum(p.numel() for p in cmodel.parameters()),
            "full_numel": sum(p.numel() for p in model.parameters())}


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
    result = train(args.model, args.policy, os.path.join(args.outdir, "cache"), load=args.load,
                   saves={args.save_after: args.save} if args.save else None, steps=args.steps,
                   offset=args.offset, nmicros=args.nmicros, zero=args.zero)
    with open(os.path.join(args.outdir, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
