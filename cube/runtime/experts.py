"""Dropless expert parallel: a fused MoE layer's piece on one rank (``cube.ir.experts``).

:func:`moe` runs the layer's own ops (its ``program``: ATen calls over numbered slots) on this
rank's tokens. Before the experts' part (``body``) the rows, sorted by expert, are sent to the
ranks holding their experts: the per-expert counts go first (one all-to-all of ``E`` integers),
then the rows, each peer receiving exactly its experts' rows (no capacity, no token dropped).
The received rows are regrouped by local expert and the body runs on them with this rank's
expert weights and the matching group offsets; the results go back by the reverse exchange and
land in the rows' places, and the rest of the program runs on this rank's tokens again. The row
exchanges are autograd functions whose backward is the exchange the other way.

Capacity mode (``capacity``: a capacity factor ``c``, GShard/Switch): each expert takes at most
``C = ceil(c * T * k / E)`` of the step's (token, expert) pairs, ``T`` the tokens of the whole
batch (every rank of the batch group together), ``k`` the experts per token; an expert's pairs
are kept in the order of their tokens in the batch (a token's earlier position wins; a token
never picks one expert twice), the rest are dropped: their rows are not sent, their output rows
are zero (the layer adds nothing for them; the model's residual carries the token on). Each rank
learns how many pairs of each expert lie before its own tokens from the per-expert counts of the
batch group (one all-gather of ``E + 1`` integers) and drops its rows itself, before sending.
:func:`dropped` reads the pairs each layer dropped in its latest forward, summed over the batch.

:func:`traffic` counts the rows' bytes this rank sent to other ranks in the row exchanges
(forward and backward).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.runtime.collectives import all_gather, all_to_all_data, group, to_wire
from cube.runtime.compiled import outside_graph


_DROPPED: Dict[int, Dict[str, int]] = {}   # rank -> layer -> pairs dropped in its latest forward
_SENT: Dict[int, int] = {}                 # rank -> row bytes sent to other ranks


def _me() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def dropped(rank: Optional[int] = None) -> Dict[str, int]:
    """Capacity mode: the (token, expert) pairs each MoE layer (by module path) dropped in its
    latest forward, over the whole batch (the same number on every rank of the batch).

    Args:
        rank: whose record (default: the calling rank's).
    """
    return dict(_DROPPED.get(_me() if rank is None else rank, {}))


def traffic(rank: Optional[int] = None, reset: bool = False) -> int:
    """The bytes of token rows this rank sent to other ranks in the experts' row exchanges
    (dispatch and combine, forward and backward) since the last reset.

    Args:
        rank: whose count (default: the calling rank's).
        reset: zero the count after reading it.
    """
    r = _me() if rank is None else rank
    return _SENT.pop(r, 0) if reset else _SENT.get(r, 0)


def _exchange(x: torch.Tensor, ranks: Tuple[int, ...], sends: List[int], recvs: List[int]) -> torch.Tensor:
    """Rows ``x`` (blocks of ``sends[q]`` rows for ``ranks[q]``, in order) out; the blocks of
    ``recvs[q]`` rows from each ``ranks[q]`` back, concatenated in rank order."""
    me = ranks.index(dist.get_rank())
    grp = group(ranks)
    row = math.prod(x.shape[1:]) * x.element_size()
    _SENT[ranks[me]] = _SENT.get(ranks[me], 0) + row * (sum(sends) - sends[me])
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
        combine: int, experts: int, outputs: Sequence[int], ranks: Sequence[int] = (), first: int = 0,
        local: Optional[int] = None, capacity: Optional[float] = None, perm: Optional[int] = None,
        layer: str = "", batch: Sequence[int] = (), start: int = 0, lead: int = 1, tokens: int = 0,
        pairs: int = 1, by_id: str = ""):
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
        first, local: this rank's first expert and its number of experts (default: all of them,
            no exchange: the layer whole on one rank).
        capacity: the capacity factor (module docstring); None: dropless.
        perm: slot of the sort's indices (each sorted row's position among this rank's pairs):
            the order of arrival inside an expert's rows.
        layer: the layer's name in :func:`dropped`.
        batch: the ranks holding the batch's tokens (capacity mode), any order; ``start``: the
            first token row of this rank's block (their order in the batch).
        lead, tokens: the first ``tokens`` inputs hold the tokens along their first ``lead`` dims
            (``cube.ir.experts.unflatten``): merged into one for the program, the outputs restored.
        pairs: the rows each all-to-all carries per output row (a token's ``k`` experts): what the
            plan prices (``cube.passes.inside``); the call does not read it.
        by_id: where the layer gathers a per-expert bias by the sorted expert ids (its pieces are
            never split by experts: ``cube.ir.follow.expert_flow``); the call does not read it.
    """
    shape = inputs[0].shape[:lead] if lead > 1 else None
    if shape is not None:
        inputs = tuple(x.reshape(-1, *x.shape[lead:]) for x in inputs[:tokens]) + tuple(inputs[tokens:])
    ranks = tuple(ranks) or (_me(),)
    n = len(ranks)
    local = experts if local is None else local
    cap = None if capacity is None else (capacity, perm, layer, tuple(batch) or (_me(),), start)
    env: list = list(inputs)
    saved = None
    for k, (fn, args, kwargs, outs) in enumerate(program):
        if k == body[0]:
            saved = _dispatch(env, dispatch, offsets, ranks, n, local, experts, cap)
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
    if shape is not None:
        result = tuple(r.reshape(*shape, *r.shape[1:]) for r in result)
    return result[0] if len(result) == 1 else result


def _dispatch(env: list, dispatch: int, offsets: int, ranks: Tuple[int, ...], n: int, local: int, experts: int,
              cap: Optional[tuple] = None):
    """Sends the sorted rows to their experts' ranks; puts the received rows, grouped by local
    expert, and their offsets into the slots. Returns what ``_combine`` needs."""
    x0, offs = env[dispatch], env[offsets]
    ends = offs.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))                # rows per expert, this rank's tokens
    if counts.numel() != experts or int(ends[-1]) != x0.shape[0]:
        raise RuntimeError(f"expert parallel: the group offsets count {int(ends[-1])} of {x0.shape[0]} rows over "
                           f"{counts.numel()} groups, not every row over {experts} experts")
    kept = None
    if cap is not None:
        factor, perm, layer, batch, start = cap
        kept, counts = _capacity(counts, env[perm], factor, layer, batch, start)
    x = x0 if kept is None else x0[kept]
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
    return x0, offs, index, ranks, sends, recvs, kept


