"""An MoE layer that sorts the tokens of the batch by expert (Hugging Face's default grouped_mm
kernel, written out by hand) pipelines: cube proves the dispatch token-local (``cube.ir.dispatch``)
and runs it on each micro-batch's own tokens, exactly. A region that is not token-local (a cumsum
over the sorted rows, sorted rows never put back in order, a capacity cut, the per-expert counts in
a loss, offsets of ids sorted the other way, a row's position in the sorted batch) stays refused,
naming the op.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers.integrations.moe  # noqa: F401  (registers transformers::grouped_mm_fallback)

import cube
from cube.ir.follow import batch_flow
from cube.policies.pipeline import PAS1F1B
from tests.inprocess import parity

V, S, D, E, K, FF = 32, 6, 8, 4, 2, 16


class SortMoE(nn.Module):
    """Embedding, one sort-dispatch MoE layer (``variant`` picks how it computes and combines), head."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.emb, self.router, self.head = nn.Embedding(V, D), nn.Linear(D, E), nn.Linear(D, V)
        self.up = nn.Parameter(torch.randn(E, D, 2 * FF) * 0.3)
        self.down = nn.Parameter(torch.randn(E, FF, D) * 0.3)

    def forward(self, x, y):
        h = self.emb(x).flatten(0, 1)                        # (tokens, D): the batch is the outer factor
        if self.variant == "gumbel":                         # PhiMoE's sparsemixer: experts sampled, max indices
            w, ids = self._gumbel(self.router(h))
        else:
            w, ids = self.router(h).softmax(-1).topk(K, dim=-1)
        w, ids = w.reshape(-1), ids.reshape(-1)              # one row per (token, expert) pair
        if self.variant == "onehot":                         # torchtitan's way: counted before the sort
            return self._onehot(h, y)
        keys, perm = torch.sort(ids, descending=self.variant == "descending")
        xs, ws = h[perm // K], w[perm]                       # the pairs in expert order
        if self.variant == "cumsum":
            xs = xs.cumsum(0)                                # mixes the tokens of the batch
        if self.variant == "positional":
            xs = xs * torch.arange(xs.shape[0])[:, None]     # a row's place in the whole batch's order
        if self.variant == "capacity":
            xs = torch.cat([xs[:xs.shape[0] // 2], torch.zeros_like(xs[xs.shape[0] // 2:])])
        counts = torch.histc(keys.float(), bins=E, min=0, max=E - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        if self.variant == "index_add":                      # each row with its own expert's weights
            gate, val = torch.bmm(xs[:, None], self.up[keys])[:, 0].chunk(2, dim=-1)
            rows = torch.bmm((F.silu(gate) * val)[:, None], self.down[keys])[:, 0] * ws[:, None]
            out = torch.zeros_like(h).index_add(0, perm // K, rows)
        else:                                                # grouped matmuls by the sorted counts
            gate, val = torch.ops.transformers.grouped_mm_fallback(xs, self.up, offs).chunk(2, dim=-1)
            rows = torch.ops.transformers.grouped_mm_fallback(F.silu(gate) * val, self.down, offs) * ws[:, None]
            if self.variant == "unrestored":
                out = rows.view(-1, K, D).sum(1)             # the sorted order read as the tokens'
            else:
                inv = torch.empty_like(perm)
                inv[perm] = torch.arange(perm.shape[0])
                out = rows[inv].view(-1, K, D).sum(1)
        loss = F.cross_entropy(self.head(h + out), y.flatten())
        if self.variant == "aux":
            loss = loss + 0.01 * (counts / counts.sum()).pow(2).sum()   # counts over the whole batch
        return loss


    def _gumbel(self, scores):
        """Two experts per token drawn with Gumbel noise (``max`` of noisy scores along the experts,
        the first masked out for the second), their indices concatenated, as PhiMoE's router."""
        first = (scores - torch.empty_like(scores).exponential_().log()).max(dim=-1)[1].unsqueeze(-1)
        rest = scores.scatter(-1, first, float("-inf"))
        second = (rest - torch.empty_like(rest).exponential_().log()).max(dim=-1)[1].unsqueeze(-1)
        ids = torch.cat([first, second], dim=-1)
        return scores.softmax(-1).gather(-1, ids), ids

    def _onehot(self, h, y):
        """Per-expert counts from a one-hot of the top-k ids summed over the tokens (before the
        sort), a stable argsort, grouped matmuls, the rows scattered back (``scatter_add``)."""
        probs = self.router(h).softmax(-1)
        w, ids = probs.topk(K, dim=-1)
        counts = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, ids, True).sum(0)
        perm = torch.argsort(ids.reshape(-1), stable=True)
        xs, ws = h[perm // K], w.reshape(-1)[perm]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, val = torch.ops.transformers.grouped_mm_fallback(xs, self.up, offs).chunk(2, dim=-1)
        rows = torch.ops.transformers.grouped_mm_fallback(F.silu(gate) * val, self.down, offs) * ws[:, None]
        out = torch.zeros_like(h).scatter_add(0, (perm // K).reshape(-1, 1).expand(-1, D), rows)
        return F.cross_entropy(self.head(h + out), y.flatten())


def _sample(batch: int = 2):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (batch, S), generator=gen)
    return ids, ids.roll(1, dims=1)


@pytest.mark.parametrize("variant", ["grouped", "index_add", "gumbel"])
def test_a_sort_dispatch_moe_pipelines_exactly(variant):
    """``gumbel``: ids that are the indices of a ``max`` along the experts, concatenated, are proved in
    range as a ``topk``'s; the noise is the single device's (``exact_rng``)."""
    torch.manual_seed(0)
    model = SortMoE(variant)
    graph = cube.trace_model(model, _sample(4)).graph
    flow = batch_flow(graph, 2)
    sort = graph.select(name="sort")[0]
    assert id(sort) in flow.local and not flow.unproven
    assert [flow.tracked[id(t)] for t in flow.local[id(sort)].outputs] == [0]
    draws = dict(seed=7, exact_rng=True) if variant == "gumbel" else {}
    errors = parity(model, _sample(), functools.partial(PAS1F1B, nmicros=2), 2, steps=2, nmicros=2, **draws)
    assert max(max(e) for e in errors) < 1e-5, errors


def test_counts_before_the_sort_are_proved_and_pipelined():
    """Group offsets counted from a one-hot of the top-k ids before the sort (torchtitan's MoE) make
    a token-local region (expert parallel counts each rank's tokens again); on a micro-batch the ops
    counting them (``Region.counting``) count the micro-batch's tokens, the ones its sort orders: exact."""
    torch.manual_seed(0)
    graph = cube.trace_model(SortMoE("onehot"), _sample(4)).graph
    flow = batch_flow(graph, 2)
    (region,) = {id(r): r for r in flow.local.values()}.values()
    assert not flow.unproven and region.sort.name == "argsort" and len(region.recount) == 1
    assert [op.name for op in region.counting] == ["scatter", "sum", "cumsum"], region.counting
    assert all(flow.local.get(id(op)) is region for op in region.counting)
    errors = parity(SortMoE("onehot"), _sample(), functools.partial(PAS1F1B, nmicros=2), 2, steps=2, nmicros=2,
                    opt="sgd", strict=True)
    assert max(max(e) for e in errors) < 1e-5, errors


@pytest.mark.parametrize("variant,op", [("cumsum", "'cumsum'"), ("unrestored", "'view'"), ("capacity", "'slice'"),
                                        ("aux", "'sum'"), ("descending", "'histc'"), ("positional", "'mul'")])
def test_a_dispatch_that_is_not_token_local_stays_refused(variant, op):
    torch.manual_seed(0)
    traced = cube.trace_model(SortMoE(variant), _sample(4))
    with pytest.raises(ValueError, match="op 'sort'.*mixes the samples") as e:
        traced.micro(2)
    assert f"but not here: op {op}" in str(e.value), str(e.value)
