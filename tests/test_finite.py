"""NaN and Inf in float32/bf16 runs (``cube.runtime.finite``).

``cube.check_finite`` after a step: all ranks agree (one all-reduce of a flag) even when only one
rank's gradient piece is not finite; ``"skip"`` drops the gradients so the optimizer step is skipped
and the parameters stay as they were, ``"stop"`` raises naming the rank and the gradient. A batch
with a NaN in it is skipped and training goes on finite. ``cube.find_nonfinite`` re-runs a step of
the single-device model in one process and names the first op that made a NaN or Inf, forward or
backward, with its model line, in float32 and bf16.
"""
from __future__ import annotations

import copy
import inspect

import pytest
import torch

import cube
import cube.debug
from cube.policies.data import PASData
from tests.models import build
from tests.parity import compile_step


def _world(tmp_path, body_after_step, world=2):
    model, sample = build("mlp")

    def body():
        loader = iter([sample] * 4)
        step = compile_step(copy.deepcopy(model), loader, PASData, tmp_path / "cache")
        gen = cube.load_model()
        loss = step(gen, loader)
        return body_after_step(gen, loss)
    return cube.debug.run(body, world)


def test_one_ranks_inf_gradient_skips_the_step_on_every_rank(tmp_path):
    def after(gen, loss):
        before = {k: p.detach().clone() for k, p in gen.named_parameters()}
        if cube.debug.rank() == 1:
            next(gen.parameters()).grad[0, 0] = float("inf")
        opt = torch.optim.SGD(gen.parameters(), lr=0.1)
        ok = cube.check_finite(gen, loss, on_nonfinite="skip")
        if ok:
            opt.step()
        return ok, all(p.grad is None for p in gen.parameters()), \
            all(torch.equal(p, before[k]) for k, p in gen.named_parameters())
    assert _world(tmp_path, after) == [(False, True, True)] * 2


def test_stop_names_the_rank_and_the_gradient(tmp_path):
    def after(gen, loss):
        if cube.debug.rank() == 1:
            next(gen.parameters()).grad[0, 0] = float("nan")
        with pytest.raises(cube.NonFiniteError) as e:
            cube.check_finite(gen, loss)
        return str(e.value)
    rank0, rank1 = _world(tmp_path, after)
    name = build("mlp")[0].state_dict().__iter__().__next__()
    assert "gradients are not finite (on other ranks)" in rank0
    assert f"gradients are not finite (on rank 1: ['{name}'])" in rank1
    assert "cube.find_nonfinite" in rank1
    with pytest.raises(RuntimeError, match="ValueError: cube.check_finite: on_nonfinite must be one of"):
        _world(tmp_path, lambda gen, loss: cube.check_finite(gen, loss, on_nonfinite="ignore"))


def test_a_nan_batch_is_skipped_and_training_goes_on(tmp_path):
    from cube.policies.single import PASSingle
    model, sample = build("mlp")
    bad = (sample[0].clone(),)
    bad[0][3, 5] = float("nan")
    batches = [sample, sample, bad, sample, sample]
    loader = iter(batches)
    step = compile_step(model, loader, PASSingle, tmp_path / "cache")
    gen = cube.load_model()
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
    taken, losses = [], []
    for _ in batches:
        loss = step(gen, loader)
        before = [p.detach().clone() for p in gen.parameters()]
        ok = cube.check_finite(gen, loss, on_nonfinite="skip")
        if ok:
            opt.step()
        else:
            assert all(torch.equal(p, b) for p, b in zip(gen.parameters(), before))
        opt.zero_grad()
        taken.append(ok)
        losses.append(loss.item())
    assert taken == [True, True, False, True, True]
    assert all(torch.isfinite(p).all() for p in gen.parameters())
    assert gen.__dict__["_skipped_steps"] == 1


class _Injected(torch.nn.Module):
    """A NaN made by one op: log of a negative activation."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.log(h - 1.0)   # the op that makes the NaN
        return self.b(h).mean()


class _BackwardInf(torch.nn.Module):
    """Finite forward, an infinite gradient: the derivative of sqrt at 0."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x) * 0.0
        return torch.sqrt(h.abs()).sum()   # d sqrt / dh at 0 is inf


def _line_of(cls, text: str) -> str:
    lines, start = inspect.getsourcelines(cls)
    i = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(cls)}:{start + i}: {lines[i].strip()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
def test_find_nonfinite_names_the_op_and_its_line(dtype):
    torch.manual_seed(0)
    model = _Injected().to(dtype)
    found = cube.find_nonfinite(model, torch.randn(4, 8, dtype=dtype))
    assert found is not None and found.op == "aten.log.default" and found.phase == "forward"
    assert found.where == _line_of(_Injected, "torch.log(h - 1.0)") and found.value == "nan"

    found = cube.find_nonfinite(_BackwardInf().to(dtype), torch.randn(4, 8, dtype=dtype))
    assert found is not None and found.phase == "backward" and found.value == "inf"
    assert found.where == _line_of(_BackwardInf, "torch.sqrt(h.abs())"), found
    fine = _Injected().to(dtype)
    fine.forward = lambda x: fine.b(torch.relu(fine.a(x))).mean()
    assert cube.find_nonfinite(fine, torch.randn(4, 8, dtype=dtype)) is None


def test_zero2_gradient_chunks_are_checked(tmp_path):
    """ZeRO-2 keeps each rank's chunk of the gradients in the optimizer, not in the parameters."""
    model, sample = build("mlp")

    def body():
        loader = iter([sample] * 3)
        step = compile_step(copy.deepcopy(model), loader, PASData, tmp_path / "cache")
        gen = cube.load_model()
        opt = cube.build_optimizer(gen, torch.optim.SGD, zero=2, lr=0.1)
        loss = step(gen, loader)
        assert all(p.grad is None for p in gen.parameters())
        first = cube.check_finite(gen, loss, on_nonfinite="skip")
        opt.step()
        opt.zero_grad()
        loss = step(gen, loader)
        if cube.debug.rank() == 1:
            gen.gradients()[0].view(-1)[0] = float("nan")
        return first, cube.check_finite(gen, loss, on_nonfinite="skip"), gen.gradients()
    assert [r[:2] for r in cube.debug.run(body, 2)] == [(True, False)] * 2
