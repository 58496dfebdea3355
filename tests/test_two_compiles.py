"""Two compiles in one process do not interfere: a compile is a value.

Two plans that share nothing (another model, policy and options) are compiled on
the same 2 in-process ranks (``cube.debug.run``) and their steps interleaved
one by one. Each step's loss, gradient norm and updated parameters equal its own
eager run: a plain MLP under data parallelism with ZeRO-1, and a small GPT under a
2-stage 1F1B pipeline (point-to-point traffic, each step's batch cut into two micro-batches).
"""
import copy
from typing import Dict, List

import torch

import cube
import cube.debug
from cube.runtime import p2p, session
from tests.models import build
from tests.parity import batches_like, global_batches, rel

STEPS = 3
RTOL = 1e-5
CLIP = 1.0


def _step(model, dataloader):
    data = next(dataloader)
    loss = model(*data)
    loss.backward()
    return loss


def _eager(model: torch.nn.Module, batches: list) -> List[dict]:
    """Per step of the plain model (AdamW, clipped at ``CLIP``, one global batch each): its loss,
    gradient norm and parameters after the update."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for i in range(STEPS):
        loss = model(*batches[i])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        out.append({"loss": loss.detach(), "norm": norm.detach(),
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return out


def _errors(gen: torch.nn.Module, loss: torch.Tensor, norm: torch.Tensor, ref: dict) -> Dict[str, float]:
    """Relative errors of one compiled step against the eager one."""
    param = 0.0
    with cube.runtime.zero.whole_parameters(gen):
        for local, p in gen.named_parameters():
            names, splits = gen.PARAMS[local]
            param = max(param, rel(p, cube.runtime.piece(ref["params"][names[0]], splits)))
    return {"loss": rel(loss, ref["loss"]), "norm": rel(norm, ref["norm"]), "param": param}


def test_two_compiles_interleaved_step_by_step_each_equal_eager(tmp_path):
    mlp, mlp_sample = build("mlp")
    gpt, gpt_sample = build("gpt_nobias")
    nmicros = 2
    mlp_batches = batches_like(mlp_sample, STEPS, seed=1)
    gpt_batches = global_batches(gpt_sample, STEPS, nmicros, seed=2)   # one global batch a step
    refs = {"mlp": _eager(mlp, mlp_batches), "gpt": _eager(gpt, gpt_batches)}

    def rank() -> Dict[str, List[Dict[str, float]]]:
        mlp_data, gpt_data = iter(mlp_batches), iter(gpt_batches)
        mlp_step = cube.compile(copy.deepcopy(mlp), mlp_data, PAS="cube.policies.data:PASData", cache_dir=tmp_path,
                                zero=1)(_step)
        mlp_model = cube.load_model()
        mlp_opt = cube.build_optimizer(mlp_model, torch.optim.AdamW, lr=1e-3)   # ZeRO-1, from the plan
        gpt_step = cube.compile(copy.deepcopy(gpt), gpt_data, PAS="cube.policies.pipeline:PAS1F1B", cache_dir=tmp_path,
                                options={"nmicros": nmicros})(_step)
        gpt_model = cube.load_model()   # the latest compile's
        if type(cube.load_model(mlp_step)) is not type(mlp_model):
            raise AssertionError("cube.load_model(step) must load that step's program")
        gpt_opt = torch.optim.AdamW(gpt_model.parameters(), lr=1e-3)
        if getattr(mlp_opt, "stage", 0) != 1 or "runtime.pipeline.run(" not in gpt_step.source \
                or "runtime.p2p." not in gpt_step.source or "runtime.p2p." in mlp_step.source:
            raise AssertionError("the two plans are not ZeRO-1 data parallel and a point-to-point pipeline")
        runs = (("mlp", mlp_step, mlp_model, mlp_opt, mlp_data), ("gpt", gpt_step, gpt_model, gpt_opt, gpt_data))
        errors: Dict[str, List[Dict[str, float]]] = {"mlp": [], "gpt": []}
        for i in range(STEPS):
            for name, step, model, opt, data in runs:   # one step of each, in turn
                loss = step(model, data)
                norm = cube.clip_grad_norm_(model, CLIP, optimizer=opt)
                opt.step()
                opt.zero_grad()
                errors[name].append(_errors(model, loss, norm, refs[name][i]))
        return errors

    results = cube.debug.run(rank, 2)
    for r, errors in enumerate(results):
        for name, per_step in errors.items():
            for i, e in enumerate(per_step):
                assert max(e.values()) <= RTOL, f"rank {r}, {name}, step {i}: relative errors {e}"


def test_runtime_states_keep_their_own_traffic():
    """What one program has in flight (stashes, markers, micro-batch offset) is invisible to another."""
    a, b = session.RuntimeState(), session.RuntimeState()
    x = torch.ones(3, requires_grad=True)
    with session.activate(a):
        p2p.set_micro(2)
        p2p.stash(x * 2, tag=5)
        with session.activate(b):   # another program runs inside (states nest)
            assert p2p.untaken() == [] and b.p2p.micro == 0
            p2p.stash(x * 3, tag=5, grad=False)
            assert torch.equal(p2p.unstash(tag=5, requires_grad=False), torch.full((3,), 3.0))
        assert session.current() is a
        assert len(p2p.take_markers()) == 1
        assert torch.equal(p2p.unstash(tag=5, requires_grad=False), torch.full((3,), 2.0))
        p2p.set_micro(0)
    assert p2p.untaken() == [] and a.p2p.stashed == {} and b.p2p.stashed == {}
    assert a.groups is b.groups is session.process_groups()   # process groups are shared by design
