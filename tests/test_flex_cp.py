"""Context parallel through ``flex_attention``: each rank keeps its block of queries, the keys and
values are all-gathered along the sequence inside the call (their gradients reduce-scattered back),
and the block mask's rows for those queries run with the score and mask functions seeing global
query indices (``cube.runtime.flex``, planned by ``cube.passes.inside``).

torchtitan's Llama 3 and Qwen 3 under ``PASContext`` (cp=2, strict=True): ``tests/test_zoo.py``'s
``tt_llama3-cp`` and ``tt_qwen3-cp`` (slow tier).

On the CPU flex_attention runs torch's dense implementation, which applies the mask function to
every pair and reads no block sparsity; the rows a piece takes of the block mask (what the fused GPU
kernels read) are checked against the global mask's directly.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torch.nn.attention.flex_attention")
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention  # noqa: E402

import cube  # noqa: E402
from cube.policies.context import PASContext  # noqa: E402
from cube.trace import flex  # noqa: E402
from tests.inprocess import assert_exact, parity  # noqa: E402
from tests.tiers import tiered  # noqa: E402

V, D, H, S = 64, 32, 4, 16
DOC = torch.tensor([0] * 5 + [1] * 5 + [2] * 6)   # packed documents: a partial block at each boundary


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def relative(score, b, h, q_idx, kv_idx):   # reads the query index: a piece must see global ones
    return score - 0.05 * (q_idx - kv_idx)


class Block(nn.Module):
    def __init__(self, kv_heads):
        super().__init__()
        self.kv, self.hd = kv_heads, D // H
        self.norm = nn.LayerNorm(D)
        self.q, self.o = nn.Linear(D, D), nn.Linear(D, D)
        self.k, self.v = nn.Linear(D, kv_heads * self.hd), nn.Linear(D, kv_heads * self.hd)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x, mask):
        b, s, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(b, s, H, self.hd).transpose(1, 2)
        k, v = (p(h).view(b, s, self.kv, self.hd).transpose(1, 2) for p in (self.k, self.v))
        a = flex_attention(q, k, v, score_mod=relative, block_mask=mask, enable_gqa=self.kv != H)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, D))
        return x + self.down(torch.relu(self.up(x)))


class Causal(nn.Module):
    """A causal block mask built in forward (folded into constants) with query blocks of ``block``."""

    def __init__(self, block=4, kv_heads=H, layers=2):
        super().__init__()
        self.block = block
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(Block(kv_heads) for _ in range(layers))
        self.head = nn.Linear(D, V)

    def mask(self, ids):
        s = ids.shape[1]
        return create_block_mask(causal, None, None, s, s, device=ids.device, BLOCK_SIZE=self.block)

    def forward(self, ids, labels):
        x = self.embed(ids)
        mask = self.mask(ids)
        for blk in self.blocks:
            x = blk(x, mask)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class Documents(Causal):
    """Packed documents: a causal mask within each document, the documents read from a tensor the mask
    function captures (made again at run time by cube's block-mask op) at the query's index."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.register_buffer("doc", DOC.clone())

    def mask(self, ids):
        s, doc = ids.shape[1], self.doc

        def same_document(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)
        return create_block_mask(same_document, None, None, s, s, device=ids.device, BLOCK_SIZE=self.block)


class PositionDocuments(Causal):
    """torchtitan's packed documents: each sample's document ids computed in forward from its per-token
    positions (a ``cumsum`` of the document starts along the sequence), captured by the mask function
    at the sample's and the query's index."""

    def forward(self, ids, labels, positions):
        doc = torch.cumsum((positions == 0).int(), dim=1) - 1
        s = ids.shape[1]

        def same_document(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        mask = create_block_mask(same_document, ids.shape[0], None, s, s, device=ids.device, BLOCK_SIZE=self.block)
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, mask)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _positions(n=2, s=S):
    ids, labels = _batch(n, s)
    starts = [[0, 5, 10], [0, 7, 9]]
    pos = torch.stack([torch.cat([torch.arange(b - a) for a, b in zip(st, st[1:] + [s])]) for st in starts[:n]])
    return ids, labels, pos


def _batch(n=2, s=S):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (n, s), generator=gen)
    return ids, ids.roll(-1, 1)


def _parity(model, cp=2, world=None, tp=1, sample=None):
    torch.manual_seed(0)
    with flex.device_check_off():   # the reference's backward on the CPU (cube's op turns it off itself)
        return parity(model, sample or _batch(), functools.partial(PASContext, cp=cp, tp=tp), world or cp * tp,
                      steps=2, opt="sgd", strict=True)


