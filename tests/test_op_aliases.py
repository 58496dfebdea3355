"""ATen's aliases trace as the op they name (``torch.multiply`` is ``mul``: ConvBERT's attention), so
every rule and pass that knows the op knows its alias; and the elementwise activations of vision and
speech models (hardswish, log-sigmoid, GLU, PReLU) and ``unfold`` (im2col) have rules. All train
exactly under data, tensor and context parallel and a pipeline of one-sample micro-batches."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.ir.ops import ALIASES
from cube.policies.context import PASContext
from cube.policies.data import PASData
from cube.policies.megatron import PASMegatronTP
from cube.policies.pipeline import PAS1F1B
from tests.inprocess import assert_exact, parity


class Aliased(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.slope = nn.Parameter(torch.full((6,), 0.2))

    def forward(self, x):   # (B, 6, 8)
        h = self.a(x)
        h = torch.multiply(h, torch.divide(h, torch.absolute(h) + 2.0))
        h = torch.subtract(h, torch.negative(torch.arctan(h)) * 0.5)
        h = torch.where(torch.greater(h, 0.1) & torch.less_equal(h, 2.0) & torch.not_equal(h, 0.3), h, 0.5 * h)
        h = torch.clip(h, -3.0, 3.0) + F.hardswish(h) + F.logsigmoid(h) + torch.arctan2(h, h + 4.0)
        h = F.glu(torch.cat([h, h.flip(-1)], dim=-1), dim=-1)
        h = F.prelu(h, self.slope)   # one slope per channel: dim 1 (the positions here)
        # ConvBERT's span convolution: each position's neighbours unfolded, (B, 16 * 3, 6)
        u = F.unfold(h.transpose(1, 2).unsqueeze(-1), kernel_size=[3, 1], padding=[1, 0])
        h = h + u.transpose(1, 2).unflatten(-1, (16, 3)).mean(-1)
        return self.b(h).pow(2).mean()


def _sample():
    return (torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0)),)


def test_aliases_trace_as_the_ops_they_name_and_every_op_has_a_rule():
    ops = cube.trace_model(Aliased(), _sample()).graph.ops[1:]
    names = {op.name for op in ops}
    assert not names & set(ALIASES), names & set(ALIASES)
    assert {"mul", "div", "abs", "sub", "neg", "atan", "gt", "le", "ne", "clamp", "atan2"} <= names, names
    assert [op.name for op in ops if op.anno is None] == [], [(op.name, op.anno_error) for op in ops if op.anno is None]


@pytest.mark.parametrize("policy,nmicros", [(PASData, 1), (PASMegatronTP, 1), (functools.partial(PASContext, cp=2), 1),
                                            (functools.partial(PAS1F1B, nmicros=2), 2)],
                         ids=["data", "tensor", "cp", "1f1b"])
def test_aliased_ops_train_exactly(policy, nmicros):
    torch.manual_seed(0)
    sample = _sample() if nmicros == 1 else (_sample()[0][:1],)   # micro-batches of one sample
    strict = policy is PASData or nmicros > 1
    assert_exact(parity(Aliased(), sample, policy, 2, steps=2, nmicros=nmicros, opt="sgd", strict=strict))


class WrittenThroughShapes(nn.Module):
    """``reshape_as`` and ``expand_as`` read only the other tensor's shape (traced as ``reshape`` and
    ``expand``), and stay views of their input: a write through ``reshape_as``'s result reaches it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        y = h.reshape_as(torch.empty(h.shape[0], 2, 4))
        y[:, 0] = y[:, 0] * 3
        return (h.pow(2) + h.expand_as(torch.empty(2, h.shape[0], 8)).sum(0)).mean()


def test_a_write_through_reshape_as_reaches_its_input():
    torch.manual_seed(0)
    ops = {op.name for op in cube.trace_model(WrittenThroughShapes(), (torch.randn(4, 8),)).graph.ops[1:]}
    assert "reshape_as" not in ops and "expand_as" not in ops, ops
    assert_exact(parity(WrittenThroughShapes(), (torch.randn(4, 8),), PASData, 2, steps=2, opt="sgd", strict=True))
