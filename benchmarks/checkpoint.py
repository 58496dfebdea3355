"""What a checkpoint save costs training: synchronous against asynchronous (``async_save=True``).

    python -m benchmarks.checkpoint [--quick] [--nproc 2] [--layers 4] [--dim 256] [--dir DIR]

One torchrun job (gloo on CPU, NCCL on GPUs) in which every rank trains the example GPT (AdamW) and
saves a full checkpoint (parameters, optimizer state, generator states) now and then, both ways:

- without saves: the median step time (the reference);
- synchronous: the stall, how long ``save_checkpoint`` holds training (every byte written, fsynced
  and hashed, and ``meta.json`` after every rank); a step with a save takes step + stall;
- asynchronous: ``save_checkpoint(..., async_save=True)`` right after a step returns once the state
  is copied to host memory; the steps that run while the writer thread writes are timed, the first
  one holding the call. Their mean over the reference is the step time during a save.

Ratios: (step + synchronous stall) / step, and step time during an asynchronous save / step.
On a CPU the writer thread shares the cores with the ranks' compute, so a CPU ratio is an upper
bound of what a GPU run, whose compute is on the device, sees.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt, run_rows, worker_cli  # noqa: E402
from benchmarks.parallel import _batches  # noqa: E402

DEFAULTS = {"nproc": 2, "layers": 4, "dim": 256, "heads": 8, "seq": 64, "batch": 16, "vocab": 2048,
            "steps": 8, "saves": 3, "threads": 1, "policy": "cube.policies.data:PASData", "dir": ""}
QUICK = {"steps": 3, "saves": 1}


def worker(args):
    import torch
    import torch.distributed as dist
    import cube
    from cube.runtime import checkpoint_write
    from examples.gpt.model import GPT, GPTConfig
    env = cube.init()
    torch.set_num_threads(max(1, args.threads))
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.dim, bias=False, dropout=0.0)
    with torch.device(env.device):
        model = GPT(cfg)
    batches = _batches(args, 3 + args.steps + args.saves * (2 + 4 * args.steps))
    batches = [tuple(t.to(env.device) for t in b) for b in batches]
    it = iter(batches)
    train_iter, gen = compile_gpt(model, it, args.policy, os.path.join(args.cache, "gen"))
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)

    def step():
        train_iter(gen, it)
        opt.step()
        opt.zero_grad()
        sync()

    def busy() -> bool:
        """Whether some rank's writer still writes."""
        flag = torch.tensor([float(checkpoint_write.writing(env.rank))], device=env.device)   # NCCL: on the GPU
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    root = Path(args.dir or os.path.join(args.cache, "ckpt"))   # one directory for every rank
    for _ in range(3):
        step()
    cube.save_checkpoint(root / "warm", gen, opt, async_save=True)   # pinned buffers made once, as in a long run
    cube.wait_checkpoint()
    dist.barrier()
    plain = [timed(step) for _ in range(args.steps)]
    stalls, during, calls, writes, overlapped = [], [], [], [], []
    for s in range(args.saves):
        dist.barrier()
        stalls.append(timed(lambda: cube.save_checkpoint(root / f"sync{s}", gen, opt)))
        step()
        dist.barrier()
        t0 = time.perf_counter()
        first = time.perf_counter()
        step()
        calls.append(timed(lambda: cube.save_checkpoint(root / f"async{s}", gen, opt, async_save=True)))
        times = [time.perf_counter() - first]
        n = 0
        while n < 4 * args.steps and busy():   # every rank runs as many steps (their collectives match)
            times.append(timed(step))
            n += 1
        cube.wait_checkpoint()
        writes.append(time.perf_counter() - t0)
        during.extend(times)
        overlapped.append(len(times))
        dist.barrier()
    ref = statistics.median(plain)
    size = sum(p.stat().st_size for p in (root / "sync0").iterdir()) / 2**20
    rows = [{"benchmark": "checkpoint", "name": "step without saves", "ms": ref * 1e3},
            {"benchmark": "checkpoint", "name": "synchronous save: stall", "ms": statistics.median(stalls) * 1e3,
             "ratio": (ref + statistics.median(stalls)) / ref},
            {"benchmark": "checkpoint", "name": "asynchronous save: the call", "ms": statistics.median(calls) * 1e3},
            {"benchmark": "checkpoint", "name": "asynchronous save: step during the write",
             "ms": statistics.mean(during) * 1e3, "ratio": statistics.mean(during) / ref}]
    if env.rank == 0:
        print(f"GPT {args.layers} layers, d{args.dim}, T{args.seq}, global batch {args.batch}, {args.policy} on "
              f"{env.world_size} ranks ({dist.get_backend()}, {env.device.type}); checkpoint {size:.1f} MiB "
              f"({len(list((root / 'sync0').glob('rank*')))} rank files), {args.saves} saves each way")
        print(f"{'':<44}{'ms':>10}{'ratio':>8}")
        for r in rows:
            ratio = f"{r['ratio']:>8.3f}" if "ratio" in r else ""
            print(f"{r['name']:<44}{r['ms']:>10.1f}{ratio}")
        print(f"asynchronous: the write took {statistics.median(writes) * 1e3:.0f} ms, over "
              f"{statistics.median(overlapped):.0f} step(s)")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f)
    dist.barrier()
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


def main(quick: bool = False, **settings) -> List[dict]:
    """Runs the comparison (``quick``: 1 save each way) in a torchrun job; returns rank 0's rows."""
    cfg = {**DEFAULTS, **(QUICK if quick else {}), **settings}
    return run_rows(Path(__file__), cfg)


def _cli(argv=None) -> int:
    return worker_cli(__doc__, DEFAULTS, "1 save each way", worker, main, argv)


if __name__ == "__main__":
    sys.exit(_cli())
