"""Geometry of ring attention: which chunks of the sequence each rank of a ring holds.

A sequence split ``n`` ways is cut into ``2 n`` equal *chunks*. cube's layouts
hold contiguous blocks, so rank ``p`` of a split group holds chunks
``(2p, 2p + 1)`` (:func:`contiguous`). Under a causal mask the ring then does
unequal work: rank ``p``'s queries see ``p + 1`` blocks of keys, so the last
rank works ``n`` times as long as the first and every ring step waits for it.
The zigzag order (:func:`zigzag`: rank ``p`` holds chunks ``p`` and
``2n - 1 - p``, a head chunk and a tail chunk) gives every rank the same number
of unmasked chunk pairs. A block's chunk order is only a permutation of its
rows, so the ring op moves its inputs into zigzag order on entry and its output
back on exit (``cube.runtime.ring``); these functions say who holds what, for
the runtime, the planner (bytes moved) and the simulator.

Everything here is a pure function of ``n`` (and of the tensors' bytes).
"""
from __future__ import annotations

from typing import Dict, Tuple

Layout = Tuple[Tuple[int, ...], ...]   # per position in the ring, the chunk ids it holds, in row order


def blocks(n: int) -> Layout:
    """Rank ``p`` holds block ``p`` as one chunk (no causal mask: every pair is computed whole)."""
    return tuple((p,) for p in range(n))


def contiguous(n: int) -> Layout:
    """Rank ``p`` holds block ``p`` of ``n``: chunks ``2p`` and ``2p + 1`` of ``2n``."""
    return tuple((2 * p, 2 * p + 1) for p in range(n))


def zigzag(n: int) -> Layout:
    """Rank ``p`` holds chunk ``p`` and chunk ``2n - 1 - p`` of ``2n``: equal causal work."""
    return tuple((p, 2 * n - 1 - p) for p in range(n))


def owner(layout: Layout) -> Dict[int, Tuple[int, int]]:
    """Chunk id -> (position holding it, its index among that position's chunks)."""
    return {c: (p, i) for p, cs in enumerate(layout) for i, c in enumerate(cs)}


def moves(src: Layout, dst: Layout, pos: int) -> Tuple[Dict[int, int], Dict[int, int]]:
    """Chunks position ``pos`` sends and receives going from ``src`` to ``dst``.

    Returns:
        ``(sends, recvs)``: peer position -> number of chunks (chunks that stay are not counted).
    """
    to, frm = owner(dst), owner(src)
    sends: Dict[int, int] = {}
    recvs: Dict[int, int] = {}
    for c in src[pos]:
        q = to[c][0]
        if q != pos:
            sends[q] = sends.get(q, 0) + 1
    for c in dst[pos]:
        q = frm[c][0]
        if q != pos:
            recvs[q] = recvs.get(q, 0) + 1
    return sends, recvs


def pair(qc: int, kc: int, causal: bool) -> str:
    """How query chunk ``qc`` attends to key chunk ``kc``: ``"full"``, ``"diag"`` (the causal
    triangle: equal chunks) or ``"skip"`` (every key is in the query's future)."""
    if not causal or kc < qc:
        return "full"
    return "diag" if kc == qc else "skip"


def work(layout: Layout, pos: int, causal: bool) -> int:
    """Chunk pairs position ``pos`` computes over a whole ring pass (a diagonal counts as one)."""
    return sum(pair(a, b, causal) != "skip" for a in layout[pos] for cs in layout for b in cs)
