"""Geometry of ``flex_attention`` split along its queries: which rows of a block mask a block of
queries reads.

A block mask (``torch.nn.attention.flex_attention.BlockMask``) holds, per block of ``q_block``
queries, the key blocks they attend to (``kv_num_blocks``/``kv_indices`` and their ``full_``
forms: ``(batch, heads, query blocks[, key blocks])``). A context-parallel piece holds queries
``[start, stop)`` and reads the rows of the blocks they cover; that is a block mask of its own only
where its queries are whole query blocks, or a part of one (a full block stays full for a subset of
its rows; a partial one is masked by the mask function at the global query indices). The planner
refuses other splits (``cube.ir.partition``), the runtime slices the rows (``cube.trace.flex``).
"""
from __future__ import annotations

from typing import Tuple


def aligned(length: int, q_block: int) -> bool:
    """Whether blocks of ``length`` queries map onto whole rows of a block mask with query blocks of
    ``q_block``: several whole blocks, or a part of one."""
    return length > 0 and (length % q_block == 0 or q_block % length == 0)


def rows(q_block: int, start: int, stop: int) -> Tuple[int, int]:
    """The rows ``[first, last)`` of the query blocks that queries ``[start, stop)`` cover, or ``(-1, -1)``
    where they are not whole blocks nor a part of one (blocks of ``stop - start`` that do not start at a
    multiple of their length are not a piece of an even split)."""
    length = stop - start
    if not aligned(length, q_block) or start % min(length, q_block):
        return -1, -1
    return start // q_block, -(-stop // q_block)
