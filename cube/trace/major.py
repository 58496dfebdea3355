"""Expert-major rows: values of ``(c, N, ...)``, the token rows behind a dim of experts.

``cube.trace.rows`` runs the ops between a merge of leading dims (``(B, S, H) -> (N, H)``, ``N =
B * S``) and the views restoring them on the unmerged dims. Llama 4's MoE layer runs every token
through every expert, the copies expert-major::

    scores = router_scores.transpose(0, 1).reshape(-1, 1)        # (N, E) -> (E, N) -> (E * N, 1)
    routed_in = hidden_states.repeat(E, 1) * scores              # (E * N, H)
    out = bmm(routed_in.view(E, -1, H), gate_up_proj) ...        # (E, N, H) @ (E, H, 2I)
    out = shared + routed_out.reshape(E, -1, H).sum(dim=0)       # (N, H)

(the trace already holds the copies as ``(E, N, ...)``: ``cube.trace.repeat``). The rows are dim 1
there, the inner factor of ``E * N``, so no split of the batch or of the sequence is a block of
those values' dim 0, and context and sequence parallel lost their split at the first of them.

On the unmerged dims such a value is ``(c, *lead, ...)``: :func:`row` says how each op runs there.
Every op computes row ``n`` of its outputs (``out[:, n]``, or ``out[n]`` for a value of one row a
token) from row ``n`` of its inputs only, so it is exact on the unmerged dims:

- ``transpose``/``permute`` of a ``(N, c)`` value into ``(c, N)`` (and back): the ``c`` dim moves
  in front of ``lead`` (or behind it);
- a view between a value of one row a token and ``(1, N, ...)``, or between two expert-major
  values of one ``c`` regrouping only the dims past the rows: a reshape to the unmerged shape (a
  row's elements stay in their row-major order);
- an elementwise op of expert-major values of its output's ndim (their dims 1 or the output's),
  values of one row a token (right-aligned, they broadcast over ``c`` as they did) and operands
  from outside broadcasting over the dims past the rows;
- ``bmm`` (or ``matmul``) of an expert-major value by a ``(c, h, m)`` weight from outside: each
  expert's rows by its matrix, the weight given ``len(lead) - 1`` dims of 1 after its expert dim
  (``matmul`` takes the last of ``lead`` as the matrices' rows, the others as batch dims);
- ``chunk`` along a dim past the rows, and ``sum``/``mean``/``amax``/``amin`` over ``c`` (dim 0:
  a token's expert rows summed) or dims past the rows.

Anything else is None: the chain stays as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch

from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor
from cube.trace import inplace

aten = torch.ops.aten
Made = Tuple[Any, str, tuple, dict]

OPS = frozenset({"transpose", "permute"})   # besides views, elementwise ops, bmm, chunk and reductions
_VIEWS = frozenset({"view", "_unsafe_view", "reshape"})
_SWAPS = frozenset({"t", "numpy_T", "transpose", "permute"})
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin"})


@dataclass(frozen=True)
class Unsqueezed:
    """A value the rewritten op reads with ``times`` new dims of 1 at ``dim`` (``cube.trace.rows``
    makes the ``unsqueeze`` ops)."""
    value: IRTensor
    dim: int
    times: int = 1


def is_major(t: IRTensor, rows: Tuple[int, ...]) -> bool:
    """Whether ``t`` is ``(c, N, ...)`` for the one-dim ``rows`` ``(N,)``, and not also readable as
    ``c`` rows per token (``(N * c, ...)``)."""
    return len(rows) == 1 and t.ndim >= 2 and t.shape[1] == rows[0] and \
        (t.shape[0] < rows[0] or t.shape[0] % rows[0] != 0)


def nd(t: IRTensor, lead: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape of an expert-major ``t`` on the unmerged dims: ``(c, *lead, ...)``."""
    return (t.shape[0],) + tuple(lead) + tuple(t.shape[2:])


def involved(op: IRFwOperation, inside, rows: Tuple[int, ...]) -> bool:
    """Whether ``op`` reads or makes an expert-major value of the chain (:func:`row` judges it)."""
    return any(is_major(t, rows) for t in op.inputs if id(t) in inside) or \
        any(is_major(o, rows) for o in op.outputs)


def _one(t: IRTensor, rows: Tuple[int, ...]) -> bool:   # one row a token: (N, ...)
    return t.ndim >= 1 and t.shape[:1] == tuple(rows) and not is_major(t, rows)


def view(op: IRFwOperation, t: IRTensor, rows: Tuple[int, ...]) -> bool:
    """Whether ``op``, a view of the chain value ``t``, goes into, out of or between expert-major
    values (module docstring): it is then an op of the chain, not a view restoring the rows."""
    if op.name not in _VIEWS or len(op.inputs) != 1 or op.inputs[0] is not t or len(op.outputs) != 1:
        return False
    o = op.outputs[0]
    if len(rows) != 1 or not (is_major(o, rows) or is_major(t, rows)):
        return False
    if is_major(o, rows) and is_major(t, rows):
        return o.shape[0] == t.shape[0]
    major, one = (o, t) if is_major(o, rows) else (t, o)
    return major.shape[0] == 1 and _one(one, rows) and math.prod(major.shape) == math.prod(one.shape)


