"""Routers on flattened token rows given their ``(B, S)`` dims back through ops along the experts
(``cube.trace.along``): group views, ``topk``, ``max``, ``gather``, ``scatter``, ``masked_fill``,
``cat`` and random draws, as DeepSeek-V3's and PhiMoE's routers write them."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from cube.passes.rng import VALUES, mark_draws
from cube.trace import build_graph, export
from cube.trace.rows import unflatten_rows
from cube.trace.rules import REGISTRY
from tests.inprocess import assert_exact, parity

B, T, H, E, G = 2, 8, 16, 8, 2
aten = torch.ops.aten


class GroupRouter(nn.Module):
    """A router on ``(B*T, E)`` rows: group-limited scores (DeepSeek-V3), the best expert and the
    best of the rest (PhiMoE's ``max`` and ``scatter``), their weights gathered and concatenated,
    the experts' rows weighted and summed; ``draw`` adds Gumbel noise before the second choice."""

    def __init__(self, draw: bool = False):
        super().__init__()
        self.embed, self.gate = nn.Embedding(50, H), nn.Linear(H, E, bias=False)
        self.up, self.draw = nn.Linear(H, 2 * H), draw

    def forward(self, x, y):
        h = self.embed(x)
        rows = h.view(-1, H)
        scores = self.gate(rows).sigmoid()
        groups = scores.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        mask = torch.zeros_like(groups)
        mask.scatter_(1, groups.topk(1, dim=-1)[1], 1)
        mask = mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        chosen = scores.masked_fill(~mask.bool(), 0.0)
        _, first = chosen.max(dim=-1, keepdim=True)
        rest = torch.scatter(chosen, -1, first, float("-inf"))
        if self.draw:
            rest = rest - torch.empty_like(rest).exponential_().log()
        second = rest.max(dim=1)[1].unsqueeze(-1)
        weights = torch.cat([scores.gather(1, first), scores.gather(-1, second)], dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        pairs = self.up(rows).view(-1, 2, H)
        out = (pairs * weights.unsqueeze(-1)).sum(1)
        return F.cross_entropy(out.view(x.shape[0], x.shape[1], H).sum(1), y)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 50, (B, T), generator=gen), torch.randint(0, H, (B,), generator=gen)


def _flat(graph):
    """Ops of ``graph`` making a value of flattened ``(B*T, ...)`` rows."""
    return [op.name for op in graph.ops if any(t.shape[:1] == (B * T,) for t in op.outputs)]


def test_router_ops_along_the_experts_keep_the_token_dims():
    """Every op of the router runs on ``(B, T, ...)``: the merge and the restoring view are gone, the
    dims of group views, ``max``, ``gather``, ``scatter`` and ``cat`` moved by the dim added."""
    torch.manual_seed(0)
    model = GroupRouter()
    graph, _ = build_graph(export(model, _batch()), model, "tuple")
    assert _flat(graph) == [], _flat(graph)
    names = [op.name for op in graph.ops]
    for name in ("scatter", "gather", "max", "cat", "expand", "masked_fill", "topk"):
        assert name in names, (name, names)
    for op in graph.ops:
        if op.name in ("scatter", "gather", "cat", "max", "topk", "expand", "masked_fill", "view", "reshape"):
            assert all(t.shape[:2] == (B, T) for t in op.inputs + op.outputs if t.ndim >= 2 and
                       t.shape[0] == B), (op.name, [t.shape for t in op.inputs + op.outputs])
    view = next(op for op in graph.ops if op.name == "view" and op.outputs[0].shape == (B, T, G, E // G))
    assert view.args[1] == [B, T, G, E // G]


def test_router_under_context_parallel_is_exact():
    from cube.policies.context import PASContext
    torch.manual_seed(0)
    assert_exact(parity(GroupRouter(), _batch(), functools.partial(PASContext, cp=2), 2, steps=2, opt="sgd",
                        strict=True))


class RowsAcross(nn.Module):
    """A chain whose ``gather`` reads along the rows (dim 0): not row-wise."""

    def __init__(self):
        super().__init__()
        self.embed, self.gate = nn.Embedding(50, H), nn.Linear(H, E, bias=False)

    def forward(self, x, y):
        rows = self.embed(x).view(-1, H)
        s = self.gate(rows)
        s = s.gather(0, s.argsort(dim=0)) + s.max(dim=-1, keepdim=True)[0]
        return F.cross_entropy(s.view(x.shape[0], x.shape[1], E).sum(1), y)


def test_a_chain_with_an_op_across_the_rows_stays_whole():
    """No partial rewrite: one op along the rows keeps the whole chain on ``(B*T, .)``."""
    torch.manual_seed(0)
    model = RowsAcross()
    graph, _ = build_graph(export(model, _batch()), model, "tuple")
    assert {"gather", "max", "linear"} <= set(_flat(graph)), _flat(graph)


def test_a_marked_draw_runs_on_the_token_dims_and_keeps_its_draw():
    """At trace time the draws are not marked and the chain stays; once marked (a policy's graph), the
    ``exponential`` runs on ``(B, T, E)`` with its draw's index and that shape, contiguous."""
    torch.manual_seed(0)
    model = GroupRouter(draw=True)
    ep = export(model, _batch())
    graph, _ = build_graph(ep, model, "tuple")
    assert "exponential" in _flat(graph)
    (before,) = [op for op in mark_draws(graph, program=ep.graph_module)]
    assert before.draw.kind == "values" and before.draw.strides is None
    graph = unflatten_rows(graph, REGISTRY)
    assert _flat(graph) == [], _flat(graph)
    (after,) = [op for op in graph.ops if op.name == "exponential"]
    assert after is not before and after.outputs[0].shape == (B, T, E)
    assert after.draw == type(before.draw)(**{**before.draw.__dict__, "shape": (B, T, E)})


@pytest.mark.parametrize("op", sorted(VALUES, key=str) + ["dropout", "native_dropout"], ids=str)
def test_a_contiguous_draw_is_the_same_numbers_in_either_shape(op):
    """The whole draw made on ``(B, T, E)`` is the one made on ``(B*T, E)``, viewed: the CPU kernels
    fill a contiguous tensor in memory order (``cube.trace.along``'s reason a draw may move)."""
    def draw(shape):
        torch.manual_seed(0)
        if op == "dropout":
            return aten.dropout.default(torch.ones(shape), 0.3, True)
        if op == "native_dropout":
            return aten.native_dropout.default(torch.ones(shape), 0.3, True)[1]
        return op(torch.empty(shape))
    try:
        flat = draw((B * T * 3, E))
    except (RuntimeError, TypeError):   # an op that needs more arguments than its input (randint_like, ...)
        pytest.skip(f"{op} takes more arguments")
    assert torch.equal(flat.view(B, T * 3, E), draw((B, T * 3, E)))
