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

from cube.runtime.collectives import to_wire, wire
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
        sends = [(ranks[q], to_wire(x.narrow(dim, lo - pos * block, hi - lo)))
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
        sends = [(ranks[q], to_wire(grad.narrow(dim, lo - a, hi - lo)))
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


def stencil(op, x: torch.Tensor, *args, halo=(), fill: float = 0.0, crop=(), **kwargs) -> torch.Tensor:
    """``op(window, *args, **kwargs)``: the op on this rank's window (``halo``: one
    ``(dim, ranks, position, windows)`` per exchanged dim, in order), whose padding along those
    dims is 0 (the window holds it). Returns this rank's block of the global output.

    ``crop``: ``(dim, start, length)`` of the block in the op's output, for an op whose window's
    output is larger than the block (a transposed convolution scatters past its block's edges).
    """
    for dim, ranks, pos, wins in halo:
        x = window(x, dim, ranks, pos, wins, fill)
    y = op(x, *args, **kwargs)
    for dim, start, length in crop:
        y = y.narrow(dim, start, length)
    return y


def linear(x: torch.Tensor, *, align_corners: bool, axes=(), halo=()) -> torch.Tensor:
    """Linear interpolation (``upsample_bilinear2d``) of this rank's block, with the global
    coordinates.

    Each output row ``o`` reads input rows ``i0 = floor(src)`` and ``i1 = min(i0 + 1, size - 1)``
    with weights ``1 - l`` and ``l`` (``l = src - i0``), ``src`` as ATen computes it in float
    (``scale * o`` with ``align_corners``, else ``max(scale * (o + 0.5) - 0.5, 0)``). Dims are
    interpolated last first, as ATen does, so the sums round alike.

    Args:
        x: this rank's block of the input.
        align_corners: the op's ``align_corners``.
        axes: one ``(dim, size_in, size_out, scale, out_start, out_len)`` per spatial dim: the
            global sizes, ATen's scale, and this rank's rows of the output.
        halo: one ``(dim, ranks, position, windows)`` per split dim (:func:`stencil`); a dim's
            rows are then counted from its window's start.
    """
    starts = {}
    for dim, ranks, pos, wins in halo:
        x = window(x, dim, ranks, pos, wins)
        starts[dim] = wins[pos][0]
    acc = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32   # ATen's opmath
    for dim, size_in, size_out, scale, out_start, out_len in reversed(tuple(axes)):
        if size_in == size_out:   # ATen copies rows through: this rank's rows of its window
            x = x.narrow(dim, out_start - starts.get(dim, 0), out_len)
            continue
        o = torch.arange(out_start, out_start + out_len, dtype=acc, device=x.device)
        s = torch.tensor(scale, dtype=acc, device=x.device)
        src = s * o if align_corners else (s * (o + 0.5) - 0.5).clamp_min(0)
        i0 = src.floor().long().clamp_max(size_in - 1)
        i1 = (i0 + 1).clamp_max(size_in - 1)
        l1 = (src - i0.to(acc)).clamp(0, 1)
        l0 = 1 - l1
        shape = [1] * x.dim()
        shape[dim] = out_len
        start = starts.get(dim, 0)
        x = (x.index_select(dim, i0 - start) * l0.to(x.dtype).view(shape)
             + x.index_select(dim, i1 - start) * l1.to(x.dtype).view(shape))
    return x
