"""Context parallel (issue 19): ``scaled_dot_product_attention`` split along the sequence runs as
ring attention.

q, k and v stay split along the sequence on every rank of the split group; key/value blocks go
around the ring (``cube.runtime.ring``), never gathered to full length. Every plan trains exactly
like the single-device model (losses and updated parameters, rel <= 1e-5, SGD and AdamW) on the
in-process world: GPT (causal, zigzag-balanced) with cp 2 and 4, grouped-query attention
(``enable_gqa=True`` and the Hugging Face repeat before sdpa), non-causal attention with a
``scale``, Hugging Face GPT-2's explicit mask tensor, cp 2 x tp 2, dp 2 x cp 2, recomputed
blocks. The runtime function alone equals ``F.scaled_dot_product_attention`` (forward and
gradients, with and without masks), and the plan's ring bytes equal ``(cp - 1) / cp`` of the
whole K/V.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
import cube.debug
from cube.ir import ring as geometry
from cube.runtime import ring
from cube.policies.context import PASContext
from tests.inprocess import assert_exact, parity
from tests.models import build
from tests.parity import rel


class Attention(nn.Module):
    """Self-attention with ``kv_heads`` key/value heads: ``gqa="sdpa"`` passes them to sdpa with
    ``enable_gqa=True``, ``gqa="repeat"`` repeats them first as Hugging Face's ``repeat_kv`` does."""

    def __init__(self, dim, heads, kv_heads, causal, gqa, scale):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.causal, self.gqa, self.scale = causal, gqa, scale

    def forward(self, x):
        B, T, C = x.shape
        q = self.q(x).view(B, T, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.kv_heads, self.hd).transpose(1, 2)
        extra = {}
        if self.kv_heads != self.heads:
            if self.gqa == "repeat":
                rep = self.heads // self.kv_heads
                k = k[:, :, None].expand(B, self.kv_heads, rep, T, self.hd).reshape(B, self.heads, T, self.hd)
                v = v[:, :, None].expand(B, self.kv_heads, rep, T, self.hd).reshape(B, self.heads, T, self.hd)
            else:
                extra["enable_gqa"] = True
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, scale=self.scale, **extra)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class LM(nn.Module):
    """A small pre-norm language model around :class:`Attention` (RMS norm, SiLU MLP)."""

    def __init__(self, vocab=64, dim=32, heads=4, kv_heads=4, layers=2, causal=True, gqa="sdpa", scale=None):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(n1=nn.RMSNorm(dim), attn=Attention(dim, heads, kv_heads, causal,
                                                                                      gqa, scale),
                                                  n2=nn.RMSNorm(dim), up=nn.Linear(dim, 2 * dim, bias=False),
                                                  down=nn.Linear(2 * dim, dim, bias=False))))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b["attn"](b["n1"](x))
            x = x + b["down"](F.silu(b["up"](b["n2"](x))))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _lm(**kw):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    return LM(**kw), (ids, torch.roll(ids, -1, dims=1))


CASES = {
    "gpt": lambda: build("gpt_nobias"),
    "gqa": lambda: _lm(kv_heads=2, gqa="sdpa"),
    "gqa_repeat": lambda: _lm(kv_heads=1, gqa="repeat"),
    "noncausal_scale": lambda: _lm(causal=False, scale=0.2),
}


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("name", sorted(CASES))
def test_context_parallel_trains_like_eager(name, cp, opt):
    model, sample = CASES[name]()
    assert_exact(parity(model, sample, functools.partial(PASContext, cp=cp), cp, steps=2, opt=opt), 1e-5)


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
@pytest.mark.parametrize("tp,rings", [(2, ((0, 2), (1, 3))), (1, ((0, 1), (2, 3)))], ids=["cp2xtp2", "dp2xcp2"])
def test_context_parallel_with_tensor_or_data_parallel(tp, rings, opt):
    """cp 2 x tp 2: heads split over tp, the sequence over cp, a ring per tp rank's heads; dp 2 x cp 2:
    a ring per half of the batch."""
    model, sample = build("gpt_nobias")
    policy = functools.partial(PASContext, cp=2, tp=tp)
    plan = cube.plan(model, sample, policy, 4)
    for ring_ranks in rings:
        for pos, r in enumerate(ring_ranks):
            assert f"ranks={ring_ranks}, pos={pos}" in plan.source(r)
    assert_exact(parity(model, sample, policy, 4, steps=2, opt=opt), 1e-5)


