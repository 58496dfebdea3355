"""Ring attention with a learned per-head additive mask (T5's relative position bias).

``scaled_dot_product_attention`` given a float ``attn_mask`` of shape ``(B or 1, H, L, L)`` that
needs a gradient splits its sequence as a ring (``l~``): each rank keeps its rows of the mask,
its heads split with the heads under tensor parallel, and the ring's backward returns the
gradient of those rows (``cube.runtime.ring``), which flows back to the bias embedding. Under a
causal ring (zigzag) a mask's rows move with their queries. Every plan trains exactly like the
plain model (SGD, two steps, ``strict=True``: no split lost).
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
import cube.debug
from cube.policies.context import PASContext
from cube.runtime import ring
from tests.inprocess import assert_exact, parity
from tests.parity import rel


class BiasAttention(nn.Module):
    """Self-attention whose mask is a learned bias per head and relative position (clamped to
    ``span``, as T5's buckets), plus a causal float mask (-inf above the diagonal) or a padding
    mask per sample; ``causal_flag`` passes ``is_causal=True`` beside a mask that needs no gradient
    (a sliding window: its rows differ)."""

    def __init__(self, dim, heads, span, mask, causal_flag=False):
        super().__init__()
        self.heads, self.hd, self.span, self.mask, self.causal_flag = heads, dim // heads, span, mask, causal_flag
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.rel = nn.Embedding(2 * span + 1, heads)

    def bias(self, L):
        pos = torch.arange(L)
        bucket = (pos[None, :] - pos[:, None]).clamp(-self.span, self.span) + self.span
        return self.rel(bucket).permute(2, 0, 1).unsqueeze(0)   # (1, H, L, L)

    def forward(self, x, keep):
        B, L, C = x.shape
        q, k, v = (t.view(B, L, self.heads, self.hd).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.causal_flag:   # a sliding window and padding, no gradient, beside is_causal=True
            pos = torch.arange(L)
            hide = ((pos[:, None] - pos[None, :]) > self.span) | (keep[:, None, None, :] == 0)
            mask = torch.zeros(B, 1, L, L).masked_fill(hide, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, mask, is_causal=True)
        else:
            mask = self.bias(L)
            if self.mask == "causal":
                mask = mask + torch.full((L, L), float("-inf")).triu(1)
            elif self.mask == "padding":   # (B, H, L, L): per sample and head
                mask = mask + torch.zeros(B, 1, 1, L).masked_fill(keep[:, None, None, :] == 0, float("-inf"))
            y = F.scaled_dot_product_attention(q, k, v, mask)
        return self.o(y.transpose(1, 2).reshape(B, L, C))


class BiasLM(nn.Module):
    def __init__(self, mask="none", causal_flag=False, vocab=64, dim=32, heads=4, layers=2, span=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(n=nn.RMSNorm(dim), attn=BiasAttention(dim, heads, span, mask,
                                                                                             causal_flag)))
                                    for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, keep, targets):
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b["attn"](b["n"](x), keep)
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _case(**kw):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 16))
    keep = torch.ones(2, 16, dtype=torch.long)
    keep[1, -4:] = 0   # the second sample's last tokens are padding
    return BiasLM(**kw), (ids, keep, torch.roll(ids, -1, dims=1))


def _plan_parity(model, sample, policy, world):
    assert_exact(parity(model, sample, policy, world, steps=2, opt="sgd", strict=True), 1e-5)


# ---------------------------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("n,shape,hide", [(2, (2, 4, 16, 16), False), (4, (1, 4, 16, 16), True),
                                          (2, (2, 1, 1, 16), False)])
def test_ring_returns_the_mask_gradient(n, shape, hide):
    """The ring's output and the gradients of q, k, v and the mask, put together, equal
    ``F.scaled_dot_product_attention``'s; a mask broadcast along its rows is whole on every rank,
    and the ranks' gradients of it sum to the whole one."""
    torch.manual_seed(0)
    L = 16
    q, k, v = (torch.randn(2, 4, L, 8, requires_grad=True) for _ in range(3))
    m = torch.randn(*shape)
    if hide:   # -inf entries (the diagonal kept: every query sees a key), some chunk pairs wholly hidden
        m = m.masked_fill(torch.rand(m.shape) > 0.6, float("-inf")).masked_fill(torch.eye(L, dtype=torch.bool), 0.0)
        m[..., :L // 4, L // 2:] = float("-inf")
    m.requires_grad_()
    grad = torch.randn(2, 4, L, 8)
    want = F.scaled_dot_product_attention(q, k, v, m)
    wants = (want, *torch.autograd.grad(want, (q, k, v, m), grad))
    whole = m.shape[-2] == 1

    def body():
        r = cube.debug.rank()
        a, b, c = (t.detach().chunk(n, dim=-2)[r].clone().requires_grad_() for t in (q, k, v))
        rows = (m if whole else m.chunk(n, dim=-2)[r]).detach().clone().requires_grad_()
        out = ring.attention(a, b, c, rows, ranks=tuple(range(n)), pos=r)
        return (out.detach(), *torch.autograd.grad(out, (a, b, c, rows), grad.chunk(n, dim=-2)[r]))
    got = cube.debug.run(body, n)
    for i, w in enumerate(wants[:4]):
        assert rel(torch.cat([g[i] for g in got], dim=-2), w) <= 1e-6, i
    dmask = sum(g[4] for g in got) if whole else torch.cat([g[4] for g in got], dim=-2)
    assert rel(dmask, wants[4]) <= 1e-6


@pytest.mark.parametrize("n,dtype", [(2, torch.float32), (4, torch.bool)])
def test_causal_ring_moves_the_mask_rows_with_their_queries(n, dtype):
    """``is_causal=True`` beside a mask: the zigzag order takes each rank's rows of the mask along with
    its queries (before, the mask's contiguous rows met zigzag queries)."""
    torch.manual_seed(0)
    L = 16
    q, k, v = (torch.randn(2, 4, L, 8, requires_grad=True) for _ in range(3))
    keep = (torch.rand(2, 1, L, L) > 0.3) | torch.eye(L, dtype=torch.bool)
    m = keep if dtype == torch.bool else torch.randn(2, 4, L, L).masked_fill(~keep, float("-inf"))
    grad = torch.randn(2, 4, L, 8)
    want = F.scaled_dot_product_attention(q, k, v, m, is_causal=True)
    wants = (want, *torch.autograd.grad(want, (q, k, v), grad))

    def body():
        r = cube.debug.rank()
        a, b, c = (t.detach().chunk(n, dim=-2)[r].clone().requires_grad_() for t in (q, k, v))
        out = ring.attention(a, b, c, m.chunk(n, dim=-2)[r], ranks=tuple(range(n)), pos=r, causal=True)
        return (out.detach(), *torch.autograd.grad(out, (a, b, c), grad.chunk(n, dim=-2)[r]))
    got = cube.debug.run(body, n)
    for i, w in enumerate(wants):
        assert rel(torch.cat([g[i] for g in got], dim=-2), w) <= 1e-6, i


# ---------------------------------------------------------------------------------------------- plans
def test_learned_bias_trains_under_context_parallel():
    """A (1, H, L, L) learned bias as the mask: the ring runs on every layer, nothing is gathered, the
    ring moves only keys and values, and the bias embedding trains exactly."""
    model, sample = _case()
    policy = functools.partial(PASContext, cp=2)
    plan = cube.plan(model, sample, policy, 2)
    B, L = sample[0].shape
    kv = 2 * B * L * 32 * 4 // 2   # one rank's block of K and V, float32
    for r in range(2):
        src = plan.source(r)
        assert src.count("runtime.ring.attention(") == 2 and "all_gather(" not in src
        for call in (c for c in plan.program[r].plan.calls if c.inside is not None):
            assert call.inside.p2p == ((1 - r, kv),) and call.inside.bw_p2p == ((1 - r, 3 * kv),)
            assert call.inside.reorder == ()
    _plan_parity(model, sample, policy, 2)


def test_causal_float_mask_plus_bias_trains_under_context_parallel():
    """A causal mask given as floats (-inf above the diagonal, ``is_causal=False``) plus the bias."""
    model, sample = _case(mask="causal")
    _plan_parity(model, sample, functools.partial(PASContext, cp=2), 2)


def test_is_causal_with_a_mask_reorders_its_rows_and_counts_them():
    """``is_causal=True`` beside a sliding-window mask (no gradient): the zigzag reorder moves the mask's
    rows too, and the plan's reorder bytes count them (forward only: it has no gradient)."""
    model, sample = _case(causal_flag=True)
    policy = functools.partial(PASContext, cp=2)
    plan = cube.plan(model, sample, policy, 2)
    B, L = sample[0].shape
    chunk = B * L // 4 * 32 * 4   # a quarter of the sequence of q (or k, v, the output), float32
    rows = B * (L // 4) * L * 4   # a quarter of the mask's rows, (B, 1, L, L) float32
    for r in range(2):   # cp 2: rank 0's chunk 1 and rank 1's chunk 2 swap places
        for call in (c for c in plan.program[r].plan.calls if c.inside is not None):
            assert call.inside.reorder == ((1 - r, 3 * chunk + rows + chunk, chunk + 3 * chunk),)
    _plan_parity(model, sample, policy, 2)


@pytest.mark.slow
def test_per_sample_bias_trains_under_context_parallel():
    """(B, H, L, L): the bias plus each sample's padding."""
    model, sample = _case(mask="padding")
    _plan_parity(model, sample, functools.partial(PASContext, cp=2), 2)


@pytest.mark.slow
@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_bias_under_context_and_tensor_parallel(mask):
    """cp 2 x tp 2: the heads split over tp split the mask's heads (and the bias embedding's columns
    stay with them), the sequence over cp."""
    model, sample = _case(mask=mask)
    policy = functools.partial(PASContext, cp=2, tp=2)
    plan = cube.plan(model, sample, policy, 4)
    for ring_ranks in ((0, 2), (1, 3)):
        for pos, r in enumerate(ring_ranks):
            assert f"ranks={ring_ranks}, pos={pos}" in plan.source(r)
    _plan_parity(model, sample, policy, 4)

