"""Runs on every rank: trains through cube with CUDA's sync debug mode set to "error".

    torchrun --nproc_per_node=1 tests/workers/sync_worker.py POLICY OUTDIR [ZERO] [PRECISION]

After two warm-up steps, three steps (compiled step, clipping, optimizer step,
zero_grad) run with ``torch.cuda.set_sync_debug_mode("error")``: any operation
that makes the host wait for the GPU (``.item()``, ``.tolist()``, ``nonzero``, a
blocking copy to the host, a stream synchronisation) raises. Writes
OUTDIR/rank{r}.json with the error, if any.
"""
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step  # noqa: E402


def main():
    policy, outdir = sys.argv[1], sys.argv[2]
    zero = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    precision = (sys.argv[4] if len(sys.argv) > 4 else "") or None
    model, sample = build("gpt_nobias")
    gen = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(0, 128, t.shape, generator=gen) for t in sample) for _ in range(6)]
    # pinned host memory: a copy from pageable memory makes the host wait by its nature
    batches = [tuple(t.pin_memory() for t in b) for b in batches]
    loader = iter(batches)
    train_iter = compile_step(model, loader, policy, os.path.join(outdir, "cache"), zero=zero, precision=precision)
    cmodel = cube.load_model()
    env = cube.init()
    opt = cube.build_optimizer(cmodel, torch.optim.AdamW, zero=zero, lr=1e-3, foreach=True)
    error, losses = "", []

    def step():
        loss = train_iter(cmodel, loader)
        cube.clip_grad_norm_(cmodel, 1.0, optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for _ in range(2):
        losses.append(step())
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(3):
            losses.append(step())
    except RuntimeError as e:
        import traceback
        error = "".join(traceback.format_exception(e))[-3000:]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    with open(os.path.join(outdir, f"rank{env.rank}.json"), "w") as f:
        json.dump({"rank": env.rank, "error": error, "losses": [float(x) for x in losses],
                   "device": str(next(cmodel.parameters()).device)}, f)


if __name__ == "__main__":
    main()
