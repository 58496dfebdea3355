"""Ops along the dims past the rows: the routers of MoE layers on flattened token rows.

``cube.trace.rows`` runs the ops between a merge of leading dims (``(B, S, H) -> (B*S, H)``) and
the views restoring them on the unmerged dims. An MoE router computes its routing weights and
expert ids on such rows with ops along the experts (dims past the rows): DeepSeek-V3 scores
groups of experts (``view(-1, G, E // G)``, ``topk``, ``scatter_`` into a mask, ``unsqueeze``,
``expand``, ``reshape``, ``masked_fill``, ``gather``), PhiMoE's ``sparsemixer`` samples its experts
with Gumbel noise (``max`` along the experts, ``gather``, ``scatter``, ``concat`` and draws of
``exponential`` and ``rand_like``). :func:`row` says how such an op runs on values whose dim 0 is
the rows (``c`` rows per row: ``cube.trace.rows``), each given the shape ``nd(t)`` (``(*lead, ...)``
or ``(*lead, c, ...)``); a dim argument moves by the dims added in front (a negative one stays).

Each op computes a row of its outputs from the same row of its inputs, so it is exact on the
unmerged dims:

- ``view``/``reshape``/``_unsafe_view`` keeping dim 0 (the rows) and ``expand`` keeping dim 0 and
  the number of dims: a row's elements are regrouped (or repeated) within the row, in the same
  row-major order;
- ``max``/``min``/``argmax``/``argmin`` along a dim past the rows (values and indices, with or
  without ``keepdim``) and ``topk`` along such a dim: each row is ranked alone;
- ``gather``/``scatter``/``scatter_add``/``scatter_reduce`` along a dim past the rows, the index
  (and a source tensor) chain values of the same rows: each row reads or writes its own row only;
- ``cat``/``concat`` along a dim past the rows of chain values of the same rows;
- ``zeros_like``/``ones_like``/``empty_like``/``full_like``: the shape of their input;
- an op that draws random numbers whose draw ``exact_rng`` reproduces from its shape alone
  (``cube.passes.rng``: kinds ``values``, ``bernoulli``, ``dropout``, ``native_dropout``), drawn on a
  contiguous tensor (``Draw.strides`` None) of the whole batch (``Draw.rows`` None): the CPU
  kernels fill a contiguous tensor in its memory order, and a row-major ``(B*S, E)`` tensor and a
  ``(B, S, E)`` one hold their elements in the same order, so the whole draw made in the new
  shape is the single device's numbers, each row where it was (checked bit for bit:
  tests/test_unflatten_router.py). The op keeps its ``Draw`` with the new shape (:func:`redraw`).
  Only a graph whose draws are marked (``cube.passes.rng.mark_draws``: a policy's graph, where
  ``cube.ir.experts`` fuses MoE layers) rewrites one; at trace time the draws are not marked yet
  and ``exact_rng`` finds a random op's layout by its shape in the exported program, so a chain
  with a random op stays as it is there.

Anything else (a dim argument naming the rows, an index or mask from outside the chain, a draw
laid out otherwise) is None: the chain stays as it is.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Tuple

from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor
from cube.trace import inplace

VIEWS = frozenset({"view", "reshape", "_unsafe_view"})
_ALONG = frozenset({"max", "min", "argmax", "argmin"})   # (x, dim, keepdim)
_SCATTERS = frozenset({"scatter", "scatter_add", "scatter_reduce"})   # (x, dim, index, src or value, ...)
_LIKE = frozenset({"zeros_like", "ones_like", "empty_like", "full_like"})
_CATS = frozenset({"cat", "concat"})
OPS = VIEWS | _ALONG | _SCATTERS | _LIKE | _CATS | {"expand", "topk", "gather"}
# the draws exact_rng makes from their shape, dtype and layout alone (cube.passes.rng.Draw.kind)
_DRAWN = ("values", "bernoulli", "dropout", "native_dropout")

Made = Tuple[Any, str, tuple, dict]


def rowish(op: IRFwOperation) -> bool:
    """Whether :func:`row` may find ``op`` row-wise (a first look, before the chain is known)."""
    return op.name in OPS or draws(op)


def draws(op: IRFwOperation) -> bool:
    return inplace.draws(op.target, op.args, op.kwargs)


def reshapes_row(op: IRFwOperation, x: IRTensor, rows: Tuple[int, ...]) -> bool:
    """Whether the view ``op`` of a chain value regroups only the dims past the rows (it keeps dim 0
    of a value of ``c`` rows per row) and restores none of ``x``'s leading dims (``cube.trace.rows``:
    a restoring view ends the chain)."""
    t, o = op.inputs[0], op.outputs[0]
    if len(rows) != 1 or not _rows(t, rows) or o.ndim < 1 or o.shape[0] != t.shape[0]:
        return False
    k = o.ndim - 1
    return not (k > 1 and o.shape[-1] == t.shape[-1] and tuple(x.shape[:k]) == tuple(o.shape[:-1]))


def _rows(t: IRTensor, rows: Tuple[int, ...]) -> bool:
    """Whether dim 0 of ``t`` holds ``c >= 1`` rows per row of a one-dim ``rows``."""
    return len(rows) == 1 and t.ndim >= 1 and t.shape[0] >= rows[0] and t.shape[0] % rows[0] == 0


def row(op: IRFwOperation, inside, rows: Tuple[int, ...], nd: Callable[[IRTensor], Tuple[int, ...]]
        ) -> Optional[Made]:
    """``(target, name, args, kwargs)`` of ``op`` on the unmerged dims (module docstring; chain values
    still in its arguments), or None when it is not row-wise.

    Args:
        inside: ids of the chain's values.
        rows: the rows' shape (one dim).
        nd: the shape a chain value takes on the unmerged dims.
    """
    ins = [t for t in op.inputs if id(t) in inside]
    if len(rows) != 1 or not ins or not op.outputs or any(id(t) not in inside for t in op.inputs) or \
            any(not _rows(t, rows) for t in ins + list(op.outputs)):
        return None
    args, kwargs, name = tuple(op.args), dict(op.kwargs), op.name
    first = args[0] if args else None

    def moved(t: IRTensor, d) -> Optional[int]:   # dim ``d`` of ``t`` on the unmerged dims; never the rows
        if not isinstance(d, int) or isinstance(d, bool) or not -t.ndim <= d < t.ndim or d % t.ndim == 0:
            return None
        return d if d < 0 else d + len(nd(t)) - t.ndim

    def at(i: int, key: str, default=None):
        return args[i] if len(args) > i else kwargs.get(key, default)

    def put(i: int, key: str, value) -> Made:   # the call with argument ``i`` (or ``key``) set to ``value``
        if len(args) > i:
            return op.target, name, args[:i] + (value,) + args[i + 1:], kwargs
        return op.target, name, args, dict(kwargs, **{key: value})

    if draws(op):
        return _drawn(op, first, ins)
    if name in _CATS:
        ts = at(0, "tensors")
        if not isinstance(ts, (list, tuple)) or not ts or any(not isinstance(t, IRTensor) for t in ts) or \
                len(ts) != len(op.inputs) or len({(t.ndim, t.shape[0]) for t in ts}) != 1:
            return None
        d = moved(ts[0], at(1, "dim", 0))
        return None if d is None else put(1, "dim", d)
    if not isinstance(first, IRTensor) or first is not op.inputs[0]:
        return None
    if name in _LIKE:
        if len(op.inputs) != 1 or "size" in kwargs or op.outputs[0].shape != first.shape:
            return None
        return op.target, name, args, kwargs
    if name in VIEWS or name == "expand":
        o = op.outputs[0]
        if len(op.inputs) != 1 or len(args) < 2 or o.shape[0] != first.shape[0] or \
                (name == "expand" and (o.ndim != first.ndim or set(kwargs) - {"implicit"})) or \
                (name != "expand" and (len(args) != 2 or kwargs)):
            return None
        return op.target, name, (first, list(nd(o))) + args[2:], kwargs
    if name in _ALONG:   # max(x, dim, keepdim): values and indices of each row
        if len(op.inputs) != 1 or at(1, "dim") is None:
            return None
        d = moved(first, at(1, "dim"))
        return None if d is None else put(1, "dim", d)
    if name == "topk":   # topk(x, k, dim=-1, largest, sorted)
        if len(op.inputs) != 1:
            return None
        d = moved(first, at(2, "dim", -1))
        return None if d is None else put(2, "dim", d)
    if name == "gather" or name in _SCATTERS:   # (x, dim, index, ...): each row reads/writes its own row
        if any(t.ndim != first.ndim or t.shape[0] != first.shape[0] for t in op.inputs):
            return None
        index = at(2, "index")
        if not isinstance(index, IRTensor) or index.dtype.is_floating_point:
            return None
        d = moved(first, at(1, "dim"))
        return None if d is None else put(1, "dim", d)
    return None


def _drawn(op: IRFwOperation, first, ins) -> Optional[Made]:
    """A random op of a chain value whose draw keeps its numbers on the unmerged dims (module docstring)."""
    d = getattr(op, "draw", None)
    if d is None or d.kind not in _DRAWN or d.why is not None or d.strides is not None or d.rows is not None or \
            len(op.inputs) != 1 or first is not op.inputs[0] or len(ins) != 1 or \
            any(o.shape != first.shape for o in op.outputs) or tuple(d.shape) != tuple(first.shape):
        return None
    return op.target, op.name, tuple(op.args), dict(op.kwargs)


def redraw(old: IRFwOperation, new: IRFwOperation) -> None:
    """Gives ``new`` (``old`` on the unmerged dims) ``old``'s draw, drawn in its shape (module docstring)."""
    d = getattr(old, "draw", None)
    if d is not None:
        new.draw = dataclasses.replace(d, shape=tuple(new.inputs[0].shape))
