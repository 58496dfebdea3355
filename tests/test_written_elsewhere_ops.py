"""Ops that models written elsewhere use and cube's own models did not: ``einsum`` (Mamba-2's chunked
scan), ``torch.max(a, b)`` (XGLM clamps its scores so), ``F.pad`` naming dims it pads by 0 (Mamba-2
pads its chunks so), ``x.repeat(batch, 1, 1)`` of a tensor made without the batch (BLOOM's ALiBi):
each splits what it should, and trains exactly under data, tensor and pipeline plans, strict."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.pipeline import PAS1F1B
from tests.inprocess import assert_exact, parity

B, S, E, H = 4, 8, 16, 4


class Written(nn.Module):
    """Heads mixed by einsums (explicit, implicit and ``...``), clamped by ``max(a, b)``, padded along
    the sequence with a zero pad on the batch dim named, a per-head bias repeated once per sample."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(E, 2 * E), nn.Linear(2 * E, E)
        self.mix = nn.Parameter(torch.randn(H, H) / H)
        self.bias = nn.Parameter(torch.randn(H, 1, 1))

    def forward(self, x, y):
        b = x.shape[0]
        h = self.up(x).view(b, S, H, 2 * E // H)                        # (b, s, h, d)
        g = torch.einsum("bshd,bthd->bhst", h, h) / 4                    # scores per head
        g = torch.max(g, torch.tensor(-1.0))                             # elementwise clamp
        g = g + self.bias.repeat(b, 1, 1).view(b, H, 1, 1)               # once per sample
        h = torch.einsum("bhst,bthd->bshd", g.softmax(-1), h)
        h = torch.einsum("...hd,hk->...kd", h, self.mix)                 # heads mixed: no head split
        p = F.pad(h, (0, 0, 0, 0, 0, 2, 0, 0))[:, :S]                    # (0, 0) on the batch dim
        out = self.down(torch.einsum("bshd->bsdh", p).reshape(b, S, 2 * E))
        return F.mse_loss(out, y)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, S, E, generator=gen), torch.randn(B, S, E, generator=gen)


def test_einsum_splits_its_output_letters_and_sums_the_others():
    ops = [op for op in cube.trace_model(Written(), _batch()).graph.ops if op.name == "einsum"]
    rules = [str(op.anno) for op in ops]
    assert rules[0] == "a d g i+, a j g i+ -> a g d j", rules    # bshd,bthd->bhst: d summed
    assert rules[1] == "a d g i+, a i+ d j -> a g d j", rules    # bhst,bthd->bshd: t summed
    assert rules[2] == "a d g+ i, g+ j -> a d j i", rules        # ...hd,hk->...kd: h summed
    assert rules[3] == "a d g i -> a d i g", rules               # bshd->bsdh: a permutation


def test_max_of_two_tensors_is_elementwise_and_pad_splits_unpadded_dims():
    """A constant padding splits its padded dim too, with a halo exchange inside the piece's call (``~``,
    ``tests/test_time_shift.py``); the others like an elementwise op's."""
    ops = {op.name: op for op in cube.trace_model(Written(), _batch()).graph.ops}
    assert "^" not in str(ops["max"].anno) and "+" not in str(ops["max"].anno), ops["max"].anno
    ins = str(ops["constant_pad_nd"].anno if "constant_pad_nd" in ops else ops["pad"].anno).split(" -> ")[0].split()
    assert [d.endswith("~") for d in ins] == [False, True, False, False] and not any("^" in d for d in ins), ins


@pytest.mark.parametrize("policy,world,nmicros", [
    ("cube.policies.data:PASData", 2, 1),
    ("cube.policies.megatron:PASMegatronTP", 2, 1),
    (functools.partial(PAS1F1B, nmicros=2), 2, 2),
])
def test_trains_exactly(policy, world, nmicros):
    torch.manual_seed(0)
    sample = tuple(t[:B // nmicros] for t in _batch()) if nmicros > 1 else _batch()
    assert_exact(parity(Written(), sample, policy, world, steps=2, nmicros=nmicros, opt="sgd",
                        strict="Megatron" not in str(policy)))


def _einsum_splits():
    """(einsum's position among the model's einsums, idx, dim) of every split its rule allows in two."""
    ops = [op for op in cube.trace_model(Written(), _batch()).graph.ops if op.name == "einsum"]
    return [(k, idx, dim) for k, op in enumerate(ops) for idx, dim in op.algorithms("dim").legal()
            if op.algorithms("dim").satisfy(idx, dim, 2)]


def _one_split(k: int, idx: int, dim: int):
    """A policy splitting the ``k``-th einsum in two at ``(idx, dim)`` and every other op whole on
    both devices: the planner moves its inputs into pieces and sums or joins its outputs."""
    from cube.ir import IRFwOperation
    from cube.ir.follow import place

    def policy(graph, resource):
        einsums = [op for op in graph.select(ntype=IRFwOperation) if op.name == "einsum"]
        for op in graph.nodes():
            place(graph, op, (idx, dim) if op is einsums[k] else None, [0, 1])
        return graph
    return policy


@pytest.mark.parametrize("k,idx,dim", _einsum_splits())
def test_every_split_of_an_einsum_is_exact(k, idx, dim):
    """Each split the rule allows, an output letter (joined) or a summed one (partial sums), trains
    exactly through cube's own partitioning and communication; the first einsum reads ``h`` twice
    (``bshd,bthd``), and a split cutting its two reads differently (``s`` or ``t`` alone) is refused
    naming the op."""
    torch.manual_seed(0)
    op = [op for op in cube.trace_model(Written(), _batch()).graph.ops if op.name == "einsum"][k]
    letter = op.anno.inputs[idx][dim].head.name
    cuts = {tuple(d for d, g in enumerate(op.anno.inputs[i]) if any(x.name == letter for x in g.idents))
            for i in range(len(op.inputs))}
    if len(op.inputs) > 1 and op.inputs[0] is op.inputs[1] and len(cuts) > 1:
        with pytest.raises(ValueError, match=r"op 'einsum' .* reads one tensor as inputs \[0, 1\]"):
            cube.plan(Written(), _batch(), _one_split(k, idx, dim), 2)
        return
    assert_exact(parity(Written(), _batch(), _one_split(k, idx, dim), 2, steps=1, opt="sgd"))
