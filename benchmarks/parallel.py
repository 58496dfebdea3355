"""cube's data and tensor parallel plans side by side with torch's own, in one run.

    python benchmarks/parallel.py [--quick] [--nproc 2] [--steps 10] [--rounds 3]
    python -m benchmarks.parallel [...]      (the same; ``main(quick)`` returns the rows)

Launches one torchrun job (gloo on CPU unless CUDA is there) in which every
rank trains the same GPT (4 layers, d256, T64, global batch 16, AdamW) four
ways, interleaved round by round so machine noise hits all alike:

- DDP                         vs cube ``PASData``
- DTensor ``parallelize_module`` (Colwise q/k/v/fc, Rowwise proj)
                              vs cube ``PASMegatronTP``

and prints the median step time of each and the ratio cube / torch (lower is
better for cube). A step is forward, backward, gradient sync and the optimizer.
``--quick`` times 1 round of 3 steps.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import adamw_step, run_rows  # noqa: E402

DEFAULTS = {"nproc": 2, "layers": 4, "dim": 256, "heads": 8, "seq": 64, "batch": 16, "vocab": 2048,
            "steps": 10, "warmup": 2, "rounds": 3, "threads": 1}
QUICK = {"steps": 3, "warmup": 1, "rounds": 1}


def _gpt(args):
    import torch
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim, bias=False)
    return GPT(cfg)


def _batches(args, n):
    import torch
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


class _Runner:
    """One way of training; ``step()`` runs one full step on the next batch."""

    def __init__(self, step):
        self.step, self.times = step, []

    def timed(self, n):
        import torch.distributed as dist
        for _ in range(n):
            dist.barrier()
            t0 = time.perf_counter()
            self.step()
            self.times.append(time.perf_counter() - t0)


def _torch_ddp(args, model, batches, rank, world):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    it = iter(batches)
    per = args.batch // world

    def step():
        ids, tgt = next(it)
        loss = ddp(ids[rank * per:(rank + 1) * per], tgt[rank * per:(rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _torch_tp(args, model, batches, world):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    plan = {"attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(batches)

    def step():
        ids, tgt = next(it)
        loss = model(ids, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step




def worker(args):
    import torch
    import torch.distributed as dist
    import cube
    env = cube.init()
    rank, world = env.rank, env.world_size
    torch.set_num_threads(max(1, args.threads))
    total = args.rounds * (args.steps + args.warmup) + 1
    cache = os.path.join(args.cache, "cube")
    base = _gpt(args)
    runners = [
        ("DDP", _Runner(_torch_ddp(args, copy.deepcopy(base), _batches(args, total), rank, world))),
        ("cube PASData", _Runner(adamw_step(copy.deepcopy(base), _batches(args, total + 1),
                                            "cube.policies.data:PASData", cache)[0])),
        ("DTensor TP", _Runner(_torch_tp(args, copy.deepcopy(base), _batches(args, total), world))),
        ("cube PASMegatronTP", _Runner(adamw_step(copy.deepcopy(base), _batches(args, total + 1),
                                                  "cube.policies.megatron:PASMegatronTP", cache)[0])),
    ]
    for _ in range(args.rounds):
        for _, r in runners:
            for _ in range(args.warmup):
                r.step()
            r.timed(args.steps)
    med = {name: statistics.median(r.times) for name, r in runners}
    if rank == 0:
        print(f"GPT {args.layers} layers, d{args.dim}, T{args.seq}, global batch {args.batch}, "
              f"{world} ranks ({dist.get_backend()}), median of {args.rounds * args.steps} steps")
        print(f"{'plan':<22}{'ms/step':>10}")
        for name in med:
            print(f"{name:<22}{med[name] * 1e3:>10.1f}")
        print(f"ratio cube PASData / DDP:               {med['cube PASData'] / med['DDP']:.3f}  (target <= 1.00)")
        print(f"ratio cube PASMegatronTP / DTensor TP:  {med['cube PASMegatronTP'] / med['DTensor TP']:.3f}  "
              f"(target <= 0.85)")
        if args.out:
            rows = [{"benchmark": "parallel", "name": name, "ms_per_step": med[name] * 1e3} for name in med]
            for cube_name, torch_name, target in (("cube PASData", "DDP", "<= 1.00"),
                                                  ("cube PASMegatronTP", "DTensor TP", "<= 0.85")):
                rows.append({"benchmark": "parallel", "name": f"{cube_name} / {torch_name}",
                             "time_ratio": med[cube_name] / med[torch_name], "target": target})
            with open(args.out, "w") as f:
                json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def run(quick: bool = False, **settings) -> List[dict]:
    """Launches the torchrun job (``settings``: any of ``DEFAULTS``); returns rank 0's rows.

    Raises:
        RuntimeError: the job failed (its output above says why).
    """
    unknown = sorted(set(settings) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"benchmarks.parallel: unknown settings {unknown}; use any of {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **(QUICK if quick else {}), **settings}
    return run_rows(Path(__file__), cfg)


def main(quick: bool = False, **settings) -> List[dict]:
    """Runs the comparison (``quick``: 1 round of 3 steps); rank 0 prints the table; returns its rows:
    median ms per step of each way, and ``time_ratio`` rows cube / torch with their targets."""
    return run(quick, **settings)


def _cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 3 steps")
    p.add_argument("--nproc", type=int, default=DEFAULTS["nproc"])
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--dim", type=int, default=DEFAULTS["dim"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--seq", type=int, default=DEFAULTS["seq"])
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], help="global batch size")
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"])
    p.add_argument("--steps", type=int, help=f"timed steps per round (default {DEFAULTS['steps']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps before each round (default {DEFAULTS['warmup']})")
    p.add_argument("--rounds", type=int, help=f"(default {DEFAULTS['rounds']})")
    p.add_argument("--threads", type=int, default=DEFAULTS["threads"], help="intra-op threads per rank")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    settings = {k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None}
    try:
        main(args.quick, **settings)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
