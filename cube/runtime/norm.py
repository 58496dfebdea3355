"""Gradient norm and clipping over every rank's pieces, each element counted once.

Ranks may hold identical pieces of a parameter (data parallel replicas, a layer
norm replicated across tensor-parallel ranks, a tied weight in two stages), and
a ZeRO optimizer holds each gradient only in the chunk its rank owns. The norm
counts every element of every full gradient exactly once: a piece held by
several ranks counts at the lowest of them, or, when its gradient is sharded
by ZeRO, in the chunks of the group that contains that rank.

Which rank counts which piece is fixed by the plan: it is learned once per
generated module and kept in its runtime state (``cube.runtime.session``).
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from cube.runtime import session


def _owners(model) -> Dict[str, int]:
    """Local parameter name -> the lowest rank holding an identical piece (collective, cached)."""
    cache = session.state_of(model).norm
    if cache.owners is None:
        mine = [(local, names[0], tuple(map(tuple, splits))) for local, (names, splits) in model.PARAMS.items()]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: List[list] = [None] * dist.get_world_size()
            dist.all_gather_object(every, [(n, s) for _, n, s in mine])
        else:
            every = [[(n, s) for _, n, s in mine]]
        lowest: Dict[Tuple, int] = {}
        for r, entries in enumerate(every):
            for piece in entries:
                lowest.setdefault(piece, r)
        cache.owners = {local: lowest[(n, s)] for local, n, s in mine}
    return cache.owners


def _mask(model, shard, owners: Dict[str, int]) -> torch.Tensor:
    """0/1 per element of this rank's chunk of ``shard``: 1 where the chunk's group counts the
    parameter (it holds the lowest rank holding that piece). Fixed by the plan, so made once."""
    masks = session.state_of(model).norm.masks
    if shard not in masks:
        local_of = {id(p): n for n, p in model.named_parameters()}
        grad = shard.param.grad
        mask = torch.zeros(shard.padded, dtype=grad.dtype, device=grad.device)
        off = 0
        for p, shape in zip(shard.bucket.params, shard.shapes):
            n = math.prod(shape)
            if owners[local_of[id(p)]] in shard.ranks:
                mask[off:off + n] = 1
            off += n
        lo = shard.index * shard.chunk
        masks[shard] = mask[lo:lo + shard.chunk]
    return masks[shard]


def _counted(model, optimizer) -> List[Tuple[torch.Tensor, Optional[torch.Tensor]]]:
    """(gradient, 0/1 weight per element or None for all) of what this rank counts."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    owners = _owners(model)
    if optimizer is None:
        optimizer = getattr(model, "_zero", None)   # a ZeRO optimizer registers itself on its model
    shards = getattr(optimizer, "shards", []) if optimizer is not None else []
    sharded = {id(p): s for s in shards for p in s.bucket.params}
    out: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
    for s in shards:
        if s.param.grad is not None:
            out.append((s.param.grad, _mask(model, s, owners)))
    for name, p in model.named_parameters():
        if id(p) in sharded or p.grad is None:
            continue
        if owners[name] == rank:
            out.append((p.grad, None))
    return out


def grad_norm(model, optimizer=None, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full model's gradient (the same value on every rank; collective)."""
    norm_type = float(norm_type)
    parts = _counted(model, optimizer)
    device = model.device
    if math.isinf(norm_type):
        local = max((g.detach().abs().max() for g, _ in parts if g.numel()), default=torch.tensor(0.0))
        total = torch.as_tensor(local, dtype=torch.float32, device=device).clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return total
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in parts:
        a = g.detach().double().abs().pow(norm_type)
        total += (a * w).sum() if w is not None else a.sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return total.pow(1.0 / norm_type).float()


@torch.no_grad()
def clip_grad_norm_(model, max_norm: float, optimizer=None, norm_type: float = 2.0) -> torch.Tensor:
    """Scales every gradient so the full model's gradient norm is at most ``max_norm``.

    The same as ``torch.nn.utils.clip_grad_norm_`` on the single-device model:
    call it on every rank after the step's backward, before ``optimizer.step()``;
    a ZeRO optimizer's chunks count too (it is found through the model; ``optimizer`` names it explicitly).

    Returns:
        The total norm before clipping.
    """
    total = grad_norm(model, optimizer, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in model.gradients():
        g.mul_(coef.to(g.device, g.dtype))
    return total