# ---------------------------------------------------------------------------------------------- runtime
def _mask(kind, L):
    """A mask over (2, heads, L, L): causal and padding (bool, every query sees itself), additive
    with -inf entries, padding broadcast over the queries, or none."""
    if kind is None:
        return None
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(2, 1, L, L, generator=g) > 0.3
    keep |= torch.eye(L, dtype=torch.bool)
    if kind == "causal_bool":
        return keep & torch.ones(L, L, dtype=torch.bool).tril()
    if kind == "additive":
        return torch.where(keep, torch.randn(2, 1, L, L, generator=g), torch.tensor(float("-inf")))
    return (torch.arange(L) < L - 3).expand(2, 1, 1, L)   # "padding": the last keys hidden from all


@pytest.mark.parametrize("n,causal,heads,kv_heads,scale,balance,mask", [
    (2, False, 4, 4, None, True, None), (4, False, 4, 2, 0.3, True, None), (2, True, 4, 4, None, True, None),
    (4, True, 4, 1, None, True, None), (4, True, 4, 4, 0.5, False, None), (1, True, 2, 2, None, True, None),
    (4, False, 4, 2, None, False, "causal_bool"), (2, False, 4, 4, 0.3, False, "additive"),
    (4, False, 4, 4, None, False, "padding"),
])
def test_ring_attention_equals_sdpa(n, causal, heads, kv_heads, scale, balance, mask):
    """The runtime function on n blocks: its output and the gradients of q, k, v, put together, equal
    ``F.scaled_dot_product_attention`` on the whole sequence (with a mask tensor: each rank its rows)."""
    torch.manual_seed(0)
    L = 16
    q = torch.randn(2, heads, L, 8, requires_grad=True)
    k = torch.randn(2, kv_heads, L, 8, requires_grad=True)
    v = torch.randn(2, kv_heads, L, 6, requires_grad=True)
    grad = torch.randn(2, heads, L, 6)
    m = _mask(mask, L)
    want = F.scaled_dot_product_attention(q, k, v, m, is_causal=causal, scale=scale, enable_gqa=heads != kv_heads)
    wants = (want, *torch.autograd.grad(want, (q, k, v), grad))

    def body():
        r = cube.debug.rank()
        a, b, c = (t.detach().chunk(n, dim=-2)[r].clone().requires_grad_() for t in (q, k, v))
        rows = None if m is None else m if m.shape[-2] == 1 else m.chunk(n, dim=-2)[r]
        out = ring.attention(a, b, c, rows, ranks=tuple(range(n)), pos=r, causal=causal, scale=scale,
                             balance=balance)
        return (out.detach(), *torch.autograd.grad(out, (a, b, c), grad.chunk(n, dim=-2)[r]))
    got = cube.debug.run(body, n)
    for i, w in enumerate(wants):
        assert rel(torch.cat([g[i] for g in got], dim=-2), w) <= 1e-6, i


def test_zigzag_balances_causal_work():
    """Contiguous blocks: rank p computes 4p + 3 chunk pairs; zigzag: every rank 2n + 1."""
    n = 4
    assert [geometry.work(geometry.contiguous(n), p, True) for p in range(n)] == [3, 7, 11, 15]
    assert [geometry.work(geometry.zigzag(n), p, True) for p in range(n)] == [2 * n + 1] * n


