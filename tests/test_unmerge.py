"""Dims merged for a moment (``cube.trace.merged``): ``nn.MultiheadAttention``'s heads go through a
dim that merges the batch with them; the chain is rewritten as a view and a permute, so tensor
parallelism splits the heads (before: the projections ran whole on every rank), exactly."""
import functools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.ir.tensor import TensorKind
from cube.policies.megatron import PASMegatronTP
from tests import zoo
from tests.inprocess import assert_exact, parity
from tests.tiers import tiered

T, B, E, H = 8, 4, 32, 4


class MergedHeads(nn.Module):
    """Attention written as ``nn.MultiheadAttention`` writes it: sequence first, heads moved out of
    the features through ``(T, B * H, D)``; ``merge_last`` views the output through a dim merging
    two input dims (the chain the pass must leave alone)."""

    def __init__(self, merge_last: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))
        self.merge_last = merge_last

    def _heads(self, x):
        return x.view(T, B * H, E // H).transpose(0, 1).view(B, H, T, E // H)

    def forward(self, x, y):
        a = F.scaled_dot_product_attention(self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x)))
        if self.merge_last:
            a = a.transpose(1, 2).reshape(B * H, T, E // H).transpose(0, 1).reshape(T, B, E)
        else:
            a = a.permute(2, 0, 1, 3).reshape(T, B, E)
        return F.mse_loss(self.o(a), y)


def _sample():
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, B, E, generator=g), torch.randn(T, B, E, generator=g)


def _ops(model):
    return [op.name for op in cube.plan(model, _sample(), "cube.policies.single:PASSingle", 1).graph.ops]


def test_the_chain_becomes_one_view_and_one_permute():
    torch.manual_seed(0)
    names = _ops(MergedHeads())
    assert names.count("permute") >= 3 and names.count("transpose") == 0, names
    # each head chain: view (T, B, H, D), permute; the transient (T, B * H, D) view is gone
    assert names.count("view") == 3, names


def test_a_chain_whose_output_merges_two_input_dims_is_left_alone():
    """The output side transposes through ``(B * H, T, D)`` into ``(T, B, E)``: its last tensor merges
    the heads with the head dim (two dims of its input), so nothing is rewritten there."""
    torch.manual_seed(0)
    names = _ops(MergedHeads(merge_last=True))
    assert names.count("transpose") == 2, names


@pytest.mark.parametrize("merge_last", tiered([(False,), (True,)], ["permute_out", "merged_out"], {"merged_out"}))
def test_heads_split_by_tensor_parallelism_train_exactly_under_strict(merge_last):
    torch.manual_seed(0)
    errors = parity(MergedHeads(merge_last), _sample(), "cube.policies.megatron:PASMegatronTP", 2, steps=2,
                    opt="sgd", strict=not merge_last)
    assert_exact(errors)


@pytest.mark.parametrize("name", ["torch_encoder", "torch_transformer"])
def test_multihead_attention_holds_a_tp_th_of_its_projections(name):
    """torch.nn's own transformer under ``PASMegatronTP`` on 2 ranks: every attention and MLP
    weight of block 0 (the packed in-projection cut into q, k and v by ``cube.trace.fused``) half
    on each rank, and the training exact under ``strict=True``."""
    model, batch = zoo.build(name)
    held = {}
    planned = cube.plan(model, batch, PASMegatronTP, 2, ranks=[0], strict=True)
    for t, box in planned.program[0].plan.attrs:
        if t.kind is TensorKind.PARAM:
            for n in t.names:
                held[n] = held.get(n, 0) + math.prod(e - b for b, e in box)
    weights = [n for n, p in model.named_parameters() if p.ndim == 2 and "layers.0." in n]
    assert len(weights) >= 4 and all(held[n] == model.get_parameter(n).numel() // 2 for n in weights), \
        {n: held.get(n, 0) / model.get_parameter(n).numel() for n in weights}
    p = zoo.PLANS["tensor"]
    assert_exact(parity(model, batch, p.make(), p.world, steps=2, opt="sgd", param_floor=zoo.PARAM_FLOOR,
                        strict=True))


def test_rows_with_a_dropout_that_draws_nothing_keep_sequence_parallel():
    """OPT runs its feed-forward on ``(B*T, E)`` rows, ending in ``dropout(fc2(h), p)``; with dropout
    off (p = 0 draws nothing) ``cube.trace.rows`` gives the rows their dims back, so sequence
    parallelism keeps the sequence split through the block under ``strict=True``, exactly."""
    from cube.policies.megatron3d import PASMegatron
    model, batch = zoo.build("opt")
    policy = functools.partial(PASMegatron, tp=2, pp=1, sp=True, nmicros=1)
    assert_exact(parity(model, batch, policy, 2, steps=2, opt="sgd", param_floor=zoo.PARAM_FLOOR, strict=True))


class Router(nn.Module):
    """A router written on ``(B*T, E)`` rows as MoE layers write it: the input viewed twice, a view
    keeping the shape, top-k of the softmax, the weights renormalized by their sum along the rows."""

    def __init__(self):
        super().__init__()
        self.embed, self.gate, self.up = nn.Embedding(50, E), nn.Linear(E, 4, bias=False), nn.Linear(E, E)

    def forward(self, x, y):
        h = self.embed(x)
        rows, again = h.view(-1, E), h.view(-1, E)
        top, _ = torch.topk(F.softmax(self.gate(rows.reshape(-1, E)), dim=-1), 2, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        out = self.up(again) * top.amax(dim=-1, keepdim=True)
        return F.cross_entropy(out.view(x.shape[0], x.shape[1], E).sum(1), y)


def test_router_rows_keep_the_sequence_split():
    """``cube.trace.rows`` gives a router's rows their dims back through a second view of its
    input, a view keeping the shape, ``topk`` and reductions along the rows (keepdim): context
    parallel keeps the sequence split under ``strict=True``, exactly."""
    from cube.policies.context import PASContext
    from cube.trace import build_graph, export
    model = Router()
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, 50, (B, T), generator=gen), torch.randint(0, E, (B,), generator=gen))
    graph, _ = build_graph(export(model, batch), model, "tuple")
    assert not any(t.shape[:1] == (B * T,) for op in graph.ops for t in op.outputs), \
        [op.name for op in graph.ops if any(t.shape[:1] == (B * T,) for t in op.outputs)]
    assert_exact(parity(model, batch, functools.partial(PASContext, cp=2), 2, steps=2, opt="sgd", strict=True))