def _capacity(counts: torch.Tensor, perm: torch.Tensor, factor: float, layer: str, batch: Tuple[int, ...],
              start: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The capacity rule (module docstring) on this rank's rows, sorted by expert (``counts`` per
    expert; ``perm``: each row's position among this rank's pairs).

    Returns:
        The positions of the kept rows (ascending: still sorted by expert) and the kept rows per expert.
    """
    experts, rows = counts.numel(), perm.numel()
    mine = torch.cat([counts.new_tensor([start]), counts]).view(1, -1)
    every = all_gather(mine.to(torch.long), batch, 0)   # one rank: itself
    before = every[every[:, 0] < start, 1:].sum(0)                       # each expert's pairs on earlier tokens
    total = every[:, 1:].sum(0)
    cap = math.ceil(factor * int(total.sum()) / experts)
    _DROPPED.setdefault(_me(), {})[layer] = int((total - cap).clamp(min=0).sum())
    group = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts.to(counts.device).long())
    group = group.to(perm.device)
    order = torch.argsort(group * max(rows, 1) + perm.long())            # by expert, then by arrival
    ends = torch.cumsum(counts.long(), 0).to(perm.device)
    arrival = torch.empty_like(order)
    arrival[order] = torch.arange(rows, device=perm.device) - (ends - counts.long().to(perm.device))[group[order]]
    keep = before.to(perm.device)[group] + arrival < cap
    return torch.nonzero(keep).flatten(), torch.bincount(group[keep], minlength=experts).to(counts.dtype)


def _combine(y: torch.Tensor, saved) -> torch.Tensor:
    """The body's rows back to the ranks (and places) they came from; a dropped row is zero."""
    x0, _, index, ranks, sends, recvs, kept = saved
    back = torch.empty_like(index)
    back[index] = torch.arange(index.numel(), device=index.device)
    rows = y[back]
    rows = _Rows.apply(rows, ranks, recvs, sends) if len(ranks) > 1 else rows
    if kept is None:
        return rows
    return rows.new_zeros((x0.shape[0],) + tuple(rows.shape[1:])).index_copy(0, kept, rows)
