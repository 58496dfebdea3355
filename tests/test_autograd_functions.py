"""A model's own ``torch.autograd.Function`` runs as written: its forward and its backward (an estimator,
a clipped derivative), one op of the program (``cube.runtime.functions``) whose splits are those its
pieces keep in forward and backward (``cube.trace.derived.derive_function``). A Function that cannot be
one op (defined inside a function, called with keywords) is traced through its forward: cube says so,
once, naming it and the model line; a function registered with ``cube.register_op`` that applies it runs
its backward as written."""
import functools
import logging

import pytest
import torch
import torch.nn as nn

import cube
from cube.policies.context import PASContext
from cube.policies.data import PASData
from cube.policies.megatron import PASMegatronTP
from cube.policies.pipeline import PAS1F1B
from cube.trace import functions
from tests.inprocess import assert_exact, parity


class Straight(torch.autograd.Function):
    """Rounds in forward, passes the gradient through in backward (a straight-through estimator)."""

    @staticmethod
    def forward(x):
        return torch.round(x)

    @staticmethod
    def setup_context(ctx, inputs, output):   # the form functorch's vjp (cube.register_op's backward) takes
        pass

    @staticmethod
    def backward(ctx, g):
        return g


class Clipped(torch.autograd.Function):
    """``sqrt`` with its derivative clipped (RecurrentGemma's ``SqrtBoundDerivative``), old style, with a
    constant argument."""

    @staticmethod
    def forward(ctx, x, bound):
        ctx.save_for_backward(x)
        ctx.bound = bound
        return x.sqrt()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / torch.sqrt(x).clamp(min=1 / ctx.bound) / 2, None


class Rows(torch.autograd.Function):
    """Each row scaled by its mean over the features: splits along the rows only."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x.mean(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.mean(-1, keepdim=True) * 3   # not the gradient: the Function's own


class Net(nn.Module):
    def __init__(self, how: str = "apply"):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.how = how

    def forward(self, x, y):
        h = self.a(x)
        if self.how == "registered":
            h = _round(h)
        elif self.how == "local":
            h = _LOCAL.apply(h)
        else:
            h = Straight.apply(h) + Clipped.apply(h.abs() + 1e-3, 1000.0) + Rows.apply(h)
        return ((self.b(h) - y) ** 2).mean()


def _local_straight():
    class LocalStraight(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.round(x)

        @staticmethod
        def backward(ctx, g):
            return g
    return LocalStraight


_LOCAL = _local_straight()


@cube.register_op("b^ f^ -> b^ f^", name="straight_round")
def _round(h):
    return Straight.apply(h)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, 8, generator=g) * 3, torch.randn(4, 6, 4, generator=g)


def test_a_function_is_one_op_split_where_its_pieces_agree():
    ops = [op for op in cube.trace_model(Net(), _batch()).graph.ops if op.name.startswith("fn_")]
    assert [op.name.split("_")[1] for op in ops] == ["Straight", "Clipped", "Rows"], [op.name for op in ops]
    annos = [str(op.anno) for op in ops]
    # elementwise: every dim splits; Rows mixes the features: its last dim is whole
    assert annos[0] == "d0 d1 d2 -> d0 d1 d2" and annos[1] == "d0 d1 d2 -> d0 d1 d2", annos
    assert annos[2].startswith("d0 d1 z") and annos[2].split(" -> ")[1].startswith("d0 d1 z"), annos


@pytest.mark.parametrize("policy,nmicros", [("cube.policies.single:PASSingle", 1), (PASData, 1), (PASMegatronTP, 1),
                                            (functools.partial(PASContext, cp=2), 1),
                                            (functools.partial(PAS1F1B, nmicros=2), 2)],
                         ids=["single", "data", "tensor", "cp", "1f1b"])
def test_a_function_runs_its_own_backward(policy, nmicros):
    """The traced forward of round has a zero gradient and of Rows another than its backward: only the
    Functions' own backwards give the plain model's update."""
    torch.manual_seed(0)
    world = 1 if isinstance(policy, str) else 2
    sample = _batch() if nmicros == 1 else tuple(t[:2] for t in _batch())
    assert_exact(parity(Net(), sample, policy, world, steps=2, nmicros=nmicros, opt="sgd",
                        strict=policy in (PASData,) or nmicros > 1))


def test_a_local_function_is_traced_through_and_named(caplog):
    functions._REPORTED.clear()
    with caplog.at_level(logging.WARNING, logger="cube"):
        cube.trace_model(Net("local"), _batch())
        cube.trace_model(Net("local"), _batch())   # said once
    said = [r.getMessage() for r in caplog.records if "autograd.Function" in r.getMessage()]
    assert len(said) == 1, said
    assert "LocalStraight" in said[0] and "apply(h)" in said[0] and "module level" in said[0], said[0]
    # what the warning is about: the traced forward (round) has a zero gradient, the Function's backward
    # passes it through; the compiled step's first linear does not move
    errors = parity(Net("local"), _batch(), "cube.policies.single:PASSingle", 1, steps=1, opt="sgd")
    assert max(e for _, e in errors) > 1e-3, errors


def test_registered_it_runs_its_own_backward():
    torch.manual_seed(0)
    assert_exact(parity(Net("registered"), _batch(), "cube.policies.single:PASSingle", 1, steps=2, opt="sgd"))
