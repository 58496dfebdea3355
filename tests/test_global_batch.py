"""Pipeline plans take the user's loader as it is: one global batch per step, cut into micro-batches.

The compiled step of a pipeline plan takes ONE batch (what the user would train
on in one process), cuts it along dim 0 into ``nmicros`` equal micro-batches
and returns the loss of the whole batch; losses and updated parameters equal
the plain model trained on that batch, also when ``-100`` labels are spread
unevenly over the micro-batches (a mean over valid targets divides by the
valid targets of the global batch). What cannot be cut exactly is refused.
"""
from __future__ import annotations

import copy
import functools
import tempfile

import pytest
import torch
import torch.nn as nn

import cube
import cube.debug
from cube.policies.megatron3d import PASMegatron
from cube.policies.data import PASData
from cube.policies.pipeline import PAS1F1B, PASGPipe
from tests.launch import parity_across_ranks
from tests.models import build
from tests.inprocess import eager_reference, optimizer
from tests.parity import compile_step, global_batches, rel

RTOL = 1e-5


def _uneven_ignores(batches, nmicros):
    """Sets labels to -100 unevenly: most of micro-batch 0, a few of the others, all of the last."""
    out = []
    for ids, labels in batches:
        labels = labels.clone()
        b = labels.shape[0] // nmicros
        labels[:b, 1:] = -100
        labels[b:2 * b, :3] = -100
        labels[-b:] = -100   # a micro-batch with no valid target at all: its share is 0, not NaN
        out.append((ids, labels))
    return out


def _train(model, batches, policy, world, opt="adamw"):
    """Optimizer steps (AdamW, or ``opt="sgd"``) of the plain model and of cube on ``world``
    in-process ranks, one global batch each; returns per rank (loss error, parameter error,
    batches taken, BatchPart)."""
    make = optimizer(opt)
    ref_losses, ref_params = eager_reference(model, batches, make)
    cache = tempfile.mkdtemp(prefix="cube-global-")

    def body():
        taken = []

        def loader():
            for b in batches:
                taken.append(1)
                yield b
        it = loader()
        train_iter = compile_step(copy.deepcopy(model), it, policy, cache)
        gen = cube.load_model()
        gen_opt = make(gen.parameters())
        losses = []
        for _ in batches:
            losses.append(train_iter(gen, it).detach())
            gen_opt.step()
            gen_opt.zero_grad()
        loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
        param_err = max(rel(p, cube.runtime.piece(ref_params[gen.PARAMS[k][0][0]], gen.PARAMS[k][1]))
                        for k, p in gen.named_parameters())
        return loss_err, param_err, len(taken), cube.runtime.data.part()
    return cube.debug.run(body, world)


def test_1f1b_takes_one_global_batch_per_step():
    model, sample = build("gpt_nobias")
    batches = global_batches(sample, 3, nmicros=4)   # 16 sequences a step, 4 micro-batches of 4
    results = _train(model, batches, functools.partial(PAS1F1B, nmicros=4), 2)
    for loss_err, param_err, taken, part in results:
        assert loss_err <= RTOL and param_err <= RTOL, results
        assert part.nmicros == 4 and part.shapes[0] == (16, 16)
    assert results[0][2] == 3   # the first stage read one batch per step (compile's first included)
    assert results[1][2] == 3   # the last stage reads the labels


def test_1f1b_counts_ignored_labels_on_the_whole_batch():
    model, sample = build("gpt_nobias")
    batches = _uneven_ignores(global_batches(sample, 3, nmicros=4), 4)
    for loss_err, param_err, _, _ in _train(model, batches, functools.partial(PASGPipe, nmicros=4), 2):
        assert loss_err <= RTOL and param_err <= RTOL


def test_megatron_pp2_dp2_counts_ignored_labels_on_the_whole_batch():
    """Each rank's rows of the step are its contiguous data parallel part of the global batch.

    SGD: with labels ignored, AdamW turns the round-off of the data parallel sum of gradients near
    zero into 5e-5 (its sensitivity, see tests.parity.rel); the gloo test below uses AdamW."""
    model, sample = build("gpt_nobias")
    batches = _uneven_ignores(global_batches(sample, 2, nmicros=2), 2)
    policy = functools.partial(PASMegatron, tp=1, pp=2, nmicros=2)
    results = _train(model, batches, policy, 4, opt="sgd")
    for loss_err, param_err, _, part in results:
        assert loss_err <= RTOL and param_err <= RTOL, results
        assert part.nmicros == 2 and part.dp_size == 2
    assert [r[3].dp_rank for r in results] == [0, 1, 0, 1]


