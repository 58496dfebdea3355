"""Rules derived from DTensor's single-dim sharding strategies (``cube.trace.derived``) for ATen ops cube has
no rule of its own for: each split checked against the op before it is trusted, then planned like a hand rule."""
import pytest
import torch
import torch.nn as nn

pytest.importorskip("torch.distributed.tensor")

import cube  # noqa: E402
from cube.trace import derived  # noqa: E402
from tests.inprocess import assert_exact, parity  # noqa: E402


class Mixed(nn.Module):
    """Ops with no hand-written rule (atan2, addcmul, acos, nan_to_num) and one whose hand rule splits
    nothing (roll), between linears."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x, y):
        h, g = self.a(x), self.b(x)
        z = torch.atan2(h, g) + torch.addcmul(h, g, g, value=0.5)
        z = z.roll(1, dims=1) * h.clamp(-0.9, 0.9).acos().nan_to_num()
        return ((self.c(z) - y) ** 2).mean()


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 6, 8, generator=gen), torch.randn(4, 6, 8, generator=gen)


def test_ops_without_a_rule_get_one_from_dtensor_and_its_splits():
    ops = {op.name: op for op in cube.trace_model(Mixed(), _batch()).graph.ops[1:]}
    for name in ("atan2", "addcmul", "acos", "nan_to_num", "roll"):
        assert getattr(ops[name], "anno_derived", False) and ops[name].anno is not None, name
    # roll along dim 1 keeps that dim whole and splits the others
    roll = str(ops["roll"].anno)
    ins = roll.split(" -> ")[0].split()
    assert ins[1].endswith("^") and not ins[0].endswith("^") and not ins[2].endswith("^"), roll


@pytest.mark.parametrize("policy", ["cube.policies.data:PASData", "cube.policies.megatron:PASMegatronTP"])
def test_derived_rules_train_exactly(policy):
    torch.manual_seed(0)
    assert_exact(parity(Mixed(), _batch(), policy, 2, steps=2, opt="sgd", strict=policy.endswith("PASData")))


def test_a_split_the_op_does_not_keep_is_dropped(monkeypatch):
    """A strategy claiming cumprod splits along its own dim fails the check; the batch dim's passes."""
    from torch.distributed.tensor import Shard

    class Info:
        @staticmethod
        def func(op, args, kwargs):
            return [[Shard(1), Shard(1)], [Shard(0), Shard(0)]]
    target = torch.ops.aten.cumprod.default
    monkeypatch.setattr(derived, "_strategies_table", lambda: {target: Info})
    monkeypatch.setattr(derived, "_CACHE", {})

    class Cum(nn.Module):
        def forward(self, x):
            return x.cumprod(1).pow(2).mean()
    op = next(o for o in cube.trace_model(Cum(), (torch.randn(4, 6),)).graph.ops if o.name == "cumprod")
    assert op.anno is not None and getattr(op, "anno_derived", False)
    text = str(op.anno)
    assert text.split(" -> ")[0].split()[1].endswith("^") and not text.split()[0].endswith("^"), text
