"""cube.register_op: a user function stays one annotated op and trains like eager."""
import torch
import torch.nn as nn

import cube
from cube.compiler import generate_code
from cube.trace import build_graph, export
from cube.policies.single import PASSingle
from tests.parity import check_parity


@cube.register_op("b h, b h -> b h", name="gated_mix")
def gated_mix(x, g):
    return x * torch.sigmoid(g) + g


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return gated_mix(self.a(x), self.b(x)).pow(2).mean()


def test_registered_op_is_one_annotated_op():
    model = Gated()
    x = torch.randn(4, 8)
    graph, _ = build_graph(export(model, (x,)), model, "tensor")
    ops = graph.select(name="gated_mix")
    assert len(ops) == 1
    assert str(ops[0].anno) == "b h, b h -> b h"
    assert ops[0].algorithms("dim").legal() == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "torch.ops.cube_user.gated_mix.default" in generate_code(model, x, PASSingle)[0]


def test_registered_op_trains_like_eager(tmp_path):
    torch.manual_seed(0)
    batches = [(torch.randn(4, 8),) for _ in range(5)]
    check_parity(Gated(), batches, 5, PASSingle, tmp_path, rtol=1e-6)