@pytest.mark.multirank
# the default tier: the same plan on gloo ranks with 4 micro-batches (tests/test_pipeline_policies.py,
# pp2-tp1-dp2) and with 2 in one process (test_megatron_pp2_dp2_counts_ignored_labels_on_the_whole_batch)
@pytest.mark.slow
def test_megatron_pp2_dp_tp_on_gloo_ranks(tmp_path):
    results = parity_across_ranks("gpt_nobias", "cube.policies.megatron3d:PASMegatron", 4, tmp_path, steps=3,
                                  nmicros=2, optimizer="adamw", env={"CUBE_TP": "1", "CUBE_PP": "2"})
    for r in results:
        assert r["loss_err"] <= RTOL and r["param_err"] <= RTOL, r


def test_indivisible_batch_is_a_clear_error():
    model, sample = build("gpt_nobias")
    batch = tuple(t[:3] for t in sample)
    with pytest.raises(ValueError, match=r"global batch of 3 samples.*nmicros=2.*multiple of 2"):
        cube.plan(model, batch, functools.partial(PAS1F1B, nmicros=2), 2)


def test_micro_batches_must_split_over_data_parallel():
    model, sample = build("gpt_nobias")
    batch = tuple(torch.cat([t, t])[:6] for t in sample)   # 6 = 2 micro-batches of 3: no dp2 split
    with pytest.raises(ValueError, match=r"global batch of 6 samples.*2 micro-batches of 3.*nmicros x the data"):
        cube.plan(model, batch, functools.partial(PASMegatron, tp=1, pp=2, nmicros=2), 4)


def test_plan_is_planned_on_the_micro_batch():
    model, sample = build("gpt_nobias")
    batch = tuple(torch.cat([t, t]) for t in sample)
    planned = cube.plan(model, batch, functools.partial(PAS1F1B, nmicros=4), 2)
    data = planned.graph.select(ntype=cube.ir.IRDataOperation)[0]
    assert [tuple(t.shape) for t in data.outputs] == [(2, 16), (2, 16)]
    assert planned.graph.micro.nmicros == 4 and planned.graph.micro.batch == 8
    assert "micro_batches((idx, targets), 4" in planned.source(0)
    assert "timings" and {"trace", "ir", "policy", "plan"} <= set(planned.timings)


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.bn(self.a(x))).pow(2).mean()


class _Penalized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x)).pow(2).mean() + 1e-3 * self.a.weight.pow(2).sum()


class _MeanOfSum(nn.Module):
    """``sum / batch size`` traced as a constant: exact, the constant taken from the global trace."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).sum() / x.shape[0]


@pytest.mark.parametrize("cls,match", [(_BatchNormNet, "statistics over the batch|mixes the samples"),
                                       (_Penalized, "not linear")])
def test_steps_micro_batches_cannot_reproduce_are_refused(cls, match):
    with pytest.raises(ValueError, match=match):
        cube.plan(cls(), torch.randn(8, 8), functools.partial(PAS1F1B, nmicros=2), 2)


def test_a_constant_from_the_batch_size_is_the_global_one():
    torch.manual_seed(0)
    batches = [(torch.randn(8, 8),) for _ in range(2)]
    for loss_err, param_err, _, _ in _train(_MeanOfSum(), batches, functools.partial(PAS1F1B, nmicros=4), 2):
        assert loss_err <= RTOL and param_err <= RTOL


class _SqueezedColumn(nn.Module):
    """``x.squeeze()`` of a ``(B, 1)`` value written into a column, as MBart's ``shift_tokens_right``:
    on a piece of one sample, ``squeeze()`` drops the batch dim too; traced, it drops dim 1 alone."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 8)

    def forward(self, x):
        y = self.b(x).clone()
        y[:, 0] = self.a(x).squeeze()
        return y.pow(2).mean()


@pytest.mark.parametrize("policy", [functools.partial(PAS1F1B, nmicros=2), PASData], ids=["1f1b", "data"])
def test_squeeze_of_every_size_one_dim_keeps_a_batch_of_one(policy):
    from tests.inprocess import assert_exact, parity
    torch.manual_seed(0)
    nmicros, batch = (1, 2) if policy is PASData else (2, 1)   # one sample a rank, or a micro-batch
    assert_exact(parity(_SqueezedColumn(), (torch.randn(batch, 8),), policy, 2, steps=2, nmicros=nmicros,
                        opt="sgd"))