def row(op: IRFwOperation, inside, rows: Tuple[int, ...], lead: Tuple[int, ...],
        shape: Callable[[IRTensor], Tuple[int, ...]]) -> Optional[Made]:
    """``(target, name, args, kwargs)`` of ``op`` on the unmerged dims (module docstring; chain
    values still in its arguments), or None when it is not row-wise.

    Args:
        inside: ids of the chain's values.
        rows: the rows' shape (one dim).
        lead: the unmerged dims of the rows.
        shape: the shape a chain value takes on the unmerged dims.
    """
    if len(rows) != 1 or inplace.effect(op) or not op.outputs:
        return None
    ins = [t for t in op.inputs if id(t) in inside]
    args, kwargs, name = tuple(op.args), dict(op.kwargs), op.name
    first = args[0] if args else None
    k = len(lead)
    if not ins:
        return None
    if name in _VIEWS:
        if not view(op, first, rows) or kwargs:
            return None
        return aten.reshape.default, "reshape", (first, list(shape(op.outputs[0]))), {}
    if name in OPS:
        o = op.outputs[0]
        if len(op.inputs) != 1 or first is not ins[0] or first.ndim != 2 or kwargs or not swaps(op):
            return None
        if _one(first, rows) and is_major(o, rows):    # (N, c) -> (c, N): c in front of lead
            return aten.permute.default, "permute", (first, [k] + list(range(k))), {}
        if is_major(first, rows) and _one(o, rows):    # (c, N) -> (N, c)
            return aten.permute.default, "permute", (first, list(range(1, k + 1)) + [0]), {}
        return None
    if name in ("bmm", "matmul"):
        x, w = (list(args) + [None, None])[:2]
        if len(args) != 2 or kwargs or x is not ins[0] or len(ins) != 1 or not is_major(x, rows) or \
                not isinstance(w, IRTensor) or w.ndim != 3 or w.shape[0] != x.shape[0] or x.ndim != 3:
            return None
        # (c, *lead, h) @ (c, 1, ..., 1, h, m): the matrices are a row's last dim, lead's last dim their rows
        return aten.matmul.default, "matmul", (x, Unsqueezed(w, 1, k - 1)), {}
    if name == "chunk":
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if len(op.inputs) != 1 or first is not ins[0] or not is_major(first, rows) or len(args) < 2 or \
                set(kwargs) - {"dim"} or not isinstance(dim, int) or dim % first.ndim < 2:
            return None
        return op.target, name, (first, args[1], dim if dim < 0 else dim + k - 1), {}
    if name in _REDUCTIONS:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else dims
        if len(op.inputs) != 1 or first is not ins[0] or not is_major(first, rows) or \
                not isinstance(dims, (list, tuple)) or not dims or len(args) > 3 or set(kwargs) - {"keepdim", "dtype"}:
            return None
        if any(not isinstance(d, int) or d % first.ndim == 1 for d in dims):
            return None
        new = [0 if d % first.ndim == 0 else (d if d < 0 else d + k - 1) for d in dims]
        return op.target, name, (first, new) + args[2:], kwargs
    if op_info(name).rule == "elementwise" and _elementwise(op, inside, rows):
        return op.target, name, args, kwargs
    return None


def swaps(op: IRFwOperation) -> bool:
    """Whether ``op`` (``t``, ``numpy_T``, ``transpose`` or ``permute``) swaps the two dims of a 2-D tensor."""
    if len(op.inputs) != 1 or op.inputs[0].ndim != 2 or op.name not in _SWAPS:
        return False
    if op.name == "transpose":
        return len(op.args) == 3 and {d % 2 for d in op.args[1:3] if isinstance(d, int)} == {0, 1}
    if op.name == "permute":
        return len(op.args) == 2 and isinstance(op.args[1], (list, tuple)) and [d % 2 for d in op.args[1]] == [1, 0]
    return True


def _elementwise(op: IRFwOperation, inside, rows: Tuple[int, ...]) -> bool:
    """An elementwise op making an expert-major value from chain values that line up on the unmerged
    dims, the operands from outside broadcasting over the dims past the rows only."""
    o = op.outputs[0]
    if len(op.outputs) != 1 or not is_major(o, rows):
        return False
    for t in op.inputs:
        if id(t) not in inside:
            if t.ndim > o.ndim - 2:
                return False
        elif is_major(t, rows):
            if t.ndim != o.ndim or any(a not in (1, b) for a, b in zip(t.shape, o.shape)):
                return False
        elif not (_one(t, rows) and t.ndim == o.ndim - 1 and all(a in (1, b) for a, b in zip(t.shape, o.shape[1:]))):
            return False
    return True
