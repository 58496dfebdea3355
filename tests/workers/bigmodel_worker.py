"""A meta-device model trained through cube against the single-device procedure.

    torchrun --nproc_per_node=4 tests/workers/bigmodel_worker.py POLICY SOURCE OUTDIR

POLICY: ``megatron`` (tp2 x pp2, 1F1B over 2 micro-batches) or ``hybrid``
(dp2 x tp2). SOURCE: ``init`` (``load_model(init=_init_weights)``), or a path of
weights (``load_model(weights=path, init=_init_weights)``). Each rank checks its
pieces right after loading (exactly) and after each AdamW step, and writes
OUTDIR/rank{r}.json. ``tests/test_bigmodel.py`` runs ``rank_run`` in the
in-process world as well.
"""
import functools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import cube  # noqa: E402
from cube.runtime import piece  # noqa: E402
from tests.models import hf_llama  # noqa: E402
from tests.parity import rel  # noqa: E402

SEED = 7
STEPS = 3
LR = 1e-3


def policy(name: str):
    """(policy, micro-batches per step) for a policy name."""
    if name == "megatron":
        from cube.policies.megatron3d import PASMegatron
        return functools.partial(PASMegatron, tp=2, pp=2, nmicros=2), 2
    if name == "hybrid":
        from cube.policies.hybrid import PASHybrid
        return functools.partial(PASHybrid, tp=2), 1
    raise ValueError(f"unknown policy {name!r}: megatron or hybrid")


def meta_model():
    with torch.device("meta"):
        return hf_llama()


def batches(n: int, nmicros: int = 1) -> list:
    """``n`` global batches of ``4 x nmicros`` sequences (a pipeline step cuts one into ``nmicros``)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.cat([torch.randint(0, 128, (4, 16), generator=gen) for _ in range(nmicros)])
        out.append((ids, ids.clone()))
    return out


def reference(nmicros: int, seed: int = SEED, steps: int = STEPS) -> dict:
    """The single-device procedure: to_empty, apply(_init_weights) from ``seed``, ``steps`` AdamW steps."""
    return single_device(meta_model(), batches(steps, nmicros), lambda p: torch.optim.AdamW(p, lr=LR), seed)


def single_device(model, data: list, make_opt, seed: int) -> dict:
    """A meta model trained on one device: ``to_empty``, ``apply(model.model._init_weights)`` from
    ``seed``, one step of ``make_opt(parameters)`` per batch of ``data``; its initial tensors, state
    dict, losses, first step's gradients and final parameters."""
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.apply(model.model._init_weights)
    initial = {k: v.detach().clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_opt(model.parameters())
    losses, grads = [], {}
    for i, batch in enumerate(data):
        loss = model(*batch)   # the global batch whole
        loss.backward()
        if i == 0:
            grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"state": state, "initial": initial, "losses": losses, "grads": grads,
            "final": {k: v.detach().clone() for k, v in model.named_parameters()}}


def rank_run(policy_name: str, source: str, ref: dict, cache_dir: str) -> dict:
    """One rank: compile the meta model, load it from ``source``, train; the errors against ``ref``.

    A directory of weights is the Hugging Face layout of the wrapped model (names without
    the wrapper's ``model.``); a file is the wrapper's ``state_dict()``.
    """
    pas, nmicros = policy(policy_name)
    model = meta_model()
    loader = iter(batches(STEPS, nmicros))

    @cube.compile(model, loader, PAS=pas, cache_dir=cache_dir)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss

    torch.manual_seed(SEED)   # the state the single-device init started from
    weights = None if source == "init" else source
    rename = (lambda k: "model." + k) if weights and os.path.isdir(weights) else None
    cmodel = cube.load_model(init=model.model._init_weights, weights=weights, rename=rename)
    tables = {**cmodel.PARAMS, **cmodel.BUFFERS}
    unequal = [tables[local][0][0] for local, t in list(cmodel.named_parameters()) + list(cmodel.named_buffers())
               if not torch.equal(t, piece(ref["initial"][tables[local][0][0]], tables[local][1]))]
    still_meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if not t.is_meta]
    opt = torch.optim.AdamW(cmodel.parameters(), lr=LR)
    losses, param_err, grad_err = [], 0.0, 0.0
    for i in range(STEPS):
        losses.append(train_iter(cmodel, loader).item())
        if i == 0:   # the first step's gradients, before AdamW scales them entry by entry
            for local, p in cmodel.named_parameters():
                names, splits = cmodel.PARAMS[local]
                grad_err = max(grad_err, rel(p.grad, piece(ref["grads"][names[0]], splits)))
        opt.step()
        opt.zero_grad()
    for local, p in cmodel.named_parameters():
        names, splits = cmodel.PARAMS[local]
        param_err = max(param_err, rel(p, piece(ref["final"][names[0]], splits)))
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    env = cube.init()
    part = cube.runtime.data.part()
    return {"rank": env.rank, "world": env.world_size, "unequal_after_load": unequal, "materialized": still_meta,
            "part": [part.reads, part.dp_rank, part.dp_size, part.nmicros],
            "held": len(tables), "loss_err": loss_err, "param_err": param_err, "grad_err": grad_err,
            "losses": losses}


def main():
    policy_name, source, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else SEED   # the seed the weights file was made with
    ref = reference(policy(policy_name)[1], seed)
    out = rank_run(policy_name, source, ref, os.path.join(outdir, "cache"))
    with open(os.path.join(outdir, f"rank{out['rank']}.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