# ---------------------------------------------------------------------------------------------- plan
def test_no_full_length_kv_gather_and_ring_bytes_are_the_formula():
    """The generated code calls the ring and gathers nothing (no k/v, no logits); the plan's ring
    bytes per rank and layer are (cp - 1) / cp of the whole K and V forward (twice that plus one
    block's gradients backward), the zigzag reordering's reported apart, and the simulator counts
    all of them."""
    from cube.sim.comm import CommModel, default_backend
    from cube.sim.costs import Estimator
    from cube.sim.program import Builder
    cp = 4
    model, sample = build("gpt_nobias")
    cfg = model.config
    B, T = sample[0].shape
    kv_full = 2 * B * T * cfg.n_embd * 4   # K and V of one layer, float32
    plan = cube.plan(model, sample, functools.partial(PASContext, cp=cp), cp)
    for r in range(cp):
        src = plan.source(r)
        assert src.count("runtime.ring.attention(") == cfg.n_layer
        # nothing is gathered nor exchanged: the loss of the logits flattened over batch and sequence
        # runs on each rank's block of the sequence (cube.trace.rows.unflatten_loss)
        assert "all_gather(" not in src and "all_to_all(" not in src
        calls = [c for c in plan.program[r].plan.calls if c.inside is not None]
        assert len(calls) == cfg.n_layer
        for call in calls:
            (peer, sent), = call.inside.p2p
            assert sent == kv_full * (cp - 1) // cp and peer == (r + 1) % cp
            (_, back), = call.inside.bw_p2p
            assert back == kv_full * (2 * cp - 1) // cp
            block = kv_full // 2 // cp   # q (or the output) of one rank, as k
            sends, _ = geometry.moves(geometry.contiguous(cp), geometry.zigzag(cp), r)
            sends_back, _ = geometry.moves(geometry.zigzag(cp), geometry.contiguous(cp), r)
            fw = sum(b for _, b, _ in call.inside.reorder)
            assert fw == sum(sends.values()) * 3 * block // 2 + sum(sends_back.values()) * block // 2
    from cube.codegen.report import plan_text
    assert plan_text(plan.program).count(f"runtime.ring.attention sends {kv_full * (cp - 1) // cp} B") == \
        cp * cfg.n_layer
    program = Builder(plan.graph, plan.program[1], Estimator(), CommModel(default_backend())).build()
    ring_sends = [i for i in program.ins if i.op == "send" and i.key[1][0] == "inside" and
                  isinstance(i.key[1][-1], int)]
    assert sum(i.nbytes for i in ring_sends) == cfg.n_layer * kv_full * (3 * cp - 2) // cp


def test_hf_gpt2_with_its_mask_tensor_runs_the_ring():
    """Hugging Face GPT-2 calls sdpa with an explicit causal mask tensor: each rank keeps its rows of
    it, keys and values go around the ring (batch 1: its Conv1D flattens batch and sequence, which a
    larger batch would stop the sequence split at). SGD: its fused key bias has a zero gradient by
    construction, which AdamW turns into round-off sized updates (see tests/models.py); c_attn is
    three projections (cube.trace.fused), so the key bias is a piece of its own, holding round-off
    only, compared against a floor (param_floor)."""
    from tests.models import hf_gpt2
    torch.manual_seed(0)
    model, ids = hf_gpt2(), torch.randint(0, 128, (1, 16))
    policy = functools.partial(PASContext, cp=2)
    src = cube.plan(model, (ids, ids.clone()), policy, 2).source(1)
    assert src.count("runtime.ring.attention(") == 2 and "all_gather(" not in src
    assert_exact(parity(model, (ids, ids.clone()), policy, 2, steps=2, param_floor=1e-3), 1e-5)


