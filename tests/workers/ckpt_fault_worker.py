"""One rank of a 2-rank data-parallel run that is killed (SIGKILL) at a chosen point of its second save.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=... MASTER_PORT=... \\
        python tests/workers/ckpt_fault_worker.py ROOT CACHE POINT VICTIM MODE

Trains one step, saves ``ROOT/step1`` (synchronously, or asynchronously and waited for, as MODE
says), trains another and saves ``ROOT/step2`` the same way; rank VICTIM kills itself when
``cube.runtime.checkpoint_write`` reaches POINT of that second save ("before|during|after FILE").
Before each save rank 0 writes what the checkpoint must hold to ``ROOT/ref{k}.pt``: the
parameters and AdamW state by user name, the loader's state and the step.
"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import cube  # noqa: E402
from cube.runtime import checkpoint_write  # noqa: E402
from cube.runtime.data import ShuffledBatches  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step  # noqa: E402


def reference(gen, opt, loader, step: int) -> dict:
    params, state = {}, {}
    for local, p in gen.named_parameters():
        name = gen.PARAMS[local][0][0]
        params[name] = p.detach().clone()
        state[name] = {k: v.clone() for k, v in opt.state[p].items()}
    return {"params": params, "opt": state, "loader": loader.state_dict(), "step": step}


def main():
    root, cache, point, victim, mode = sys.argv[1:6]
    rank = int(os.environ["RANK"])
    checkpoint_write.COMMIT_TIMEOUT_S = 60.0   # rank 0's writer gives up on a dead rank (the test kills it first)
    model, sample = build("mlp")
    data = tuple(torch.cat([t, t + 1, t - 1]) for t in sample)
    loader = ShuffledBatches(data, sample[0].shape[0], seed=5)
    step = compile_step(model, loader, "cube.policies.data:PASData", cache)
    gen = cube.load_model()
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-2)
    for k in (1, 2):
        step(gen, loader)
        opt.step()
        opt.zero_grad()
        if rank == 0:
            torch.save(reference(gen, opt, loader, k), os.path.join(root, f"ref{k}.pt"))
        if k == 2 and rank == int(victim):
            def kill(at):
                if at == point:
                    os.kill(os.getpid(), signal.SIGKILL)   # no cleanup, no word: as a lost machine
            checkpoint_write.FAULT = kill
        print(f"rank {rank}: saving step{k}", flush=True)
        cube.save_checkpoint(os.path.join(root, f"step{k}"), gen, opt, extra={"step": k}, dataloader=loader,
                             async_save=mode == "async")
        cube.wait_checkpoint()
        print(f"rank {rank}: saved step{k}", flush=True)


if __name__ == "__main__":
    main()
