"""Communication between a producer's layout and a consumer's (the adapter pass).

For one value read by one logical op, given on every consumer rank

- ``src[q] = (box, term)``: what the producer left there (a full box, a
  smaller one, or a partial sum),
- ``need[q]``: the box the consumer piece reads, and
- ``contrib[q]``: the consumer piece's gradient contribution term (non-empty
  when the piece is one of several whose gradients for this value add up),

``transitions`` returns per rank the chain of steps, run in order right
before the consumer. Stages:

1. partial sums: all-reduce (V -> R) or reduce-scatter (V -> D);
2. boxes: chunk (R -> D, backward all-gathers), all-gather (D -> R), all-to-all
   (D(i) -> D(j)), or a local narrow when no other rank needs the rest;
3. gradient contributions: identity forward, all-reduce backward, so the
   producer always receives the complete gradient of its piece. When the
   all-gather of stage 2 runs over the same ranks, its backward
   (reduce-scatter) sums the contributions itself and stage 3 is dropped.

Groups are found from the boxes and terms alone: the candidates that share
what must be shared are sorted into "tiles" (one per distinct piece), and the
k-th rank of each tile forms a group, so every member finds the same group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from cube.ir.layout import Box, Term, contains, tile_dim

Ranks = Tuple[int, ...]

# Step kinds by what they do; the one place the planner, the recompute pass and the simulator read
# them from.
P2P_KINDS = ("send", "recv", "gather", "grad_to")      # move a value (or its gradient) point to point
STASH_KINDS = ("stash", "unstash")                      # hand a value to a later pipeline stage of the rank
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")   # communicate in forward
# steps a recompute run may run again in backward (collectives, and those whose backward is one)
RERUNNABLE_KINDS = COLLECTIVE_KINDS + ("chunk", "identity_all_reduce")


@dataclass(frozen=True)
class Step:
    """One communication (or local) step on a value.

    kind: ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``,
    ``chunk``, ``narrow`` (local, no group), ``identity_all_reduce``, ``detach`` (a
    parameter read whose gradient is dropped: another device keeps that copy),
    ``send`` / ``recv`` between device groups (``ranks`` = (source, destination)), or,
    for a point-to-point exchange, ``region``, ``grad_to``, ``assemble`` and ``gather`` (every
    region of a reader's box received and placed in one call; ``ranks`` = (reader,)).
    """

    kind: str
    ranks: Ranks = ()
    dim: int = -1
    dim2: int = -1             # all_to_all: the dim the input is split along
    grad: str = ""             # all_gather: "V" (backward reduce-scatters) or "R" (keeps own chunk);
                               # send/recv/region: "none" (no gradient); send: "only" (no value, only
                               # the gradient comes back: a replica of the piece another rank sent)
    box: Optional[Box] = None  # the box the value covers after this step
    tag: int = 0               # send/recv/grad_to: matches the two sides
    part: Optional[Box] = None     # send/region/narrow: the part of the input taken (relative to the input)
    parts: Tuple[Box, ...] = ()    # assemble: where each input goes in the output (relative)
    # gather: per region (src, tag, part relative to src's piece, place in the output, gradient back,
    # ((replica, tag), ...) linked for the gradient); src == ranks[0]: a local region (tag 0)
    takes: Tuple[tuple, ...] = ()

    def signature(self) -> tuple:
        return (self.kind, self.ranks, self.dim, self.dim2, self.grad, self.box, self.tag, self.part, self.parts,
                self.takes)


def narrow_step(r: int, box: Box, target: Box, d: int) -> Step:
    """The local ``narrow`` of the value holding ``box`` to ``target`` (smaller along dim ``d``
    only); ``part`` is ``target`` relative to ``box``, as the generated call takes it."""
    return Step("narrow", (r,), dim=d, box=target,
                part=tuple((s - o, e - o) for (s, e), (o, _) in zip(target, box)))


class LayoutError(ValueError):
    """No chain of primitives moves the value between the two layouts."""


def _nterms(term: Term) -> int:
    n = 1
    for _, _, _, num in term:
        n *= num
    return n


def _strip(term: Term) -> tuple:
    return tuple((lvl, f, n) for lvl, f, _, n in term)


def _pair(r: int, cands: Sequence[int], key: Callable[[int], Hashable], what: str) -> List[int]:
    tiles: Dict[Hashable, List[int]] = {}
    for q in sorted(set(cands)):
        tiles.setdefault(key(q), []).append(q)
    sizes = {len(v) for v in tiles.values()}
    if len(sizes) != 1:
        raise LayoutError(f"{what}: the pieces are held by unequal numbers of ranks "
                          f"({ {str(k): v for k, v in tiles.items()} })")
    k = tiles[key(r)].index(r)
    return [v[k] for v in tiles.values()]


class _Pairing:
    """``_pair`` for every rank of one stage, sorting each candidate set into tiles once.

    Ranks with the same ``klass`` have the same candidates, so the tiles (and each
    group) are found once per class instead of once per rank: a transition is
    linear, not quadratic, in the number of ranks.
    """

    def __init__(self):
        self.memo: Dict[Hashable, Tuple[Dict[int, int], List[List[int]], Dict[int, List[int]]]] = {}

    def __call__(self, r: int, klass: Hashable, cands: Callable[[], Sequence[int]],
                 key: Callable[[int], Hashable], what: str) -> List[int]:
        entry = self.memo.get(klass)
        if entry is None:
            tiles: Dict[Hashable, List[int]] = {}
            for q in sorted(set(cands())):
                tiles.setdefault(key(q), []).append(q)
            if len({len(v) for v in tiles.values()}) != 1:
                raise LayoutError(f"{what}: the pieces are held by unequal numbers of ranks "
                                  f"({ {str(k): v for k, v in tiles.items()} })")
            at = {q: k for v in tiles.values() for k, q in enumerate(v)}
            entry = self.memo[klass] = (at, list(tiles.values()), {})
        at, tiles, groups = entry
        k = at[r]
        if k not in groups:
            groups[k] = [v[k] for v in tiles]
        return list(groups[k])


def transitions(src: Dict[int, Tuple[Box, Term]], need: Dict[int, Box], contrib: Dict[int, Term],
                what: str = "value") -> Dict[int, List[Step]]:
    """Steps per consumer rank; see the module docstring.

    Raises:
        LayoutError: a transition no primitive chain covers (the message names it).
    """
    ranks = sorted(need)
    missing = [q for q in ranks if q not in src]
    if missing:
        raise LayoutError(f"{what} is read on ranks {missing} but made on ranks {sorted(src)}")
    steps: Dict[int, List[Step]] = {q: [] for q in ranks}
    box = {q: src[q][0] for q in ranks}
    term = {q: src[q][1] for q in ranks}

    # 1. partial sums -> full values
    strip = {q: _strip(term[q]) for q in ranks if term[q]}
    pair = _Pairing()
    for r in ranks:
        if not term[r]:
            continue
        group = pair(r, (box[r], strip[r]),
                     lambda: [q for q in ranks if box[q] == box[r] and term[q] and strip[q] == strip[r]],
                     lambda q: term[q], f"{what}: summing partial values")
        if len(group) != _nterms(term[r]):
            raise LayoutError(f"{what}: the ranks {group} hold {len(group)} of the {_nterms(term[r])} "
                              f"partial sums; put a piece of every partition on the consumer's ranks")
        steps[r].append(Step("all_reduce", tuple(group), box=box[r]))
    # reduce-scatter: an all-reduce followed by a chunk over the same ranks
    for r in ranks:
        s = steps[r]
        if len(s) == 1 and s[0].kind == "all_reduce" and contains(box[r], need[r]) and box[r] != need[r]:
            group = list(s[0].ranks)
            d = tile_dim(box[r], [need[q] for q in sorted(group, key=lambda q: need[q])])
            if d is not None and all(need[q] != need[r] or q == r for q in group):
                order = tuple(sorted(group, key=lambda q: need[q]))
                s[0] = Step("reduce_scatter", order, dim=d, box=need[r])
    for r in ranks:
        term[r] = ()
        if steps[r] and steps[r][-1].kind == "reduce_scatter":
            box[r] = need[r]

    # 2. boxes
    for _ in range(8):   # each pass fixes one dim on every rank
        todo = [r for r in ranks if box[r] != need[r]]
        if not todo:
            break
        new_box = dict(box)
        chunks, gathers = _Pairing(), _Pairing()
        for r in todo:
            b, n = box[r], need[r]
            d = next(i for i in range(len(b)) if b[i] != n[i])
            if contains(b, n):       # narrow dim d (R -> D)
                target = tuple(n[i] if i == d else b[i] for i in range(len(b)))
                parts = lambda q: tuple(need[q][i] if i == d else b[i] for i in range(len(b)))  # noqa: E731
                group = chunks(r, (b, d), lambda: [q for q in ranks if box[q] == b], parts, f"{what}: chunking")
                order = sorted(group, key=lambda q: parts(q))
                if len(group) == 1:
                    steps[r].append(narrow_step(r, b, target, d))
                elif tile_dim(b, [parts(q) for q in order]) == d:
                    steps[r].append(Step("chunk", tuple(order), dim=d, box=target))
                else:
                    raise LayoutError(f"{what}: ranks {order} hold the same piece {b} but read parts "
                                      f"{[parts(q) for q in order]} that do not split it evenly")
                new_box[r] = target
            elif contains(n, b):     # widen dim d (D -> R)
                target = tuple(n[i] if i == d else b[i] for i in range(len(b)))
                group = gathers(r, (target, d),
                                lambda: [q for q in ranks if box[q] != need[q] and
                                         tuple(need[q][i] if i == d else box[q][i] for i in range(len(b))) == target],
                                lambda q: box[q], f"{what}: gathering")
                order = sorted(group, key=lambda q: box[q])
                if tile_dim(target, [box[q] for q in order]) != d:
                    raise LayoutError(f"{what}: ranks {order} hold pieces {[box[q] for q in order]} that do "
                                      f"not make up {target}")
                steps[r].append(Step("all_gather", tuple(order), dim=d, grad="R", box=target))
                new_box[r] = target
            else:                    # D(i) -> D(j): all-to-all when the ranks swap pieces of one box
                step = _all_to_all(r, ranks, box, need, what)
                steps[r].append(step)
                new_box[r] = step.box
        box = new_box
    else:
        raise LayoutError(f"{what}: no chain of primitives reaches the consumer's layout")

    # 3. gradient contributions
    strip = {q: _strip(contrib[q]) for q in ranks if contrib[q]}
    pair = _Pairing()
    for r in ranks:
        if not contrib[r]:
            continue
        group = pair(r, (need[r], strip[r]),
                     lambda: [q for q in ranks if need[q] == need[r] and contrib[q] and strip[q] == strip[r]],
                     lambda q: contrib[q], f"{what}: summing gradient contributions")
        if len(group) != _nterms(contrib[r]):
            raise LayoutError(f"{what}: the consumer's pieces on {group} are {len(group)} of "
                              f"{_nterms(contrib[r])}; every piece must run on the value's ranks")
        last = steps[r][-1] if steps[r] else None
        if last is not None and last.kind == "all_gather" and set(last.ranks) == set(group):
            steps[r][-1] = Step("all_gather", last.ranks, dim=last.dim, grad="V", box=last.box)
        else:
            steps[r].append(Step("identity_all_reduce", tuple(sorted(group)), box=need[r]))
    return steps


def _all_to_all(r: int, ranks: Sequence[int], box: Dict[int, Box], need: Dict[int, Box], what: str) -> Step:
    b, n = box[r], need[r]
    whole = tuple((min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(b, n))
    cands = [q for q in ranks if contains(whole, box[q]) and contains(whole, need[q]) and box[q] != need[q]]
    group = _pair(r, cands, lambda q: box[q], f"{what}: exchanging pieces")
    order = sorted(group, key=lambda q: box[q])
    d_in = tile_dim(whole, [box[q] for q in order])
    by_need = sorted(group, key=lambda q: need[q])
    d_out = tile_dim(whole, [need[q] for q in by_need])
    if d_in is None or d_out is None or order != by_need or d_in == d_out:
        raise LayoutError(f"{what}: rank {r} holds {b} but reads {n}; the ranks {order} do not exchange "
                          f"even pieces of one box")
    return Step("all_to_all", tuple(order), dim=d_out, dim2=d_in, box=n)
