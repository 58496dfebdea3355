"""Dropless expert parallel: a fused MoE layer's piece on one rank (``cube.ir.experts``).

:func:`moe` runs the layer's own ops (its ``program``: ATen calls over numbered slots) on this
rank's tokens. Before the experts' part (``body``) the rows, sorted by expert, are sent to the
ranks holding their experts: the per-expert counts go first (one all-to-all of ``E`` integers),
then the rows, each peer receiving exactly its experts' rows (no capacity, no token dropped).
The received rows are regrouped by local expert and the body runs on them with this rank's
expert weights and the matching group offsets; the results go back by the reverse exchange and
land in the rows' places, and the rest of the program runs on this rank's tokens again. The row
exchanges are autograd functions whose backward is the exchange the other way.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.runtime.collectives import all_to_all_data, group, to_wire
from cube.runtime.compiled import outside_graph


def _exchange(x: torch.Tensor, ranks: Tuple[int, ...], sends: List[int], recvs: List[int]) -> torch.Tensor:
    """Rows ``x`` (blocks of ``sends[q]`` rows for ``ranks[q]``, in order) out; the blocks of
    ``recvs[q]`` rows from each ``ranks[q]`` back, concatenated in rank order."""
    me = ranks.index(dist.get_rank())
    grp = group(ranks)
    parts = list(to_wire(x.contiguous()).split(sends, 0))
    got = [x.new_empty((recvs[q],) + tuple(x.shape[1:])) if q != me else parts[me] for q in range(len(ranks))]
    ops = []
    for q, peer in enumerate(ranks):
        if q == me:
            continue
        if sends[q]:
            ops.append(dist.P2POp(dist.isend, parts[q].contiguous(), peer, grp))
        if recvs[q]:
            got[q] = to_wire(got[q])
            ops.append(dist.P2POp(dist.irecv, got[q], peer, grp))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    return torch.cat(got, 0).to(x.device)


class _Rows(Function):
    """The row exchange, whose adjoint is the exchange the other way."""

    @staticmethod
    def forward(ctx, x, ranks, sends, recvs):
        ctx.args = (ranks, sends, recvs)
        return _exchange(x, ranks, sends, recvs)

    @staticmethod
    def backward(ctx, grad):
        ranks, sends, recvs = ctx.args
        return _exchange(grad, ranks, recvs, sends), None, None, None


def _resolve(value, env: list):
    if isinstance(value, str) and value.startswith("%"):
        return env[int(value[1:])]
    if isinstance(value, str) and value.startswith("#"):   # a slot's length (arange over this rank's pairs)
        return env[int(value[1:])].shape[0]
    if isinstance(value, (list, tuple)):
        out = [_resolve(v, env) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, dict):
        return {k: _resolve(v, env) for k, v in value.items()}
    return value


@outside_graph
def moe(*inputs: torch.Tensor, program: Sequence[tuple], dispatch: int, offsets: int, body: Tuple[int, int],
        combine: int, experts: int, outputs: Sequence[int], ranks: Sequence[int], first: int, local: int):
    """This rank's piece of a fused MoE layer (module docstring).

    Args:
        inputs: this rank's token tensors, then its block of each expert weight.
        program: the layer's ops: ``(op, args, kwargs, output slots)``, ``"%k"`` naming slot ``k``
            (the inputs are the first slots), ``"#k"`` its length.
        dispatch, offsets: slots of the rows sorted by expert and of the group offsets that the
            first grouped matmul reads.
        body: indices in ``program`` of the experts' part's first and last op.
        combine: slot of the experts' part's result rows.
        experts: the number of experts ``E``.
        outputs: slots of the layer's outputs.
        ranks: the expert-parallel group; rank ``ranks[q]`` holds experts ``[q * E / n, (q + 1) * E / n)``.
        first, local: this rank's first expert and its number of experts.
    """
    ranks = tuple(ranks)
    n = len(ranks)
    env: list = list(inputs)
    saved = None
    for k, (fn, args, kwargs, outs) in enumerate(program):
        if k == body[0]:
            saved = _dispatch(env, dispatch, offsets, ranks, n, local, experts)
        value = fn(*_resolve(args, env), **_resolve(kwargs, env))
        values = value if isinstance(value, (tuple, list)) else (value,)
        for s, v in zip(outs, values):
            while len(env) <= s:
                env.append(None)
            env[s] = v
        if k == body[1]:
            env[combine] = _combine(env[combine], saved)
            env[dispatch], env[offsets] = saved[0], saved[1]
    result = tuple(env[s] for s in outputs)
    return result[0] if len(result) == 1 else result


def _dispatch(env: list, dispatch: int, offsets: int, ranks: Tuple[int, ...], n: int, local: int, experts: int):
    """Sends the sorted rows to their experts' ranks; puts the received rows, grouped by local
    expert, and their offsets into the slots. Returns what ``_combine`` needs."""
    x, offs = env[dispatch], env[offsets]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))                # rows per expert, this rank's tokens
    if counts.numel() != experts or int(ends[-1]) != x.shape[0]:
        raise RuntimeError(f"expert parallel: the group offsets count {int(ends[-1])} of {x.shape[0]} rows over "
                           f"{counts.numel()} groups, not every row over {experts} experts")
    mine = counts.view(n, local)                                         # row q: rows for rank q's experts
    theirs = all_to_all_data(mine.contiguous(), ranks, 0, 0) if n > 1 else mine   # row q: rank q's rows for mine
    sends, recvs = mine.sum(1).tolist(), theirs.sum(1).tolist()
    got = _Rows.apply(x, ranks, sends, recvs) if n > 1 else x
    # received: by source rank, then by expert; the body wants them by expert
    starts = torch.cumsum(theirs.flatten(), 0) - theirs.flatten()
    sizes = theirs.flatten().tolist()
    order = [torch.arange(int(starts[q * local + e]), int(starts[q * local + e]) + sizes[q * local + e])
             for e in range(local) for q in range(n)]
    index = torch.cat(order).to(x.device) if order else torch.zeros(0, dtype=torch.long, device=x.device)
    env[dispatch] = got[index]
    env[offsets] = torch.cumsum(theirs.sum(0), 0).to(offs.dtype)
    return x, offs, index, ranks, sends, recvs


def _combine(y: torch.Tensor, saved) -> torch.Tensor:
    """The body's rows back to the ranks (and places) they came from."""
    _, _, index, ranks, sends, recvs = saved
    back = torch.empty_like(index)
    back[index] = torch.arange(index.numel(), device=index.device)
    rows = y[back]
    return _Rows.apply(rows, ranks, recvs, sends) if len(ranks) > 1 else rows
