"""``cumsum`` along a dim the plan splits runs as a scan across the pieces (``cube.runtime.scan``):
each piece sums its block and adds the totals of the blocks before it, so sequence and context
parallel keep RoBERTa's position ids (``cumsum(mask, 1) * mask + padding_idx``) and a float
cumsum along the sequence split, exactly."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.context import PASContext
from cube.policies.megatron3d import PASMegatron
from cube.runtime import scan
from tests.inprocess import assert_exact, parity
from tests.models import build
from tests.parity import rel

V, S, D, PAD = 12, 8, 16, 1


class ScanModel(nn.Module):
    """Token and position embeddings (position ids as RoBERTa makes them: an integer cumsum of the
    non-padding mask), two Megatron pairs, between them a float cumsum along the sequence that
    needs a gradient; a squared error written out."""

    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(V, D), nn.Embedding(S + PAD + 1, D, padding_idx=PAD)
        self.up1, self.down1 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.norm = nn.LayerNorm(D)
        self.up2, self.down2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, ids, y):
        mask = ids.ne(PAD).int()
        positions = torch.cumsum(mask, dim=1).type_as(mask) * mask + PAD
        h = self.tok(ids) + self.pos(positions)
        h = h + self.down1(F.gelu(self.up1(h)))
        h = self.norm(h + 0.1 * h.cumsum(1))
        h = h + self.down2(F.gelu(self.up2(h)))
        return ((h - y) ** 2).mean()


def _sample(batch: int = 2):
    ids = torch.randint(0, V, (batch, S), generator=torch.Generator().manual_seed(0))
    ids[0, -1] = V - 1   # the largest id: batches draw ids below it + 1
    return ids, torch.randn(batch, S, D)


_CP2 = functools.partial(PASContext, cp=2)
_SP2 = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True)


# ------------------------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("n,dim,dtype", [(2, 1, None), (3, -1, None), (4, 0, torch.float64)])
def test_a_scan_of_float_blocks_equals_one_cumsum(n, dim, dtype):
    """Each rank a block of ``dim``: the pieces of the output, and of the input's gradient, put
    together, equal ``torch.cumsum`` of the whole (``dtype=`` honoured, the gradient in the input's)."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 12, requires_grad=True)
    want = torch.cumsum(x, dim, dtype=dtype)
    grad_out = torch.randn(want.shape, dtype=want.dtype)
    want_grad, = torch.autograd.grad(want, x, grad_out)

    def body():
        r = cube.debug.rank()
        piece = x.detach().chunk(n, dim)[r].clone().requires_grad_()
        out = scan.cumsum(piece, dim, dtype, ranks=tuple(range(n)), pos=r)
        return out.detach(), torch.autograd.grad(out, piece, grad_out.chunk(n, dim)[r])[0]
    got = cube.debug.run(body, n)
    out, grad = (torch.cat(ts, dim) for ts in zip(*got))
    assert out.dtype == want.dtype and grad.dtype == x.dtype
    assert rel(out, want) <= 1e-6 and rel(grad, want_grad) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64])
def test_a_scan_of_integer_blocks_is_exact(dtype):
    """Integers and bools (the mask behind position ids, document starts): forward only, bit for
    bit, in cumsum's output dtype; ``dtype=`` too."""
    x = torch.randint(0, 3, (2, 12), generator=torch.Generator().manual_seed(0)).to(dtype)

    def body():
        r = cube.debug.rank()
        piece = x.chunk(3, 1)[r]
        return (scan.cumsum(piece, 1, ranks=(0, 1, 2), pos=r),
                scan.cumsum(piece, 1, torch.int32, ranks=(0, 1, 2), pos=r))
    got = cube.debug.run(body, 3)
    for k, want in enumerate((torch.cumsum(x, 1), torch.cumsum(x, 1, dtype=torch.int32))):
        out = torch.cat([g[k] for g in got], 1)
        assert out.dtype == want.dtype and torch.equal(out, want)


# ---------------------------------------------------------------------------------------------- plan
def test_the_plan_scans_both_cumsums_and_prices_the_exchange():
    """Context parallel over 2: both cumsums call the scan (rank order, block position); forward
    all-reduces ``n`` slices of totals in the output's dtype, backward the same of the float one's
    gradient, the integer one nothing."""
    plan = cube.plan(ScanModel(), _sample(), _CP2, 2, strict=True)
    for r in range(2):
        ints, floats = [c.inside for c in plan.program[r].plan.calls if c.op is not None and c.op.name == "cumsum"]
        assert ints.fn == floats.fn == "runtime.scan.cumsum"
        assert ints.kwargs == floats.kwargs == {"ranks": (0, 1), "pos": r}
        assert (ints.all_reduce, ints.bw_all_reduce) == (2 * 2 * 8, 0)              # (n, batch) int64
        assert (floats.all_reduce, floats.bw_all_reduce) == (2 * 2 * D * 4,) * 2     # (n, batch, D) float32
        assert "runtime.scan.cumsum(" in plan.source(r)


# ----------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("policy,world", [(_CP2, 2), (_SP2, 2), (functools.partial(PASContext, cp=4), 4)],
                         ids=["cp2", "sp2", "cp4"])
def test_a_cumsum_along_the_split_sequence_is_exact(policy, world):
    torch.manual_seed(0)
    assert_exact(parity(ScanModel(), _sample(), policy, world, steps=2, opt="sgd", strict=True), 1e-5)


def test_capacity_slots_counted_along_the_split_sequence_are_exact():
    """A static-capacity MoE numbers each token's place in its expert's queue by a cumsum along the
    sequence (``tests.models.StaticMoE``): under context parallel the scan gives each block the
    places the whole sequence gives it, so the same tokens are kept and dropped."""
    model, sample = build("moe")
    assert_exact(parity(model, sample, functools.partial(PASMegatron, tp=1, pp=1, cp=2, nmicros=1), 2, steps=2,
                        opt="sgd", strict=True), 1e-5)
