"""Mixed precision under ``torch.autocast`` over float32 parameters (``precision="bf16-autocast"``,
``"fp16-autocast"``) equals the plain model under the same autocast on the full batch; the fp16
loss scale; the choice of precisions. (``"bf16"``/``"fp16"``, float32 main parameters:
tests/test_main_params.py.)

Low-precision products round differently when the batch or the features are
split, so the comparison allows bf16-level differences (1e-3, bf16's epsilon is
7.8e-3) and uses SGD: AdamW turns such round-off on near-zero gradients into
full-size updates, which says nothing about the plan.
"""
import pytest
import torch

import cube
from tests.launch import parity_across_ranks

TOL = 1e-3

CASES = [
    # (model, policy, ranks, precision, zero, micro-batches)
    ("gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, "bf16-autocast", 0, 1),
    ("gpt_nobias", "tests/extra_policies.py:PAS1F1B", 2, "fp16-autocast", 0, 4),
    ("gpt_nobias", "cube.policies.data:PASData", 2, "fp16-autocast", 2, 1),
]


@pytest.mark.multirank
@pytest.mark.parametrize("model,policy,nproc,precision,zero,nmicros", CASES,
                         ids=[f"{m}-{p.split(':')[1]}-{n}-{pr}-zero{z}" for m, p, n, pr, z, _ in CASES])
def test_mixed_precision_equals_single_device_autocast(model, policy, nproc, precision, zero, nmicros, tmp_path):
    results = parity_across_ranks(model, policy, nproc, tmp_path, steps=3, nmicros=nmicros, zero=zero,
                                  precision=precision, optimizer="sgd")
    for r in results:
        assert r["loss_err"] <= TOL, r
        assert r["param_err"] <= TOL, r


def _fp16_model(tmp_path, precision="fp16-autocast"):
    from tests.models import build
    from tests.parity import compile_step
    model, sample = build("mlp")
    step = compile_step(model, iter([sample, sample]), "cube.policies.single:PASSingle", tmp_path, precision=precision)
    return step, cube.load_model(), sample


def test_fp16_plan_scales_the_loss_gradient(tmp_path):
    step, model, sample = _fp16_model(tmp_path)
    assert model.PRECISION == "fp16-autocast"
    assert "runtime.amp.scale_loss_grad(" in step.source
    assert model.parameters().__next__().dtype == torch.float32   # master weights stay float32


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    step, model, sample = _fp16_model(tmp_path)
    opt = cube.build_optimizer(model, torch.optim.SGD, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    model.loss_scale.scale = 1e38   # the scaled gradients overflow
    step(model, iter([sample]))
    assert model.loss_scale.found_inf and model.loss_scale.scale == 5e37
    opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    model.loss_scale.scale = 1024.0
    step(model, iter([sample]))
    assert not model.loss_scale.found_inf
    grads = [p.grad.clone() for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_loss_scale_grows_after_clean_steps():
    ls = cube.runtime.amp.LossScale(init_scale=8.0, growth_interval=2)
    ls.update(False)
    assert ls.scale == 8.0
    ls.update(False)
    assert ls.scale == 16.0
    ls.update(True)
    assert ls.scale == 8.0 and ls.found_inf


def test_bad_precision_is_a_clear_error():
    with pytest.raises(ValueError, match="precision must be None, 'bf16', 'fp16'"):
        cube.compile(torch.nn.Linear(2, 2), iter([]), PAS="cube.policies.single:PASSingle", precision="float16")


def test_fp16_main_parameters_skip_an_overflowed_step(tmp_path):
    step, model, sample = _fp16_model(tmp_path, "fp16")
    opt = cube.build_optimizer(model, torch.optim.SGD, lr=0.1)
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    assert {m.dtype for m in opt.main.mains} == {torch.float32}
    before = [m.detach().clone() for m in opt.main.mains]
    model.loss_scale.scale = 1e38   # overflows float16 at once
    step(model, iter([sample]))
    assert model.loss_scale.found_inf
    opt.step()
    assert all(torch.equal(a, m) for a, m in zip(before, opt.main.mains))
    opt.zero_grad()
    model.loss_scale.scale = 1024.0
    step(model, iter([sample]))
    assert not model.loss_scale.found_inf
    assert all(p.main_grad.dtype == torch.float32 and torch.isfinite(p.main_grad).all() for p in model.parameters())
    opt.step()
    assert any(not torch.equal(a, m) for a, m in zip(before, opt.main.mains))
    assert all(torch.equal(p, m.to(torch.float16)) for p, m in zip(model.parameters(), opt.main.mains))


def test_main_parameter_plan_needs_build_optimizer(tmp_path):
    step, model, sample = _fp16_model(tmp_path, "bf16")
    with pytest.raises(ValueError, match="cube.build_optimizer"):
        step(model, iter([sample]))
