"""Rank 1's dataloader yields a batch of another shape on the second step; rank 0's is fine.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... python tests/workers/failfast_worker.py CACHE

Rank 1 raises cube's shape error; rank 0 enters the step's collectives, where it
would wait forever for rank 1 without cube's fail-fast.
"""
import os
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step  # noqa: E402


def main():
    model, sample = build("mlp")
    rank = int(os.environ["RANK"])
    bad = (sample[0][:-1],) if rank == 1 else sample   # one row short on rank 1
    loader = iter([sample, bad, sample])
    step = compile_step(model, loader, "cube.policies.data:PASData", sys.argv[1])
    gen = cube.load_model()
    step(gen, loader)
    print(f"rank {rank}: first step done", flush=True)
    step(gen, loader)
    print(f"rank {rank}: second step done", flush=True)


if __name__ == "__main__":
    main()
