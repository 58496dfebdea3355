"""Runs on every rank: trains a model through cube and eagerly, writes the errors.

    torchrun --nproc_per_node=N tests/workers/parity_worker.py MODEL POLICY STEPS OUTDIR

Each rank compares the loss it returns with the plain model's loss on the same
full batch, and its pieces of every parameter with the matching slices of the
plain model's parameters after each step; it writes the largest relative errors
to OUTDIR/rank{r}.json.
"""
import contextlib
import copy
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from cube.runtime import piece  # noqa: E402
from tests.inprocess import ADAMW  # noqa: E402
from tests.models import build  # noqa: E402
from tests.parity import compile_step, global_batches, rel  # noqa: E402


def main():
    name, policy, steps, outdir = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    nmicros = int(sys.argv[5]) if len(sys.argv) > 5 else 1   # micro-batches of a pipeline step
    model, sample = build(name)
    ref = copy.deepcopy(model)
    batches = global_batches(sample, steps, nmicros)   # one global batch per step, nmicros x the sample's
    loader = iter(batches)

    # CUBE_PARITY_ZERO=1|2|3: a ZeRO optimizer; CUBE_PARITY_CLIP=x: clip the gradient norm to x
    zero = int(os.environ.get("CUBE_PARITY_ZERO", "0"))
    clip = float(os.environ.get("CUBE_PARITY_CLIP", "0"))
    # CUBE_PARITY_PRECISION=bf16|fp16: mixed precision, against the plain model under the same autocast
    precision = os.environ.get("CUBE_PARITY_PRECISION") or None
    # CUBE_PARITY_BACKEND=inductor|aot_eager|...: the generated compute under torch.compile
    train_iter = compile_step(model, loader, policy, os.path.join(outdir, "cache"), zero=zero, precision=precision,
                              backend=os.environ.get("CUBE_PARITY_BACKEND") or None)
    cmodel = cube.load_model()
    env = cube.init()
    ref.to(env.device)   # the plain model runs where cube runs (CPU, or the rank's GPU)
    autocast = (lambda: torch.autocast(env.device.type, dtype=cube.runtime.amp.DTYPES[precision])) \
        if precision else contextlib.nullcontext
    # CUBE_PARITY_OPT=sgd: plain SGD, to tell AdamW's sensitivity near zero gradients from real errors
    cls, kw = (torch.optim.SGD, {"lr": 1e-2}) if os.environ.get("CUBE_PARITY_OPT") == "sgd" \
        else (torch.optim.AdamW, {"lr": 1e-3, **ADAMW})   # eps: see tests.inprocess.ADAMW
    opt = cube.build_optimizer(cmodel, cls, zero=zero, **kw)
    ref_opt = cls(ref.parameters(), **kw)
    ref_params = dict(ref.named_parameters())
    loss_err, param_err, norm_err, losses = 0.0, 0.0, 0.0, []
    for i in range(steps):
        loss = train_iter(cmodel, loader)
        # the plain model on the same global batch
        with autocast():
            ref_loss = ref(*(t.to(env.device) for t in batches[i]))
        ref_loss.backward()
        if clip:
            norm = cube.clip_grad_norm_(cmodel, clip, optimizer=opt)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm_err = max(norm_err, rel(norm, ref_norm))
        opt.step()
        held = cube.runtime.memory.report(cmodel, opt)   # gradients are still there before zero_grad
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_err = max(loss_err, rel(loss, ref_loss))
        losses.append(float(loss))
        with (opt.gathered() if zero == 3 else contextlib.nullcontext()):   # ZeRO-3 holds shards at rest
            for local, p in cmodel.named_parameters():
                names, splits = cmodel.PARAMS[local]
                err = rel(p, piece(ref_params[names[0]], splits))
                if err > 1e-5 and os.environ.get("CUBE_DEBUG_PARITY"):
                    print(f"rank {env.rank} step {i}: {names[0]} {splits} rel {err:.2e}", file=sys.stderr)
                param_err = max(param_err, err)
    backend = str(torch.distributed.get_backend()) if torch.distributed.is_initialized() else ""
    result = {"rank": env.rank, "world": env.world_size, "device": str(next(cmodel.parameters()).device),
              "backend": backend, "loss_err": loss_err, "param_err": param_err,
              "norm_err": norm_err, "clipped": bool(clip), "losses": losses,
              "param_sums": {local: float(p.detach().double().sum()) for local, p in cmodel.named_parameters()},
              "held_bytes": held, "rest_param_bytes": cube.runtime.memory.report(cmodel, opt)["params"],
              "full_bytes": cube.runtime.memory.report(ref, ref_opt),
              "nparams": len(list(cmodel.parameters())), "steps": steps,
              "names": sorted(cmodel.PARAMS[k][0][0] for k, _ in cmodel.named_parameters()),
              "all_names": sorted(ref_params),
              "held_numel": sum(p.numel() for p in cmodel.parameters()),
              "full_numel": sum(p.numel() for p in ref.parameters())}
    with open(os.path.join(outdir, f"rank{env.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
