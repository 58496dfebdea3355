"""A constant padding split along the dim it pads (``cube.trace.rules.pad``, ``cube.ir.halo``): RWKV's
time shift, ``nn.ZeroPad2d((0, 0, 1, -1))``, mixes each token with the one before it. Split along the
sequence (context parallel, Megatron's sequence parallel), each block of the output reads the last row
of the block before it, exchanged inside the piece's call, the first block's shifted-in row filled with
the constant: a halo of one token, not the whole sequence gathered. Trained exactly against the plain
model; Hugging Face's RWKV as shipped under both plans in ``tests.zoo``."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.context import PASContext
from cube.policies.megatron3d import PASMegatron
from tests import zoo
from tests.inprocess import assert_exact, parity

B, T, E = 2, 8, 16
CP2 = functools.partial(PASContext, cp=2)
SP2 = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True)


class TimeShift(nn.Module):
    """RWKV's token mixing: a projection of the input mixed with itself shifted by ``shift`` tokens (padded
    with ``value``) before a key projection, a receptance gate, an output projection."""

    def __init__(self, shift=(1, -1), value: float = 0.0):
        super().__init__()
        self.shift, self.value = shift, value
        self.mix, self.inp = nn.Parameter(torch.rand(E)), nn.Linear(E, E)
        self.key, self.gate, self.out = nn.Linear(E, 2 * E), nn.Linear(E, 2 * E), nn.Linear(2 * E, E)

    def forward(self, x, y):
        x = self.inp(x)
        shifted = F.pad(x, (0, 0, *self.shift), value=self.value)
        if shifted.shape[1] != x.shape[1]:   # a shift that grows the sequence: cut back to its length
            shifted = shifted[:, :x.shape[1]]
        h = x * self.mix + shifted * (1 - self.mix)
        return F.mse_loss(self.out(torch.relu(self.key(h)) * torch.sigmoid(self.gate(h))), y)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(B, T, E, generator=gen), torch.randn(B, T, E, generator=gen)


def _pad_op(model):
    return next(op for op in cube.trace_model(model, _batch()).graph.ops if op.name in ("pad", "constant_pad_nd"))


def test_a_constant_padding_splits_the_dim_it_pads_with_a_halo():
    op = _pad_op(TimeShift())
    assert "~" in str(op.anno.inputs[0][1]) and op.algorithms("dim").satisfy(0, 1, 2), op.anno
    assert op.algorithms("dim").satisfy(0, 1, 4)   # a block of 2 tokens reads one of its neighbour's


def test_a_reflecting_padding_keeps_the_dim_whole():
    class Reflect(nn.Module):
        def forward(self, x, y):
            return F.mse_loss(F.pad(x.transpose(1, 2), (1, 1), mode="reflect")[..., 1:-1].transpose(1, 2), y)
    op = _pad_op(Reflect())
    assert not op.algorithms("dim").satisfy(0, 2, 2), op.anno


def test_context_parallel_exchanges_one_token_not_the_sequence():
    torch.manual_seed(0)
    plan = cube.plan(TimeShift(), _batch(), CP2, 2, strict=True).program.plans[0]
    steps = [c.step.kind for c in plan.calls if c.step is not None]
    assert "all_gather" not in steps and "all_to_all" not in steps, steps
    shift = next(c for c in plan.calls if c.op is not None and c.op.name in ("pad", "constant_pad_nd"))
    assert shift.inside is not None and shift.inside.fn == "runtime.halo.stencil", shift.inside
    # rank 0 holds the first block: it sends its last token to rank 1 and receives nothing
    assert dict(shift.inside.p2p) == {1: B * E * 4} and not dict(shift.inside.recvs), shift.inside


@pytest.mark.parametrize("shift,value", [((1, -1), 0.0), ((2, -2), -1.0), ((-1, 1), 0.5), ((1, 0), 0.0)])
@pytest.mark.parametrize("policy,world", [(CP2, 2), (SP2, 2)], ids=["cp", "sp"])
def test_a_shifted_sequence_trains_exactly(shift, value, policy, world):
    torch.manual_seed(0)
    assert_exact(parity(TimeShift(shift, value), _batch(), policy, world, steps=2, opt="sgd", strict=True))


@pytest.mark.parametrize("plan", ["sp", "cp"])
def test_hugging_face_rwkv_trains_exactly(plan):
    if not zoo.installed("rwkv"):
        pytest.skip("transformers is not installed here")
    outcome = zoo.run("rwkv", plan)
    assert outcome.kind == "exact", outcome


class Trigram(nn.Module):
    """MobileBERT's trigram input: each token's features beside those of the token after it and before it,
    written as a pad of a slice (``pad(x[:, 1:], (0, 0, 0, 1))``), traced as one pad of ``x``."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(E, E), nn.Linear(3 * E, E)

    def forward(self, x, y):
        x = self.inp(x)
        x = torch.cat([F.pad(x[:, 1:], [0, 0, 0, 1, 0, 0], value=0.0), x,
                       F.pad(x[:, :-1], [0, 0, 1, 0, 0, 0], value=0.0)], dim=2)
        return F.mse_loss(self.out(x), y)


def test_a_pad_of_a_slice_is_one_shift():
    ops = cube.trace_model(Trigram(), _batch()).graph.ops[1:]
    pads = [op.args[1] for op in ops if op.name == "pad"]
    assert "slice" not in [op.name for op in ops] and pads == [[0, 0, -1, 1, 0, 0], [0, 0, 1, -1, 0, 0]], pads


@pytest.mark.parametrize("policy,world", [(CP2, 2), (SP2, 2)], ids=["cp", "sp"])
def test_a_pad_of_a_slice_trains_exactly(policy, world):
    torch.manual_seed(0)
    assert_exact(parity(Trigram(), _batch(), policy, world, steps=2, opt="sgd", strict=True))
