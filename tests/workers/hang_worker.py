"""A 2-rank data-parallel run in which one rank stops making progress (CUBE_HANG_TIMEOUT set by the test).

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/workers/hang_worker.py CACHE HOW

HOW: ``loader``: rank 1's data loader blocks on the batch of step 2 (rank 0 waits in the gradient
all-reduce); ``collective``: at step 1 rank 1 makes an all-reduce rank 0 never makes, inside the step
(rank 0 finishes the step and waits in the next one).
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import cube  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step  # noqa: E402


class StuckLoader:
    """Yields ``sample`` forever, but blocks on batch ``stuck_at`` (0: compile's read)."""

    def __init__(self, sample, stuck_at):
        self.sample, self.stuck_at, self.n = sample, stuck_at, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.n == self.stuck_at:
            time.sleep(3600)   # a loader waiting on a file system that never answers
        self.n += 1
        return self.sample


def main():
    cache, how = sys.argv[1:3]
    rank = int(os.environ["RANK"])
    model, sample = build("mlp")
    loader = StuckLoader(sample, 2 if rank == 1 and how == "loader" else -1)
    step = compile_step(model, loader, "cube.policies.data:PASData", cache)
    gen = cube.load_model()
    for i in range(4):
        print(f"rank {rank}: step {i}", flush=True)
        if how == "collective" and rank == 1 and i == 1:
            with cube.runtime.watchdog.watched(f"step {i}"):
                dist.all_reduce(torch.ones(3))   # a collective rank 0 never makes
        step(gen, loader)
    print(f"rank {rank}: done", flush=True)


if __name__ == "__main__":
    main()
