"""torch.nn's own transformer layers (``nn.TransformerEncoderLayer``, ``nn.Transformer``: so
``nn.MultiheadAttention``) under every shipped plan, and the trace pass that lets the batch split
through them (``cube.trace.rows``).

``F.multi_head_attention_forward`` works sequence first and merges ``(L, B)`` into the rows of a 2-D
matrix around its output projection, the batch the inner factor; cube runs the projection on
``(L, B, E)`` instead, so data parallel moves no activations and pipelines cut the batch into
micro-batches. The models are ``tests.zoo``'s (``torch_encoder*``, ``torch_transformer``): torch's
defaults but sizes and dropout, trained two SGD steps against the plain model.
"""
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.ir.tensor import TensorKind
from tests import zoo
from tests.inprocess import assert_exact, parity
from tests.tiers import tiered

TORCH = [m for m in zoo.MODELS if m.startswith("torch_")]


BASE = ("single", "data", "tensor", "pipeline", "pipeline_1", "3d")   # the default tier; the other plans: slow
CASES = [(m, p) for p in zoo.PLANS for m in TORCH]


@pytest.mark.parametrize("model,plan", tiered(CASES, [f"{m}-{p}" for m, p in CASES],
                                              {f"{m}-{p}" for m, p in CASES if p not in BASE}))
def test_torch_transformer_trains_exactly_under_every_plan(model, plan):
    outcome = zoo.run(model, plan)
    assert outcome.kind == "exact", outcome


def test_every_layout_of_torch_encoder_layer_is_in_the_tier():
    layers = [zoo.build(m)[0].stack.layers[0] for m in TORCH if m.startswith("torch_encoder")]
    assert {(layer.self_attn.batch_first, layer.norm_first) for layer in layers} == \
        {(False, False), (False, True), (True, False), (True, True)}


@pytest.mark.parametrize("model", TORCH)
def test_attention_output_projection_runs_on_sequence_and_batch(model):
    m, batch = zoo.build(model)
    graph = cube.trace_model(m, batch).graph
    rows = zoo.S * zoo.B
    projections = [op for op in graph.ops if op.name == "linear" and op.module_path.endswith("attn")
                   and (op.inputs[1].name or "").endswith("out_proj.weight")]
    assert projections and all(op.inputs[0].shape[:2] in ((zoo.S, zoo.B), (zoo.B, zoo.S)) for op in projections)
    # no activation holds the sequence and the batch merged into one dim (the loss's flatten aside)
    merged = [op for op in graph.ops for t in op.outputs if t.ndim and t.shape[0] == rows and op.name != "flatten"
              and not all(i.kind is TensorKind.PARAM for i in op.inputs)]
    assert not merged, merged


@pytest.mark.parametrize("model", ["torch_encoder", "torch_encoder_bf_nf", "torch_transformer"])
def test_data_parallel_moves_no_activations(model, caplog):
    m, batch = zoo.build(model)
    with caplog.at_level(logging.WARNING, logger="cube"):
        plan = cube.plan(m, batch, "PASData", 2, strict=True)
    assert plan.lost == [] and not [r for r in caplog.records if r.name == "cube"]
    for rank in plan.program.ranks:
        steps = [c for c in plan.program[rank].plan.calls if c.step is not None]
        # nn.Transformer's cross attention splits its in_proj weight into the query's and the key/value's
        # blocks: read as sub-parameters (cube.trace.fused.split_params), no split op runs and no piece of
        # it sums a gradient in backward outside the reducer
        assert not steps, steps


