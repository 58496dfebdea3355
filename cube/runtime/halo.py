"""Halo exchange: a spatially split convolution or pooling piece reads a window of its input.

Each rank of a split group holds one even block of a spatial dim. An op piece
computing this rank's block of the output reads its input's window
(``cube.ir.halo``): its block, the rows next to it from its neighbours, and
the op's padding at the global borders. :func:`stencil` exchanges the windows
dim after dim (the second dim's exchange carries the first's halo rows, so a
2 x 2 grid gets its corners), then runs the op, without padding along the
split dims, on the window.

:class:`HaloExchange` sends each neighbour the rows of this block its window
reads and receives the rows this window reads of theirs, all at once
(``batch_isend_irecv``); its backward is the adjoint: the window's gradient
rows that belong to a neighbour go back to it and are summed into its input
gradient.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.runtime.collectives import wire
from cube.runtime.compiled import outside_graph

# one tag for every halo message: each exchange completes before the next starts, and a pair of
# ranks matches its messages in order
TAG = 0x4841

Window = Tuple[int, int]


def _overlap(win: Window, lo: int, hi: int) -> Tuple[int, int]:
    return max(win[0], lo), min(win[1], hi)


@outside_graph
def _exchange(sends: List[Tuple[int, torch.Tensor]], recvs: List[Tuple[int, torch.Tensor]]) -> None:
    """Posts every send and receive at once and waits for all."""
    ops = [dist.P2POp(dist.isend, t, peer, tag=TAG) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=TAG) for peer, t in recvs]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _parts(x_shape, dim: int, ranks: Sequence[int], pos: int, wins: Sequence[Window]):
    """(mine, out, inn): the rows of my window I hold, the rows of each peer's window I send it,
    and the rows of my window each peer sends me, as ``(peer position, lo, hi)`` in global rows."""
    block = x_shape[dim]
    lo, hi = pos * block, (pos + 1) * block
    mine = _overlap(wins[pos], lo, hi)
    out = [(q, *_overlap(w, lo, hi)) for q, w in enumerate(wins) if q != pos]
    inn = [(q, *_overlap(wins[pos], q * block, (q + 1) * block)) for q in range(len(ranks)) if q != pos]
    return mine, [p for p in out if p[1] < p[2]], [p for p in inn if p[1] < p[2]]


def _buffer(like: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    shape = list(like.shape)
    shape[dim] = rows
    return torch.empty(shape, dtype=like.dtype, device=wire(like.device))


class HaloExchange(Function):
    """This block -> this rank's window along one dim; backward sums the window's gradient back
    into the blocks it came from."""

    @staticmethod
    def forward(ctx, x, dim, ranks, pos, wins, fill):
        mine, out, inn = _parts(x.shape, dim, ranks, pos, wins)
        ctx.args = (x.shape, dim, ranks, pos, wins)
        block = x.shape[dim]
        a, b = wins[pos]
        sends = [(ranks[q], x.narrow(dim, lo - pos * block, hi - lo).contiguous().to(wire(x.device)))
                 for q, lo, hi in out]
        recvs = [(ranks[q], _buffer(x, dim, hi - lo)) for q, lo, hi in inn]
        _exchange(sends, recvs)
        shape = list(x.shape)
        shape[dim] = b - a
        y = x.new_full(shape, fill)   # rows outside the global tensor: the op's padding
        if mine[0] < mine[1]:
            y.narrow(dim, mine[0] - a, mine[1] - mine[0]).copy_(x.narrow(dim, mine[0] - pos * block,
                                                                           mine[1] - mine[0]))
        for (q, lo, hi), (_, t) in zip(inn, recvs):
            y.narrow(dim, lo - a, hi - lo).copy_(t)
        return y

    @staticmethod
    def backward(ctx, grad):
        shape, dim, ranks, pos, wins = ctx.args
        mine, out, inn = _parts(shape, dim, ranks, pos, wins)
        block = shape[dim]
        a = wins[pos][0]
        sends = [(ranks[q], grad.narrow(dim, lo - a, hi - lo).contiguous().to(wire(grad.device)))
                 for q, lo, hi in inn]
        recvs = [(ranks[q], _buffer(grad, dim, hi - lo)) for q, lo, hi in out]
        _exchange(sends, recvs)
        gx = grad.new_zeros(shape)
        if mine[0] < mine[1]:
            gx.narrow(dim, mine[0] - pos * block, mine[1] - mine[0]).add_(
                grad.narrow(dim, mine[0] - a, mine[1] - mine[0]))
        for (q, lo, hi), (_, t) in zip(out, recvs):
            gx.narrow(dim, lo - pos * block, hi - lo).add_(t.to(gx.device))
        return gx, None, None, None, None, None


def window(x: torch.Tensor, dim: int, ranks: Sequence[int], pos: int, wins: Sequence[Window],
           fill: float = 0.0) -> torch.Tensor:
    """This rank's window of the input along ``dim``.

    Args:
        x: this rank's block (``x.shape[dim]`` rows; block ``pos`` of ``len(ranks)``).
        ranks: the group's ranks in block order.
        pos: this rank's block.
        wins: the window of every block, ``[start, stop)`` in global rows (outside ``[0, size)``: ``fill``).
    """
    return HaloExchange.apply(x, dim, tuple(ranks), pos, tuple(map(tuple, wins)), fill)


def stencil(op, x: torch.Tensor, *args, halo=(), fill: float = 0.0, **kwargs) -> torch.Tensor:
    """``op(window, *args, **kwargs)``: the op on this rank's window (``halo``: one
    ``(dim, ranks, position, windows)`` per exchanged dim, in order), whose padding along those
    dims is 0 (the window holds it). Returns this rank's block of the global output."""
    for dim, ranks, pos, wins in halo:
        x = window(x, dim, ranks, pos, wins, fill)
    return op(x, *args, **kwargs)