def test_cross_attention_keeps_the_gather():
    """Queries and keys of different lengths are not a ring: a split of the queries reads k and v
    whole, as before."""
    class Cross(nn.Module):
        def forward(self, q, kv):
            return F.scaled_dot_product_attention(q, kv, kv).sum()
    graph = cube.trace_model(Cross(), (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 6, 4))).graph
    op = graph.select(name="scaled_dot_product_attention")[0]
    assert "~" not in str(op.anno) and op.algorithms("dim").satisfy(0, 2, 2)


def test_uneven_causal_ring_is_refused():
    class Self(nn.Module):
        def forward(self, x):
            return F.scaled_dot_product_attention(x, x, x, is_causal=True).sum()
    graph = cube.trace_model(Self(), (torch.randn(1, 2, 12, 4),)).graph
    op = graph.select(name="scaled_dot_product_attention")[0]
    with pytest.raises(ValueError, match=r"sequence length 12 must be divisible by 8") as info:
        graph.partition(op, op.algorithms("dim"), idx=0, dim=2, num=4)
    assert "scaled_dot_product_attention" in str(info.value) and "test_ring_attention.py:" in str(info.value)


def test_pascontext_bad_degrees_are_a_clear_error():
    model, sample = build("gpt_nobias")
    with pytest.raises(ValueError, match=r"PASContext: 4 devices do not split into context parallel cp=3"):
        cube.plan(model, sample, functools.partial(PASContext, cp=3), 4)


def test_recomputed_blocks_run_the_ring_again():
    """Recomputing the blocks repeats the ring's messages in backward on every rank alike: exact."""
    model, sample = build("gpt_nobias")
    assert_exact(parity(model, sample, functools.partial(PASContext, cp=2, recompute=True), 2, steps=2), 1e-5)


def test_generated_code_finds_the_ring_without_importing_it():
    """Generated code calls ``runtime.ring.attention``: ``cube.runtime`` must hold it by itself."""
    import subprocess
    import sys
    code = "import cube.runtime as r; assert callable(r.ring.attention)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_simulator_predicts_a_context_parallel_plan():
    from cube.sim.api import simulate_policy
    from cube.sim.comm import CommModel, default_backend
    from cube.sim.costs import Estimator
    model, sample = build("gpt_nobias")
    res = simulate_policy(model, sample, functools.partial(PASContext, cp=4), 4, costs=Estimator(),
                          comm=CommModel(default_backend()))
    assert res.step_time > 0


@pytest.mark.parametrize("kw,ngpus", [
    (dict(tp=1, pp=2, cp=2), 4),
    (dict(tp=1, pp=2, cp=2, schedule_name="zb-h1"), 4),
    (dict(tp=2, pp=2, cp=2), 8),
], ids=["pp2xcp2", "pp2xcp2-zbh1", "pp2xcp2xtp2"])
def test_megatron_with_context_parallel_trains_like_eager(kw, ngpus):
    """``PASMegatron(cp=...)``: the sequence split over cp inside each pipeline stage (beside tp),
    attention as the ring on every stage, stages handing sequence pieces to each other."""
    from cube.policies.megatron3d import PASMegatron
    model, sample = build("gpt_nobias")
    policy = functools.partial(PASMegatron, nmicros=2, **kw)
    plan = cube.plan(model, sample, policy, ngpus)
    assert all("runtime.ring.attention" in plan.source(r) for r in range(ngpus))
    assert_exact(parity(model, sample, policy, ngpus, steps=2, opt="adamw"), 1e-5)


def test_megatron_context_parallel_bad_degrees_are_a_clear_error():
    from cube.policies.megatron3d import PASMegatron
    model, sample = build("gpt_nobias")
    with pytest.raises(ValueError, match=r"PASMegatron: cp=3 must divide the data parallel degree dp=4"):
        cube.plan(model, sample, functools.partial(PASMegatron, tp=1, pp=1, cp=3), 4)
    with pytest.raises(ValueError, match=r"cp=2 and ep=2 both take devices from dp"):
        cube.plan(model, sample, functools.partial(PASMegatron, tp=1, pp=1, cp=2, ep=2), 4)
