"""``flex_attention`` on a sequence split over ranks (context parallel), as torch's context parallel
runs it.

Each rank of a split group holds one block of the sequence of the query, the key and the value
(self-attention: one layout for all three). :func:`attention` all-gathers the keys and values along
the sequence (backward: their gradients, partial sums of every rank's queries, reduce-scattered
back to their owners: ``cube.runtime.collectives.all_gather``) and runs ``cube.trace.flex``'s op on
this rank's queries against every key. The op's spec (made by ``cube.passes.inside``) says where the
block of queries starts (``q_start``): the op reads the block mask's rows for those queries and
calls the score and mask functions with global query indices.

Blocks stay contiguous, so under a causal mask the last rank's queries meet the most keys (no
zigzag load balancing, unlike ``cube.runtime.ring``); and every rank holds the whole keys and
values of one call while it runs.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from cube.runtime.collectives import all_gather


def attention(xs: List[torch.Tensor], spec: str, *, ranks: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's block of ``cube_flex::flex_attention(xs, spec)`` over the whole sequence.

    Args:
        xs: the op's tensors (``cube.trace.flex``): this rank's block of the query, key and value
            (dim -2), then the whole block mask's key/value-side tensors and the functions' captured
            tensors.
        spec: the op's spec with ``q_start``, this rank's first query.
        ranks: the ranks holding the blocks, in block order.

    Returns:
        This rank's block of the output and of the log-sum-exp.
    """
    from cube.trace import flex
    q, k, v, *rest = xs
    k, v = all_gather(k, ranks, k.dim() - 2), all_gather(v, ranks, v.dim() - 2)
    return flex.op()([q, k, v, *rest], spec)
