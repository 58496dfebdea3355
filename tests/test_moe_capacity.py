"""Capacity-factor expert parallel (``PASMegatron(ep=k, capacity_factor=c)``) on Hugging Face
Mixtral: each expert takes at most ``C = ceil(c * T * k / E)`` of the batch's (token, expert)
pairs, kept in their tokens' order in the batch; the rest are dropped.

The reference is written here from that definition, in plain PyTorch: Mixtral's experts module
with its forward replaced by a loop over experts that keeps each expert's first ``C`` pairs in
token order and counts the rest. cube's runs (ep=1 on one device, ep2, ep4, ep2 x dp2) must drop
exactly as many pairs per layer and train exactly like it.
"""
from __future__ import annotations

import copy
import functools
import math
import types

import pytest
import torch
import transformers

import cube
import cube.debug
from cube.policies.megatron3d import PASMegatron
from cube.runtime import experts as moe_runtime
from tests.inprocess import assert_exact, eager_reference, parity
from tests.parity import global_batches

from tests.zoo import LM, SMALL, S, V, no_dropout

FACTOR = 1.0


def _mixtral(experts: int = 4):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(num_local_experts=experts, num_experts_per_tok=2,
                                     **dict(SMALL, num_hidden_layers=1))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, S), generator=gen)
    return LM(transformers.MixtralForCausalLM(no_dropout(cfg))), (ids, ids.clone())


def _capacity_forward(self, hidden, top_k_index, top_k_weights, *, factor, record):
    """The capacity rule on one device, from its definition: expert ``e`` computes the first
    ``C`` of its pairs in token order; the other pairs add nothing."""
    tokens, k = top_k_index.shape
    cap = math.ceil(factor * tokens * k / self.num_experts)
    out = torch.zeros_like(hidden)
    dropped = 0
    for e in range(self.num_experts):
        token, slot = torch.nonzero(top_k_index == e, as_tuple=True)   # row-major: ascending tokens
        dropped += max(0, token.numel() - cap)
        token, slot = token[:cap], slot[:cap]
        gate, up = torch.nn.functional.linear(hidden[token], self.gate_up_proj[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        out = out.index_add(0, token, y * top_k_weights[token, slot, None])
    record.append(dropped)
    return out


def _with_rule(model, factor: float, record: list):
    """A copy of ``model`` whose experts run the capacity rule above."""
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        if type(mod).__name__ == "MixtralExperts":
            mod.forward = types.MethodType(functools.partial(_capacity_forward, factor=factor, record=record), mod)
    return ref


def _reference(factor: float, record: list):
    return lambda model, batches, make: eager_reference(_with_rule(model, factor, record), batches, make)


def _policy(ep: int):
    return functools.partial(PASMegatron, tp=1, pp=1, nmicros=1, ep=ep, capacity_factor=FACTOR)


def _cube_drops(model, batches, policy, world: int):
    """Per rank: per step, the pairs each layer dropped (``cube.runtime.experts.dropped``)."""
    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy)
        def step(m, dl):
            loss = m(*next(dl))
            loss.backward()
            return loss
        gen = cube.load_model()
        out = []
        for _ in batches:
            step(gen, it)
            out.append(cube.runtime.experts.dropped())
        return out
    return cube.debug.run(body, world)


@pytest.mark.parametrize("ep,world", [pytest.param(1, 1, marks=pytest.mark.slow), (2, 2),
                                      pytest.param(4, 4, marks=pytest.mark.slow),
                                      pytest.param(2, 4, marks=pytest.mark.slow)])
def test_drop_counts_are_the_single_devices(ep, world):
    """Per step and layer, the pairs cube dropped (the same on every rank) equal the plain count of
    the rule from the router's top-k ids; and some pairs are dropped (the rule is exercised)."""
    model, sample = _mixtral()
    batches = global_batches(sample, 2)
    record: list = []
    eager_reference(_with_rule(model, FACTOR, record), batches, lambda p: torch.optim.SGD(p, lr=1e-3))
    layers = model.model.config.num_hidden_layers
    want = [record[i * layers:(i + 1) * layers] for i in range(len(batches))]
    assert sum(map(sum, want)) > 0, want
    for per_rank in _cube_drops(model, batches, _policy(ep), world):
        got = [[d[k] for k in sorted(d, key=lambda name: int(name.split("layers.")[1].split(".")[0]))]
               for d in per_rank]
        assert got == want, (got, want)


@pytest.mark.parametrize("ep,world,opt", [(2, 2, "adamw"), pytest.param(1, 1, "sgd", marks=pytest.mark.slow),
                                          pytest.param(2, 2, "sgd", marks=pytest.mark.slow),
                                          pytest.param(4, 4, "adamw", marks=pytest.mark.slow),
                                          pytest.param(4, 4, "sgd", marks=pytest.mark.slow),
                                          pytest.param(2, 4, "adamw", marks=pytest.mark.slow)])
def test_capacity_mode_trains_like_the_single_device_rule(ep, world, opt):
    """Loss and every parameter piece after 2 steps against the plain model under the same rule."""
    model, sample = _mixtral()
    assert_exact(parity(model, sample, _policy(ep), world, steps=2, opt=opt, reference=_reference(FACTOR, [])))


@pytest.mark.slow
def test_a_large_factor_drops_nothing_and_is_the_plain_model():
    """With room for every pair (factor E / k) nothing is dropped: the plain HF model."""
    model, sample = _mixtral()
    policy = functools.partial(PASMegatron, tp=1, pp=1, nmicros=1, ep=2, capacity_factor=2.0)
    assert_exact(parity(model, sample, policy, 2, steps=1, opt="sgd"))


def test_capacity_with_data_parallel_only_is_refused():
    """ep=1 on two data-parallel ranks would cut each rank's capacity from its own tokens."""
    model, sample = _mixtral()
    with pytest.raises(ValueError, match=r"capacity-factor MoE layer split along its tokens"):
        cube.plan(model, sample, _policy(1), 2)
    assert moe_runtime.dropped(rank=12345) == {}


@pytest.mark.slow
def test_capacity_with_pipeline_or_a_bad_factor_is_refused():
    model, sample = _mixtral()
    with pytest.raises(ValueError, match=r"capacity_factor=1.0 counts .* pp=2"):
        cube.plan(model, sample, functools.partial(PASMegatron, tp=1, pp=2, nmicros=2, ep=2,
                                                   capacity_factor=FACTOR), 4)
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be a positive number"):
        cube.plan(model, sample, functools.partial(PASMegatron, tp=1, pp=1, nmicros=1, ep=2, capacity_factor=0), 2)
