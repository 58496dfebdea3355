"""A custom ``torch.autograd.Function`` in a model is traced through its forward (``cube.trace.functions``):
cube says so, once, naming the Function and the model line that applies it; a function registered with
``cube.register_op`` that applies it runs its backward as written."""
import logging

import torch
import torch.nn as nn

import cube
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


class Net(nn.Module):
    def __init__(self, registered: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.registered = registered

    def forward(self, x, y):
        h = self.a(x)
        h = _round(h) if self.registered else Straight.apply(h)
        return ((self.b(h) - y) ** 2).mean()


@cube.register_op("b^ f^ -> b^ f^", name="straight_round")
def _round(h):
    return Straight.apply(h)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g) * 3, torch.randn(4, 4, generator=g)


def test_a_custom_function_is_named_with_its_model_line(caplog):
    functions._REPORTED.discard(Straight)
    with caplog.at_level(logging.WARNING, logger="cube"):
        cube.trace_model(Net(), _batch())
        cube.trace_model(Net(), _batch())   # said once
    said = [r.getMessage() for r in caplog.records if "autograd.Function" in r.getMessage()]
    assert len(said) == 1, said
    assert "Straight" in said[0] and "Straight.apply(h)" in said[0] and "cube.register_op" in said[0], said[0]


def test_traced_through_its_forward_the_estimators_gradient_is_lost():
    """What the warning is about: the traced forward (round) has a zero gradient, the Function's
    backward passes it through; the compiled step's first linear does not move."""
    torch.manual_seed(0)
    model = Net()
    errors = parity(model, _batch(), "cube.policies.single:PASSingle", 1, steps=1, opt="sgd")
    assert max(e for _, e in errors) > 1e-3, errors


def test_registered_it_runs_its_own_backward():
    torch.manual_seed(0)
    assert_exact(parity(Net(registered=True), _batch(), "cube.policies.single:PASSingle", 1, steps=2, opt="sgd"))
