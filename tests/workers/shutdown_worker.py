"""Runs on every rank: trains two steps, takes cube down as at exit, lists the threads left.

    torchrun --nproc_per_node=N tests/workers/shutdown_worker.py OUTDIR

A ZeRO-2 data-parallel GPT (its optimizer step all-gathers asynchronously, and the optimizer's
construction imports torch modules that hold the world group as a default argument) trains two
steps; then ``cube.runtime.device._shutdown`` (what runs at exit) and the names of this process's
threads before and after it go to OUTDIR/rank{r}.json (Linux: /proc/self/task).
"""
import glob
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from cube.runtime import device  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step, global_batches  # noqa: E402


def threads():
    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            with open(path) as f:
                names.append(f.read().strip())
        except OSError:   # a thread that ended meanwhile
            pass
    return sorted(names)


def main():
    outdir = sys.argv[1]
    model, sample = build("gpt_nobias")
    loader = iter(global_batches(sample, 2, 1))
    step = compile_step(model, loader, "cube.policies.data:PASData", os.path.join(outdir, "cache"), zero=2)
    cmodel = cube.load_model()
    env = cube.init()
    opt = cube.build_optimizer(cmodel, torch.optim.SGD, zero=2, lr=1e-2)
    for _ in range(2):
        step(cmodel, loader)
        opt.step()
        opt.zero_grad()
    before = threads()
    device._shutdown()
    with open(os.path.join(outdir, f"rank{env.rank}.json"), "w") as f:
        json.dump({"rank": env.rank, "before": before, "after": threads()}, f)


if __name__ == "__main__":
    main()