class Rows(nn.Module):
    """Code written for 2-D matrix APIs, sequence first as ``nn.MultiheadAttention``: ``(T, B, E)``
    merged into rows ``(T*B, E)``, row-wise ops (``addmm`` of a transposed weight, elementwise ops
    with broadcast parameters, a layer norm, a softmax along dim 1, ``mm``), the rows viewed back.

    ``variant`` keeps the rewrite out: a row read by an op outside the chain (``"reader"``), a
    dropout that draws in the chain (``"dropout"``), rows viewed back into another order (``"order"``);
    ``"dropout_off"`` (probability 0) does not."""

    def __init__(self, variant: str = "", dim: int = 8, hidden: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.w1 = nn.Parameter(torch.randn(hidden, dim) * 0.3)
        self.b1 = nn.Parameter(torch.randn(hidden) * 0.1)
        self.scale = nn.Parameter(torch.ones(hidden) + 0.1 * torch.randn(hidden))
        self.norm = nn.LayerNorm(hidden)
        self.w2 = nn.Parameter(torch.randn(hidden, dim) * 0.3)

    def forward(self, x, y):
        h = x.transpose(0, 1)
        t, b, e = h.shape
        r = torch.addmm(self.b1, h.reshape(t * b, e), self.w1.t())
        r = F.gelu(r) * self.scale + 0.5
        if self.variant == "dropout":   # a draw: its order follows the memory layout, which the rewrite may change
            r = F.dropout(r, p=0.1)
        if self.variant == "dropout_off":   # p = 0 draws nothing: rewritten as any row-wise op
            r = F.dropout(r, p=0.0)
        r = torch.softmax(self.norm(r), dim=1)
        out = torch.mm(r, self.w2)
        out = out.view(b, t, e) if self.variant == "order" else out.view(t, b, e).transpose(0, 1)
        loss = ((out - y) ** 2).mean()
        return loss + r.mean() if self.variant == "reader" else loss


def _rows_batch(batch: int = 4):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, 6, 8, generator=gen), torch.randn(batch, 6, 8, generator=gen)


def test_row_wise_chain_runs_on_unmerged_dims_and_keeps_every_split():
    batch = _rows_batch()
    graph = cube.trace_model(Rows(), batch).graph
    names = [op.name for op in graph.ops]
    # addmm(b, x, w.t()) is a linear of w (the transpose unread, dropped), mm a matmul; no reshape is left
    assert "addmm" not in names and "mm" not in names and "t" not in names and "view" not in names, names
    assert {"linear", "matmul", "layer_norm", "softmax"} <= set(names)
    assert all(t.ndim == 3 for op in graph.ops if op.name != "dataloader" for t in op.outputs if t.ndim > 0)
    softmax = next(op for op in graph.ops if op.name == "softmax")
    assert softmax.args[1] == -1
    assert cube.plan(Rows(), batch, "PASData", 2, strict=True).lost == []


@pytest.mark.parametrize("policy,world,nmicros", [("PASSingle", 1, 1), ("PASData", 2, 1), ("PAS1F1B", 2, 2)])
def test_row_wise_chain_trains_exactly(policy, world, nmicros):
    import functools

    from cube.policies.pipeline import PAS1F1B
    plan = functools.partial(PAS1F1B, nmicros=nmicros) if policy == "PAS1F1B" else policy
    assert_exact(parity(Rows(), _rows_batch(4 // nmicros), plan, world, steps=2, nmicros=nmicros))


@pytest.mark.parametrize("variant", ["reader", "dropout", "order"])
def test_chain_the_rewrite_cannot_prove_row_wise_is_left_alone_and_still_exact(variant):
    batch = _rows_batch()
    graph = cube.trace_model(Rows(variant), batch).graph
    # the merged rows stay: the values (T*B, hidden) and the addmm and mm on them
    assert {"addmm", "mm"} <= {op.name for op in graph.ops}
    assert any(t.shape == (4 * 6, 16) for op in graph.ops for t in op.outputs)
    plan = cube.plan(Rows(variant), batch, "PASData", 2)
    assert [r.what for r in plan.lost] and all(r.what == "data parallel" for r in plan.lost)
    rng = dict(seed=5, exact_rng=True) if variant == "dropout" else {}
    assert_exact(parity(Rows(variant), batch, "PASData", 2, steps=2, **rng))


def test_a_dropout_that_draws_nothing_keeps_the_rewrite():
    batch = _rows_batch()
    names = {op.name for op in cube.trace_model(Rows("dropout_off"), batch).graph.ops}
    assert not {"addmm", "mm"} & names and "dropout" in names, names
    assert cube.plan(Rows("dropout_off"), batch, "PASData", 2, strict=True).lost == []
