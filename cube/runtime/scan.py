"""``cumsum`` along a dim split over a group of ranks: a scan across the pieces.

Rank ``ranks[p]`` holds block ``p`` of the dim. Its piece of the whole cumsum is the cumsum of its
own block plus the sum of every earlier block, that is of the earlier blocks' totals (the last
slice of each local cumsum). One all-reduce exchanges the totals: each rank writes its own into
slot ``p`` of a zero tensor of shape ``(n, *slice)``, and after the sum every rank reads all of
them (adding zeros is exact, so each slot holds its rank's totals bit for bit).

The prefix is added in the dtype the cumsum computes in (``dtype=``, or an integer input's
``int64``): integers are exact; floats differ from one cumsum of the whole dim only in where the
prefix is rounded in.

Backward (a float input that needs a gradient): the gradient of a cumsum is the reverse cumsum of
the output's gradient, so each rank adds to its local reverse cumsum the totals of the later
blocks' gradients, exchanged the same way.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd import Function

from cube.runtime import collectives


def _exchange(mine: torch.Tensor, ranks: Sequence[int], pos: int) -> torch.Tensor:
    """Every block's ``mine`` (this rank's is block ``pos``'s), stacked in block order: one all-reduce
    of a zero tensor holding ``mine`` in slot ``pos``."""
    slots = mine.new_zeros((len(ranks),) + tuple(mine.shape))
    slots[pos] = mine
    # through the module: torch.compile's fence swaps collectives.all_reduce for its disabled self
    return collectives.all_reduce(slots, tuple(ranks))


def _forward(x: torch.Tensor, dim: int, dtype, ranks: Sequence[int], pos: int) -> torch.Tensor:
    local = torch.cumsum(x, dim, dtype=dtype)
    totals = _exchange(local.select(dim, -1), ranks, pos)
    if pos:
        local += totals[:pos].sum(0).unsqueeze(dim)
    return local


class _Scan(Function):
    """The cumsum of blocks ``0 .. pos`` along ``dim`` of the whole tensor, on block ``pos``."""

    @staticmethod
    def forward(ctx, x, dim, dtype, ranks, pos):
        ctx.dim, ctx.ranks, ctx.pos, ctx.dtype = dim, ranks, pos, x.dtype
        return _forward(x, dim, dtype, ranks, pos)

    @staticmethod
    def backward(ctx, grad):
        dim, ranks, pos = ctx.dim, ctx.ranks, ctx.pos
        local = grad.flip(dim).cumsum(dim).flip(dim)   # the reverse cumsum: the block's totals in slice 0
        totals = _exchange(local.select(dim, 0), ranks, pos)
        if pos + 1 < len(ranks):
            local += totals[pos + 1:].sum(0).unsqueeze(dim)
        return local.to(ctx.dtype), None, None, None, None


def cumsum(x: torch.Tensor, dim: int, dtype: Optional[torch.dtype] = None, *, ranks: Sequence[int],
           pos: int) -> torch.Tensor:
    """``aten.cumsum`` of the whole tensor along ``dim``, this rank holding block ``pos`` of it, the
    blocks held by ``ranks`` in block order (an integer or bool input, or one without a gradient:
    forward only)."""
    dim, ranks = dim % x.dim(), tuple(ranks)
    if x.requires_grad and torch.is_grad_enabled():
        return _Scan.apply(x, dim, dtype, ranks, pos)
    return _forward(x, dim, dtype, ranks, pos)