# ---------------------------------------------------------------------------------------------- the op alone
def _spec(mask_src, score_src, block, given):
    return {"seq_lengths": [S, S], "block_size": [block, block], "scale": None, "gqa": False, "kernel_options": {},
            "given": given, "score_buffers": 0, "score": score_src, "mask": mask_src, "batch_rows": [],
            "heads_read": False}


_MASK = "def forward(self, b, h, q_idx, kv_idx, doc):\n    return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)\n"
_SCORE = "def forward(self, score, b, h, q_idx, kv_idx):\n    return score - 0.05 * (q_idx - kv_idx)\n"


@pytest.mark.parametrize("n,block", tiered([(2, 4), (4, 4), (2, 16), (4, 16)], ["rows2", "rows1", "inside", "quarter"],
                                            slow={"rows1", "inside", "quarter"}))
def test_a_block_of_queries_reads_its_rows_of_the_block_mask_at_global_indices(n, block):
    """Each piece's rows of the block mask equal the global mask's (whole blocks, or a part of one), and
    its output and log-sum-exp equal the global op's rows (gradients: the plans' tests below)."""
    mask = create_block_mask(lambda b, h, qi, ki: (DOC[qi] == DOC[ki]) & (qi >= ki), None, None, S, S,
                             device="cpu", BLOCK_SIZE=block)
    kv = dict(zip(flex._KV, (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)))
    spec = _spec(_MASK, _SCORE, block, list(flex._KV))
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, H, S, 8, generator=gen) for _ in range(3))
    with flex.device_check_off():
        out, lse = flex.op()([q, k, v, *kv.values(), DOC], json.dumps(spec))
    dense = mask.to_dense()
    local = S // n
    for pos in range(n):
        start = pos * local
        rows = flex.local_rows(kv, block, start, start + local)
        piece = BlockMask.from_kv_blocks(*rows.values(), BLOCK_SIZE=block, seq_lengths=(local, S)).to_dense()
        first = start // block
        assert torch.equal(piece, dense[:, :, first:first + piece.shape[2]])
        if pos == 0 and n > 2:
            continue   # the global op's rows from 0: the last piece's offset is the one to check
        with flex.device_check_off():
            o, l_ = flex.op()([q[:, :, start:start + local], k, v, *kv.values(), DOC],
                              json.dumps(dict(spec, q_start=start)))
        torch.testing.assert_close(o, out[:, :, start:start + local], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(l_, lse[:, :, start:start + local], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- plans
def test_causal_flex_attention_keeps_the_sequence_split_and_trains_exactly():
    """cp=2 under strict=True (no split lost): a causal block mask of 4-query blocks, a score function
    reading the query index; each rank calls ``runtime.flex.attention`` on its 8 queries with its first
    query's index, gathering the whole K and V (the plan's bytes, which the simulator prices: an
    all-gather forward, a reduce-scatter of their gradients backward)."""
    from cube.sim.comm import CommModel, default_backend
    from cube.sim.costs import Estimator
    from cube.sim.program import Builder
    model, sample = Causal(layers=1), _batch()
    plan = cube.plan(model, sample, functools.partial(PASContext, cp=2), 2, strict=True)
    b, s = sample[0].shape
    kv = 2 * b * H * s * (D // H) * 4   # K and V of one layer, float32
    for r in range(2):
        src = plan.source(r)
        assert src.count("runtime.flex.attention(") == 1 and src.count(f'"q_start": {8 * r}}}') == 1, src
        calls = [c for c in plan.program[r].plan.calls if c.inside is not None]
        assert [c.inside.all_gather for c in calls] == [kv] and calls[0].inside.groups == ((0, 1),)
        program = Builder(plan.graph, plan.program[r], Estimator(), CommModel(default_backend())).build()
        priced = [(i.label.split()[0], i.nbytes) for i in program.ins if i.op == "coll"]
        assert ("all_gather", kv) in priced and ("reduce_scatter", kv) in priced, priced
    assert_exact(_parity(model))


@pytest.mark.slow
def test_a_document_mask_captured_by_the_mask_function_under_context_parallel():
    """The mask function indexes a captured tensor by the query's index (documents of 5 and 6 tokens
    over 4-query blocks: full and partial blocks), grouped-query attention (2 key/value heads)."""
    assert_exact(_parity(Documents(kv_heads=2)))


def test_document_ids_from_the_batch_are_computed_whole_on_every_rank():
    """The document ids (a ``cumsum`` along the sequence of the positions' starts) only feed the mask,
    which reads them whole: context parallel computes them whole on every rank from its whole batch
    (``cube.ir.follow``'s metadata), gathering nothing, rather than splitting the scan and gathering
    its output (a lost split under strict=True)."""
    model, sample = PositionDocuments(layers=1), _positions()
    plan = cube.plan(model, sample, functools.partial(PASContext, cp=2), 2, strict=True)
    assert not plan.lost
    ops = {op.name: op for op in plan.graph.ops if op.name in ("cumsum", "flex_attention")}
    assert not ops["cumsum"].splits and ops["flex_attention"].splits
    for r in range(2):
        assert "all_gather(" not in plan.source(r).replace("runtime.flex.attention(", "")


@pytest.mark.slow
def test_document_ids_from_the_batch_train_exactly_under_context_parallel():
    assert_exact(_parity(PositionDocuments(), sample=_positions()))


def test_an_uneven_split_of_the_query_blocks_is_refused():
    """12 queries per piece over blocks of 8 would split a block of the mask across two pieces."""
    model, sample = Causal(block=8, layers=1), _batch(s=24)
    graph = cube.trace_model(model, sample).graph
    op = graph.select(name="flex_attention")[0]
    with pytest.raises(ValueError, match=r"uneven split of op 'flex_attention' .*12 of the 24 queries.* query "
                                         r"block size 8") as info:
        graph.partition(op, op.algorithms("dim"), idx=0, dim=2, num=2)
    assert "module 'blocks.0'" in str(info.value) and "BLOCK_SIZE" in str(info.value)
    assert op.algorithms("dim").satisfy(0, 2, 3)   # 8 queries each: one block of the mask


def test_where_the_query_blocks_do_not_split_context_parallel_splits_the_heads():
    """``PASContext`` on that split runs the attention on each rank's heads instead (``cube.ir.heads``):
    q, k and v exchanged all-to-all from the sequence split into the head split, the output projection's
    partial sums reduce-scattered back into the sequence split; exact, no split lost."""
    model, sample = Causal(block=8, layers=1), _batch(s=24)
    policy = functools.partial(PASContext, cp=2)
    plan = cube.plan(model, sample, policy, 2, strict=True).program.plans[0]
    steps = [c.step.kind for c in plan.calls if c.step is not None]
    assert steps.count("all_to_all") == 3 and "all_gather" not in steps, steps
    attention = next(c for c in plan.calls if c.op is not None and c.op.name == "flex_attention")
    assert attention.layout.outputs[0][1] == (0, H // 2), attention.layout.outputs
    with flex.device_check_off():
        assert_exact(parity(model, sample, policy, 2, steps=2, opt="sgd", strict=True))


def test_cross_attention_keeps_the_keys_whole():
    class Cross(nn.Module):
        def forward(self, q, kv):
            return flex_attention(q, kv, kv).sum()
    with flex.device_check_off():
        graph = cube.trace_model(Cross(), (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 16, 4))).graph
    op = graph.select(name="flex_attention")[0]
    assert "~" not in str(op.anno) and not op.algorithms("dim").satisfy(0, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["cp4", "cp2xtp2", "one_block", "documents_mqa", "recompute"])
def test_more_context_parallel_plans_train_exactly(case):
    """cp=4 (4 queries per piece, one block each), cp 2 x tp 2 (heads over tp, one gather per tp rank's
    heads), blocks of 128 (every piece inside the one block, as torchtitan's), one key/value head, the
    blocks recomputed (the gather again in backward)."""
    if case == "cp4":
        errors = _parity(Causal(), cp=4, sample=_batch(4))   # the logits go on split along the batch
    elif case == "cp2xtp2":
        errors = _parity(Causal(), cp=2, tp=2)
    elif case == "one_block":
        errors = _parity(Documents(block=128), cp=4, sample=_batch(4))
    elif case == "documents_mqa":
        errors = _parity(Documents(kv_heads=1), cp=2)
    else:
        torch.manual_seed(0)
        with flex.device_check_off():
            errors = parity(Causal(), _batch(), functools.partial(PASContext, cp=2, recompute=True), 2, steps=2,
                            opt="sgd", strict=True)
    assert_exact(errors)
