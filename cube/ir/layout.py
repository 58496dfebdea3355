"""Layouts: which part of a logical tensor a piece holds, and whether it is a partial sum.

A piece of a tensor is a *box* (a ``(start, stop)`` interval per dimension) and
a *term*: empty for full values, else the partitions whose partial sums it is
one of (V). Replicas (R) are pieces with equal boxes and terms on several
devices; dimension splits (D) are pieces whose boxes tile a larger box.

The layout of every tensor an op piece reads or writes follows from the op's
annotation and the partitions that made the piece:

- a split of factor ``f`` narrows every dim whose head is ``f``;
- an output without ``f`` where ``f`` is a reduction (``f+``) becomes a partial
  sum: the split enters its term; where ``f`` communicates inside the call
  (``f~``) it is whole on every piece (the call made it whole);
- an input without ``f`` is read whole by every piece, so each piece's
  gradient for it is one term of a sum (the split enters its *contribution*
  term, which decides the backward communication).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from cube.errors import CubeInternalError
from cube.ir.ops import op_info
from cube.ir.operator import IRDataOperation, IROperator

Interval = Tuple[int, int]
Box = Tuple[Interval, ...]
Term = Tuple[Tuple[int, str, int, int], ...]   # (level, factor, index, num) per partial split


def full_box(shape) -> Box:
    return tuple((0, int(s)) for s in shape)


def box_shape(box: Box) -> Tuple[int, ...]:
    return tuple(e - s for s, e in box)


def narrow(iv: Interval, index: int, num: int) -> Interval:
    start, stop = iv
    step = (stop - start) // num
    if step * num != stop - start:
        raise CubeInternalError(f"interval {iv} does not split into {num} equal pieces (piece {index})")
    return start + index * step, start + (index + 1) * step


def contains(outer: Box, inner: Box) -> bool:
    return all(a <= c and d <= b for (a, b), (c, d) in zip(outer, inner))


def tile_dim(whole: Box, parts) -> int | None:
    """The one dim along which ``parts`` (in order) tile ``whole`` in equal chunks, else None."""
    if len(parts) < 2:
        return None
    diff = [d for d in range(len(whole)) if any(p[d] != whole[d] for p in parts)]
    if len(diff) != 1:
        return None
    d = diff[0]
    n = len(parts)
    want = [narrow(whole[d], i, n) for i in range(n)] if (whole[d][1] - whole[d][0]) % n == 0 else None
    if want is None or [p[d] for p in parts] != want:
        return None
    return d




@dataclass(frozen=True)
class PieceLayout:
    """The boxes and terms of one op piece's tensors (indexed like ``op.inputs`` / ``op.outputs``)."""

    inputs: Tuple[Box, ...]
    outputs: Tuple[Box, ...]
    out_terms: Tuple[Term, ...]     # partial-sum terms of each output (empty: full values)
    in_terms: Tuple[Term, ...]      # gradient contribution terms of each input (empty: complete)
    unread: Tuple[int, ...] = ()    # inputs this piece leaves out (a bias of a non-first partial sum)


def piece_layout(op: IROperator, cache: Optional[dict] = None) -> PieceLayout:
    """Computes the layout of every tensor of ``op`` (a whole op or a piece).

    Args:
        cache: a dict shared by the calls of one planning pass (its keys are
            object ids, so it must not outlive the ops). Replicas of a piece
            then share its layout, and the pieces of an op compute its full
            boxes and the dims each factor splits once.
    """
    cache = {} if cache is None else cache
    origin = op.root
    key = (id(origin), op.splits)
    layout = cache.get(key)
    if layout is None:
        layout = cache[key] = _piece_layout(op, origin, cache)
    return layout


def _factor_dims(anno, factor: str, cache: dict):
    """Per input and per output group of ``anno``: the dims whose head is ``factor``."""
    key = (id(anno), factor)
    dims = cache.get(key)
    if dims is None:
        def split(groups):
            return tuple(tuple(d for d, dim in enumerate(g) if dim.head is not None and dim.head.name == factor)
                         for g in groups)
        dims = cache[key] = (split(anno.inputs), split(anno.outputs))
    return dims


def _piece_layout(op: IROperator, origin: IROperator, cache: dict) -> PieceLayout:
    full = cache.get(id(origin))
    if full is None:
        full = cache[id(origin)] = ([full_box(t.shape) for t in op.inputs], [full_box(t.shape) for t in op.outputs])
    ins = [list(b) for b in full[0]]
    outs = [list(b) for b in full[1]]
    in_terms = [[] for _ in op.inputs]
    out_terms = [[] for _ in op.outputs]
    if isinstance(op, IRDataOperation):
        for factor, i, n in op.splits:
            d = int(factor)
            for box in outs:
                box[d] = narrow(box[d], i, n)
        return PieceLayout((), tuple(tuple(b) for b in outs), tuple(() for _ in outs), ())
    anno = getattr(op, "anno", None)
    for level, (factor, i, n) in enumerate(op.splits):
        if anno is None:
            raise CubeInternalError(f"split of an op without annotation: {op!r}")
        in_dims, out_dims = _factor_dims(anno, factor, cache)
        if op_info(op.name).inside == "experts" and anno.ident(factor).inside:
            # expert parallel (cube.ir.experts): the split of the experts gives each piece its block of
            # the group's tokens too; the all-to-all inside the call completes every value it makes
            from cube.ir.experts import TOKENS
            tin, tout = _factor_dims(anno, TOKENS, cache)
            for boxes, dims_e, dims_t in ((ins, in_dims, tin), (outs, out_dims, tout)):
                for box, de, dt in zip(boxes, dims_e, dims_t):
                    for d in de + dt:
                        box[d] = narrow(box[d], i, n)
            continue
        for boxes, split_dims, terms, is_out in ((ins, in_dims, in_terms, False), (outs, out_dims, out_terms, True)):
            for k, (box, dims) in enumerate(zip(boxes, split_dims)):
                for d in dims:
                    box[d] = narrow(box[d], i, n)
                if dims:
                    continue
                if is_out:
                    ident = anno.ident(factor)
                    if ident.inside:   # the piece's call completes it over its group
                        continue
                    if not ident.reduce:
                        raise CubeInternalError(f"output {k} of {op!r} lacks the split factor {factor!r}")
                terms[k].append((level, factor, i, n))
    unread = ()
    # a bias (``OpInfo.bias``) is added only by the first term, so the pieces sum to the exact result
    bias = op_info(op.name).bias
    if bias is not None and bias < len(op.inputs) and out_terms and out_terms[0]:
        if all(i == 0 for _, _, i, _ in out_terms[0]):
            # the one reader of the partial sums: complete over them (other splits still add up)
            in_terms[bias] = [t for t in in_terms[bias] if t not in out_terms[0]]
        else:
            unread = (bias,)
    return PieceLayout(tuple(tuple(b) for b in ins), tuple(tuple(b) for b in outs),
                       tuple(tuple(t) for t in out_terms), tuple(tuple(t) for t in in_terms), unread)
