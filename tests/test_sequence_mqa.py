"""Multi-query attention (one key/value head, as Falcon's) under Megatron's sequence parallel.

With fewer key/value heads than tensor-parallel ranks, the key and value projections cannot be
split by heads: tensor parallel splits them by output features and gathers their outputs
(``cube.ir.megatron._gathered_columns``), so what follows (the rotary embedding's slices of the key's
head dim) runs whole on every rank. Sequence parallel extends that plan: the projections read the
all-gathered sequence, and their gathered outputs stay whole, so no op is asked to split the
single head's dim it slices (``cube.ir.follow.follow`` does not follow the features of a split its
earlier flow gathered)."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.ir.follow import sequence_flow
from cube.ir.megatron import megatron_flow
from cube.ir.operator import IRFwOperation
from cube.policies.megatron3d import PASMegatron
from tests.inprocess import parity

V, S, D, H, HD = 16, 8, 32, 4, 8

_SP2 = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True)


def _rotate_half(x):
    return torch.cat((-x[..., HD // 2:], x[..., :HD // 2]), dim=-1)


class MQA(nn.Module):
    """One pre-norm block: queries of ``H`` heads, one key/value head, rotary embeddings that
    slice the head dim (``rotate_half``), causal attention broadcasting the single key/value head
    over the query heads; then an MLP pair and a language-model head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v = nn.Linear(D, H * HD), nn.Linear(D, HD), nn.Linear(D, HD)
        self.o = nn.Linear(H * HD, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.head = nn.Linear(D, V)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, HD, 2).float() / HD), persistent=False)

    def forward(self, ids, labels):
        x = self.emb(ids)
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, H, HD).transpose(1, 2)
        k = self.k(h).view(b, s, 1, HD).transpose(1, 2)
        v = self.v(h).view(b, s, 1, HD).transpose(1, 2)
        freqs = torch.arange(s, dtype=x.dtype)[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, H * HD))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _sample():
    ids = torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(0))
    return ids, ids.roll(-1, 1)


def test_sequence_parallel_leaves_the_single_key_head_whole():
    """The key projection is split by features and gathered under tensor parallel alone; sequence
    parallel keeps that: nothing after it is split (its rotary slices included), while the norms
    run on pieces of the sequence."""
    torch.manual_seed(0)
    graph = cube.trace_model(MQA(), _sample()).graph
    tensor = megatron_flow(graph, 2)
    seq = sequence_flow(graph, tensor, 2)
    ops = graph.select(ntype=IRFwOperation)
    key = next(op for op in ops if op.name == "linear" and op.inputs[1].shape == (HD, D)
               and "self.k(" in str(op.where()))
    assert id(key) in tensor.splits and id(key.outputs[0]) not in tensor.tracked
    assert id(key.outputs[0]) not in seq.tracked
    assert not seq.losses, [loss.why for loss in seq.losses.values()]
    norms = [op for op in ops if op.name == "layer_norm"]
    assert len(norms) == 2 and all(seq.split_of(op) == (0, 1) for op in norms)


def test_sequence_parallel_with_multi_query_attention_is_exact():
    torch.manual_seed(0)
    errors = parity(MQA(), _sample(), _SP2, 2, steps=2, opt="sgd", strict=True)
    assert all(e <= 1e-5 for rank in errors for e in rank), errors
