"""cube ZeRO-3 side by side with FSDP2 (``fully_shard`` per block), in one run.

    python -m benchmarks.zero [--quick] [--nproc 2] [--steps 10] [--rounds 3]

One torchrun job (gloo on CPU unless CUDA is there) in which every rank trains
the same GPT (4 layers, d256, T64, global batch 16, AdamW) two ways, round by
round so machine noise hits both alike:

- FSDP2: ``fully_shard`` on each block and on the root, batch split over ranks
- cube ``PASData`` compiled with ``zero=3`` and ``cube.build_optimizer(..., zero=3)``

It prints the median step time of each, the ratio cube / FSDP2 (target <= 0.90)
and each rank's parameter + gradient + optimizer-state bytes after a step
(target: no more than FSDP2's).
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
from benchmarks.parallel import DEFAULTS, QUICK, _batches, _gpt, _Runner  # noqa: E402


def _local(t):
    """The rank's own part of a tensor (a DTensor's local shard)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _held_bytes(model, optimizer, shards=()):
    from cube.runtime.memory import _bytes
    params = [_local(p) for p in model.parameters()] + [s.param for s in shards]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    grads += [s.param.grad for s in shards if s.param.grad is not None]
    state = [_local(v) for st in optimizer.state.values() for v in st.values() if hasattr(v, "shape")]
    return _bytes(params) + _bytes(grads) + _bytes(state)


def _fsdp2(args, model, batches, rank, world):
    import torch
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:   # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(batches)
    per = args.batch // world
    held = {}

    def step():
        ids, tgt = next(it)
        loss = model(ids[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        held["bytes"] = _held_bytes(model, opt)
        opt.zero_grad()
    return step, held


def _cube_zero3(args, model, batches, cache):
    import cube
    import torch
    it = iter(batches)
    train_iter, gen = compile_gpt(model, it, "cube.policies.data:PASData", cache, zero=3)
    opt = cube.build_optimizer(gen, torch.optim.AdamW, zero=3, lr=1e-3)
    held = {}

    def step():
        train_iter(gen, it)
        opt.step()
        held["bytes"] = _held_bytes(gen, opt.inner, opt.shards)
        opt.zero_grad()
    return step, held


def worker(args):
    import torch
    import torch.distributed as dist
    import cube
    env = cube.init()
    rank, world = env.rank, env.world_size
    torch.set_num_threads(max(1, args.threads))
    total = args.rounds * (args.steps + args.warmup) + 1
    base = _gpt(args)
    fsdp_step, fsdp_held = _fsdp2(args, copy.deepcopy(base), _batches(args, total), rank, world)
    cube_step, cube_held = _cube_zero3(args, copy.deepcopy(base), _batches(args, total + 1),
                                       os.path.join(args.cache, "cube"))
    runners = [("FSDP2", _Runner(fsdp_step)), ("cube ZeRO-3", _Runner(cube_step))]
    for _ in range(args.rounds):
        for _, r in runners:
            for _ in range(args.warmup):
                r.step()
            r.timed(args.steps)
    med = {name: statistics.median(r.times) for name, r in runners}
    held = torch.tensor([fsdp_held["bytes"], cube_held["bytes"]], dtype=torch.float64)
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    if rank == 0:
        full = sum(p.numel() * p.element_size() for p in base.parameters()) * 4   # params, grads, 2 AdamW
        print(f"GPT {args.layers} layers, d{args.dim}, T{args.seq}, global batch {args.batch}, "
              f"{world} ranks ({dist.get_backend()}), median of {args.rounds * args.steps} steps")
        print(f"{'plan':<14}{'ms/step':>10}{'held MiB/rank':>16}")
        for (name, _), b in zip(runners, held.tolist()):
            print(f"{name:<14}{med[name] * 1e3:>10.1f}{b / 2**20:>16.2f}")
        print(f"unsharded params+grads+AdamW state: {full / 2**20:.2f} MiB")
        print(f"ratio cube ZeRO-3 / FSDP2 step time: {med['cube ZeRO-3'] / med['FSDP2']:.3f}  (target <= 0.90)")
        print(f"ratio cube ZeRO-3 / FSDP2 held bytes: {held[1].item() / held[0].item():.3f}  (target <= 1.00)")
        if args.out:
            rows = [{"benchmark": "zero", "name": name, "ms_per_step": med[name] * 1e3, "held_mib": b / 2**20}
                    for (name, _), b in zip(runners, held.tolist())]
            rows.append({"benchmark": "zero", "name": "cube ZeRO-3 / FSDP2 step time",
                         "time_ratio": med["cube ZeRO-3"] / med["FSDP2"], "target": "<= 0.90"})
            rows.append({"benchmark": "zero", "name": "cube ZeRO-3 / FSDP2 params+grads+state bytes",
                         "bytes_ratio": held[1].item() / held[0].item(), "target": "<= 1.00"})
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
