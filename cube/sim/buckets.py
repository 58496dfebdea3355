"""Gradient buckets and ZeRO shards of a rank, formed exactly as the runtime forms them.

The reducer's buckets come from ``cube.runtime.reducer.Reducer`` itself, run on
parameters on the ``meta`` device (no memory), fed in the order the generated
module lists them (``REDUCE``, last-used parameters first), so bucket sizes
(``CUBE_BUCKET_MB``, the small first bucket) and order are the runtime's. Each
bucket with several ranks is one ZeRO shard: a flat buffer padded to a
multiple of the group size, of which every rank owns one chunk (in a folded
world, ``cube.sim.symmetry``, the group's real size: ``shards``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from cube.ir.graph import IRGraph
from cube.ir.layout import box_shape
from cube.ir.tensor import IRTensor
from cube.passes.rank_plans import RankPlan
from cube.runtime.reducer import Reducer


@dataclass(eq=False)
class Bucket:
    """One gradient bucket: its parameters (IR tensors), ranks, and sizes on this rank."""

    params: List[IRTensor]
    ranks: Tuple[int, ...]
    numel: int
    itemsize: int
    shards: int = 0   # ranks the ZeRO shard is cut over (0: len(ranks))

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def chunk(self) -> int:
        """Elements of this rank's ZeRO chunk."""
        return math.ceil(self.numel / (self.shards or len(self.ranks)))

    @property
    def padded(self) -> int:
        return self.chunk * (self.shards or len(self.ranks))


def reduce_order(graph: IRGraph, plan: RankPlan) -> List[Tuple[IRTensor, Tuple[int, ...]]]:
    """The generated module's ``REDUCE`` entries, in its order (the plan's)."""
    return list(plan.reduce)


def local_numel(plan: RankPlan) -> Dict[int, int]:
    """Parameter/buffer id -> elements of this rank's piece."""
    return {id(t): math.prod(box_shape(b)) for t, b in plan.attrs}


def make_buckets(graph: IRGraph, plan: RankPlan, group_size: Optional[Callable[[Tuple[int, ...]], int]] = None
                 ) -> List[Bucket]:
    """This rank's gradient buckets, in launch order (only those over several ranks).

    Args:
        group_size: the real size of a group of ranks, when the world is folded (ZeRO shards
            are cut over the real group; ``cube.sim.symmetry.MappedComm.group_size``).
    """
    sizes = {id(t): box_shape(b) for t, b in plan.attrs}
    entries, of = [], {}
    for t, ranks in reduce_order(graph, plan):
        p = torch.nn.Parameter(torch.empty(sizes[id(t)], dtype=t.dtype, device="meta"))
        of[id(p)] = t
        entries.append((p, tuple(ranks)))
    reducer = Reducer(entries)
    out = []
    for b in reducer.buckets:
        params = [of[id(p)] for p in b.params]
        numel = sum(p.numel() for p in b.params)
        ranks = tuple(b.ranks)
        out.append(Bucket(params, ranks, numel, b.params[0].element_size(),
                          group_size(ranks) if group_size is not None else 0))
    return out
