"""What dropout's random numbers cost a cube step: off, default (keyed draws), ``exact_rng=True``.

    python -m benchmarks.dropout [--quick] [--nproc 2] [--policy cube.policies.megatron:PASMegatronTP]

One torchrun job (gloo on CPU) in which every rank trains the example GPT (4 layers, d256,
T64, global batch 16, AdamW, dropout 0.1 on the residual stream and the attention weights)
three ways, round by round so machine noise hits them alike:

- dropout off (the same model with p = 0: no random op at all);
- default: each random piece seeded from (seed, step, op, micro-batch, box) (``docs/random.md``);
- exact: every rank draws every whole mask of the step as the single device does, then slices.

It prints the median step time of each and the ratios default / off and exact / default. Exact
mode is a checking mode (a plan compared number for number with the plain model); its cost is
drawing every mask at the global batch's size on every rank, and the attention's math kernel.
"""
from __future__ import annotations

import copy
import json
import os
import statistics
import sys
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt, run_rows, worker_cli  # noqa: E402
from benchmarks.parallel import _batches, _Runner  # noqa: E402

DEFAULTS = {"nproc": 2, "layers": 4, "dim": 256, "heads": 8, "seq": 64, "batch": 16, "vocab": 2048,
            "steps": 10, "warmup": 2, "rounds": 3, "threads": 1, "dropout": 0.1,
            "policy": "cube.policies.data:PASData"}
QUICK = {"steps": 3, "warmup": 1, "rounds": 1}


def _gpt(args, dropout: float):
    import torch
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim, bias=False, dropout=dropout)
    return GPT(cfg)


def _way(args, model, batches, cache, **options):
    import torch
    it = iter(batches)
    train_iter, gen = compile_gpt(model, it, args.policy, cache, **options)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)

    def step():
        train_iter(gen, it)
        opt.step()
        opt.zero_grad()
    return step


def worker(args):
    import torch
    import torch.distributed as dist
    import cube
    env = cube.init()
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(0)   # every rank alike (exact mode starts from the default generator's state)
    total = args.rounds * (args.steps + args.warmup) + 1
    on = _gpt(args, args.dropout)
    ways = [("dropout off", _gpt(args, 0.0), {}), ("default", on, {}), ("exact_rng", on, {"exact_rng": True})]
    runners = [(name, _Runner(_way(args, copy.deepcopy(m), _batches(args, total), os.path.join(args.cache, name),
                                   **opts))) for name, m, opts in ways]
    for _ in range(args.rounds):
        for _, r in runners:
            for _ in range(args.warmup):
                r.step()
            r.timed(args.steps)
    med = {name: statistics.median(r.times) for name, r in runners}
    if env.rank == 0:
        print(f"GPT {args.layers} layers, d{args.dim}, T{args.seq}, global batch {args.batch}, dropout "
              f"{args.dropout}, {args.policy} on {env.world_size} ranks ({dist.get_backend()}), median of "
              f"{args.rounds * args.steps} steps")
        print(f"{'dropout':<14}{'ms/step':>10}")
        for name, _ in runners:
            print(f"{name:<14}{med[name] * 1e3:>10.1f}")
        print(f"ratio default / off: {med['default'] / med['dropout off']:.3f}")
        print(f"ratio exact_rng / default: {med['exact_rng'] / med['default']:.3f}")
        if args.out:
            rows = [{"benchmark": "dropout", "name": name, "ms_per_step": med[name] * 1e3} for name, _ in runners]
            rows.append({"benchmark": "dropout", "name": "default / dropout off step time",
                         "cost_ratio": med["default"] / med["dropout off"]})
            rows.append({"benchmark": "dropout", "name": "exact_rng / default step time",
                         "cost_ratio": med["exact_rng"] / med["default"]})
            with open(args.out, "w") as f:
                json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main(quick: bool = False, **settings) -> List[dict]:
    """Runs the comparison (``quick``: 1 round of 3 steps) in a torchrun job; returns rank 0's rows."""
    cfg = {**DEFAULTS, **(QUICK if quick else {}), **settings}
    return run_rows(Path(__file__), cfg)


def _cli(argv=None) -> int:
    return worker_cli(__doc__, DEFAULTS, "1 round of 3 steps", worker, main, argv)


if __name__ == "__main__":
    sys.exit(_cli())
