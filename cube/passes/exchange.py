"""Any layout to any layout: point-to-point exchange of box intersections.

When no chain of collectives moves a value from its producer's layout to its
consumer's (other device order, other group, other group size, uneven
replication across pipeline stages), every reader builds the box it reads from
the pieces that hold it:

- for each partial-sum term of the producer, the reader's box is covered by
  disjoint regions, each inside one producer piece of that term (its own piece
  first, else a replica chosen round-robin so senders share the load); each
  region is sliced locally or sent by its holder; the reader places the regions
  and sums the terms (``assemble``);
- the gradient of a region goes back to the piece it came from (the adjoint of
  the slice and the send). Readers whose gradients are copies of each other
  (replicas of one consumer piece: same box, same contribution term) send it
  once: only the first of them; the others read without a gradient. Replicas
  of the producer piece that were not chosen as a region's source receive the
  region's gradient too (``grad_to`` on the reader, a gradient-only send on the
  replica), since each replica needs the complete gradient of its piece.

So every producer piece receives, for every region of its box, the sum of the
gradients of the distinct consumer pieces reading it: exactly once each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from cube.errors import CubeInternalError  # noqa: F401  (raised here, and importable from here)
from cube.ir.layout import Box, Term, box_shape
from cube.passes.adapter import LayoutError


@dataclass(frozen=True)
class Take:
    """One region a reader takes from one producer piece.

    Attributes:
        src: the rank holding the piece (the reader itself: a local slice).
        region: the region, in the logical tensor's coordinates.
        part: the region relative to the source piece's box.
        tag: matches the send and the receive (0 when local).
        grad: "" when the region's gradient goes back to ``src``, "none" otherwise.
        also: ``(rank, tag, part)`` of the other replicas of the source piece,
            which receive the region's gradient too.
    """

    src: int
    region: Box
    part: Box
    tag: int
    grad: str
    also: Tuple[Tuple[int, int, Box], ...] = ()


def intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(s < e for s, e in out) else None


def relative(inner: Box, outer: Box) -> Box:
    """``inner`` in the coordinates of ``outer`` (which contains it)."""
    return tuple((s - o, e - o) for (s, e), (o, _) in zip(inner, outer))


def subtract(box: Box, cut: Box) -> List[Box]:
    """``box`` minus ``cut`` (which lies inside it) as disjoint boxes."""
    out, rest = [], list(box)
    for d, ((s, e), (cs, ce)) in enumerate(zip(box, cut)):
        if s < cs:
            out.append(tuple(rest[:d]) + ((s, cs),) + tuple(rest[d + 1:]))
        if ce < e:
            out.append(tuple(rest[:d]) + ((ce, e),) + tuple(rest[d + 1:]))
        rest[d] = (cs, ce)
    return out


def exchange(where: Dict[int, Tuple[Box, Term]], need: Dict[int, Box], contrib: Dict[int, Term],
             grad: bool, tag: Callable[[int, int, Box], int], what: str = "value") -> Dict[int, List[Take]]:
    """The regions each reader takes, per partial-sum term (see the module docstring).

    Args:
        where: rank -> (box, term) of each producer piece.
        need: reader rank -> the box it reads.
        contrib: reader rank -> its gradient contribution term.
        grad: whether the value needs a gradient.
        tag: ``(src, dst, region) -> tag`` for a transfer (called once per transfer).

    Returns:
        reader rank -> its takes, those of each term in the order of the terms.

    Raises:
        LayoutError: a reader's box is not covered by the producer's pieces of some term.
    """
    holders: Dict[Tuple[Box, Term], List[int]] = {}
    for q in sorted(where):
        holders.setdefault(where[q], []).append(q)
    terms = sorted({term for _, term in holders})
    readers: Dict[Tuple[Box, Term], List[int]] = {}
    for r in sorted(need):
        readers.setdefault((need[r], contrib.get(r, ())), []).append(r)
    first = {rs[0] for rs in readers.values()}
    out: Dict[int, List[Take]] = {}
    for n, r in enumerate(sorted(need)):
        sends_grad = grad and r in first
        takes: List[Take] = []
        for term in terms:
            # the reader's own pieces first, then the others in a fixed order
            pieces = sorted((k for k in holders if k[1] == term), key=lambda k: (r not in holders[k], k[0]))
            todo = [need[r]]
            for box, _ in pieces:
                reps = holders[(box, term)]
                src = r if r in reps else reps[n % len(reps)]
                left = []
                for region in todo:
                    cut = intersect(region, box)
                    if cut is None:
                        left.append(region)
                        continue
                    left += subtract(region, cut)
                    also = tuple((q, tag(q, r, cut), relative(cut, box)) for q in reps
                                 if q != src) if sends_grad else ()
                    takes.append(Take(src, cut, relative(cut, box), 0 if src == r else tag(src, r, cut),
                                      "" if sends_grad else "none", also))
                todo = left
                if not todo:
                    break
            if todo:
                raise LayoutError(f"{what}: no piece{' of partial sum ' + str(term) if term else ''} holds "
                                  f"{todo[0]} of what rank {r} reads ({need[r]}); the producer's pieces are "
                                  f"{ {q: where[q][0] for q in sorted(where)} }")
        out[r] = takes
    return out


def check(where: Dict[int, Tuple[Box, Term]], need: Dict[int, Box], contrib: Dict[int, Term], grad: bool,
          takes: Dict[int, List[Take]], what: str = "value") -> None:
    """Proves an exchange right, independently of how it was planned.

    Forward: for every partial-sum term, each reader's regions of that term tile
    its box, each inside the piece it names. Backward: every producer piece gets,
    for every reader class (readers of the same box with the same contribution
    term are one class: replicas), the gradient of its overlap with that class's
    box exactly once, counting returns (a region's gradient sent back to its
    source) and gradient-only links.

    Raises:
        CubeInternalError: a region read twice or not at all, or a gradient counted
            other than once.
    """
    def cells(box: Box) -> int:
        return math.prod(box_shape(box))   # a scalar's box () holds one cell

    terms = sorted({term for _, term in where.values()})
    for r, mine in takes.items():
        for term in terms:
            regions = [k.region for k in mine if where[k.src][1] == term]
            if sum(cells(b) for b in regions) != cells(need[r]) or any(
                    intersect(a, b) is not None for i, a in enumerate(regions) for b in regions[i + 1:]):
                raise CubeInternalError(f"{what}: rank {r}'s regions {regions} of term {term} do not tile {need[r]}")
            for k in mine:
                if where[k.src][1] == term and intersect(k.region, where[k.src][0]) != k.region:
                    raise CubeInternalError(f"{what}: rank {r} takes {k.region} from rank {k.src}, which holds "
                                            f"{where[k.src][0]}")
    if not grad:
        return
    received: Dict[Tuple[int, Tuple[Box, Term]], int] = {}   # (producer rank, reader class) -> cells
    for r, mine in takes.items():
        klass = (need[r], contrib.get(r, ()))
        for k in mine:
            back = [k.src] if k.grad != "none" else []
            for q in back + [q for q, _, _ in k.also]:
                received[(q, klass)] = received.get((q, klass), 0) + cells(k.region)
    classes = {(need[r], contrib.get(r, ())) for r in need}
    for q, (box, _) in where.items():
        for klass in classes:
            cut = intersect(box, klass[0])
            want = 0 if cut is None else cells(cut)
            if received.get((q, klass), 0) != want:
                raise CubeInternalError(f"{what}: rank {q}'s piece {box} gets {received.get((q, klass), 0)} "
                                        f"gradient cells from the readers of {klass[0]} (contribution "
                                        f"{klass[1]}), not {want}: a gradient counted other than once")
