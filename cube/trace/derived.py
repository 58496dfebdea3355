"""Partition rules derived from DTensor's sharding strategies, for ATen ops cube has no rule of its own for.

DTensor's sharding propagator holds, for about a thousand ATen ops, *single-dim strategies*: for
given input shapes, the ways one mesh dimension may place the op's output and inputs, each a
``Shard(d)``, ``Replicate()`` or ``Partial()`` (output first, then the tensor inputs). A strategy in
which every tensor is sharded or replicated is a dimension of cube's annotation: the dims it shards
share one letter (split together), a replicated tensor lacks the letter (read whole by every piece).
Strategies with ``Partial`` placements are left out (an input held as partial sums has no meaning in
cube's annotations; an output's would be a reduction letter, not derived here).

Every derived letter is checked against the op before it is trusted: on random inputs of the op's
own shapes (when they are small, at most ``_CHECK_ELEMENTS`` elements in all), the op run on the two
halves of the split (tensors carrying the letter cut in two, the others whole) must give the two
halves of its whole output. A letter that fails, or that cannot be checked, is dropped: that dim is
not split. An op whose strategies give no letter stays replicated, as without a rule.

Hand-written rules (``cube.trace.rules``) come first: they also express what DTensor has no
placement for (halo exchanges, ring attention, the vocabulary-parallel lookup and loss) and where
DTensor is more conservative.
"""
from __future__ import annotations

import functools
import math
from typing import Dict, List, Optional, Tuple

import torch

from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor
from cube.runtime.functions import input_grads

_CHECK_ELEMENTS = 1 << 20
_LETTERS = [f"d{i}" for i in range(64)]


def _strategies_table():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:   # a torch without DTensor
        return {}
    prop = DTensor._op_dispatcher.sharding_propagator
    return getattr(prop, "op_single_dim_strategy_funcs", {}) or {}


def _shard_dim(p) -> Optional[int]:
    """The dim a placement shards (``Shard(d)`` or a sharding placeholder), None for ``Replicate``; raises
    ``LookupError`` for anything else (``Partial``)."""
    name = type(p).__name__
    if name == "Replicate":
        return None
    if name in ("Shard", "_ShardingPlaceholder", "_StridedShard"):
        return int(p.dim)
    raise LookupError(name)


def _meta(t: IRTensor):
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    shape = torch.Size(t.shape)
    stride = tuple(torch.empty(shape, device="meta").stride())
    return TensorMeta(shape, stride, t.dtype)


def _schema(x):
    if isinstance(x, IRTensor):
        return _meta(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_schema(y) for y in x)
    return x


def derive(op: IRFwOperation) -> Optional[str]:
    """An annotation for ``op`` from DTensor's single-dim strategies, each letter checked (module
    docstring); None where DTensor has none for it or no letter survives."""
    target = op.target
    info = _strategies_table().get(target)
    if info is None or not isinstance(target, torch._ops.OpOverload) or not op.outputs:
        return None
    key = (str(target), _shapes(op), repr(_flat_constants(op.args)), repr(_flat_constants(op.kwargs)))
    return _derive_cached(key, op)


def _shapes(op) -> tuple:
    return (tuple((tuple(t.shape), str(t.dtype)) for t in op.inputs),
            tuple((tuple(t.shape), str(t.dtype)) for t in op.outputs))


def _flat_constants(x):
    if isinstance(x, IRTensor):
        return "T"
    if isinstance(x, (list, tuple)):
        return [_flat_constants(y) for y in x]
    if isinstance(x, dict):
        return {k: _flat_constants(v) for k, v in x.items()}
    return x


_CACHE: Dict[tuple, Optional[str]] = {}


def _derive_cached(key, op) -> Optional[str]:
    if key not in _CACHE:
        _CACHE[key] = _derive(op)
    return _CACHE[key]


def _derive(op: IRFwOperation) -> Optional[str]:
    target = op.target
    try:
        strategies = _strategies_table()[target].func(target, _schema(tuple(op.args)), _schema(dict(op.kwargs)))
    except Exception:   # noqa: BLE001 - a strategy that does not take this call: no derived rule
        return None
    tensors = list(op.outputs[:1]) + list(op.inputs)   # DTensor's order: the output, then the tensor inputs
    if len(op.outputs) != 1:
        return None
    groups: List[Dict[int, int]] = []   # per strategy: slot -> the dim it shards
    for placements in strategies:
        if len(placements) != len(tensors):
            continue
        try:
            dims = [_shard_dim(p) for p in placements]
        except LookupError:
            continue
        group = {slot: d for slot, d in enumerate(dims) if d is not None}
        if 0 not in group or not group:
            continue
        sizes = {tensors[slot].shape[d] for slot, d in group.items()}
        if len(sizes) != 1 or sizes == {1}:
            continue
        if group not in groups:
            groups.append(group)
    # one letter per strategy whose dims no other strategy also uses (a dim in two strategies would merge them)
    used: Dict[Tuple[int, int], int] = {}
    for g in groups:
        for slot, d in g.items():
            used[(slot, d)] = used.get((slot, d), 0) + 1
    letters: Dict[Tuple[int, int], str] = {}
    for i, g in enumerate(groups):
        if all(used[(slot, d)] == 1 for slot, d in g.items()) and _checked(op, g):
            for slot, d in g.items():
                letters[(slot, d)] = _LETTERS[i]
    return _annotation(op, letters)


def _annotation(op: IRFwOperation, letters: Dict[Tuple[int, int], str]) -> Optional[str]:
    """The annotation giving ``letters[(slot, dim)]`` (slot 0 the output, then the inputs) to those dims,
    every other dim whole; None without a letter."""
    if not letters:
        return None
    fresh = iter(f"z{i}^" for i in range(1000))

    def group(slot: int, t: IRTensor) -> str:
        return " ".join(letters.get((slot, d)) or ("1" if n == 1 else next(fresh)) for d, n in enumerate(t.shape))
    ins = [group(slot + 1, t) for slot, t in enumerate(op.inputs)]
    return ", ".join(ins) + " -> " + group(0, op.outputs[0])


def derive_function(op: IRFwOperation) -> Optional[str]:
    """An annotation for a model's own ``torch.autograd.Function`` run as one op (``cube.runtime.functions``):
    each dim of its output splits with the dims of its inputs of that size at that place (right-aligned, as
    an elementwise op broadcasts), inputs without such a dim read whole, where the pieces give the halves of
    the whole op's output in forward and of its gradients in backward (the Function's backward as written);
    every other dim whole. None where no dim splits."""
    if len(op.outputs) != 1 or not op.inputs:
        return None
    key = ("function", str(op.target), _shapes(op))
    if key not in _CACHE:
        _CACHE[key] = _derive_function(op)
    return _CACHE[key]


def _derive_function(op: IRFwOperation) -> Optional[str]:
    out = op.outputs[0]
    letters: Dict[Tuple[int, int], str] = {}
    for d, size in enumerate(out.shape):
        group = {0: d}
        for slot, t in enumerate(op.inputs, start=1):
            k = t.ndim - (out.ndim - d)
            if 0 <= k < t.ndim and t.shape[k] == size:
                group[slot] = k
        if size > 1 and _checked(op, group) and _checked_backward(op, group):
            for slot, k in group.items():
                letters[(slot, k)] = _LETTERS[d]
    return _annotation(op, letters)


def _checked_backward(op: IRFwOperation, group: Dict[int, int]) -> bool:
    """Whether the gradients of ``op``'s inputs on the two halves of the split ``group`` are the halves of
    the whole op's (an input read whole: the sum of the two halves' gradients), for a random output gradient."""
    gen = torch.Generator().manual_seed(1)
    values = [_random(t, gen) for t in op.inputs]
    grad_out = _random(op.outputs[0], gen)
    d0 = group[0]
    half = op.outputs[0].shape[d0] // 2

    try:
        whole = input_grads(op.target, values, grad_out)
        parts = []
        for h in range(2):
            pieces = [v if group.get(i + 1) is None else v.narrow(group[i + 1], h * half, half)
                      for i, v in enumerate(values)]
            parts.append(input_grads(op.target, pieces, grad_out.narrow(d0, h * half, half)))
    except Exception:   # noqa: BLE001 - a backward that refuses the pieces: the split is not trusted
        return False
    for i, w in enumerate(whole):
        a, b = parts[0][i], parts[1][i]
        if w is None or (a is None and b is None):
            if not (a is None and b is None) and w is not None:
                return False
            continue
        a = torch.zeros_like(values[i] if group.get(i + 1) is None else values[i].narrow(group[i + 1], 0, half)) \
            if a is None else a
        b = torch.zeros_like(a) if b is None else b
        joined = a + b if group.get(i + 1) is None else torch.cat([a, b], dim=group[i + 1])
        if joined.shape != w.shape or not torch.allclose(joined, w, rtol=1e-5, atol=1e-6, equal_nan=True):
            return False
    return True


def _random(t: IRTensor, gen: torch.Generator) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, dtype=t.dtype, generator=gen)
    if t.dtype == torch.bool:
        return torch.rand(t.shape, generator=gen) > 0.5
    if t.dtype.is_complex:
        return torch.randn(t.shape, dtype=t.dtype, generator=gen)
    return torch.randint(0, 3, t.shape, dtype=t.dtype, generator=gen)


def _checked(op: IRFwOperation, group: Dict[int, int]) -> bool:
    """Whether running ``op`` on the two halves of the split ``group`` gives the halves of its output."""
    if sum(math.prod(t.shape) for t in list(op.inputs) + list(op.outputs)) > _CHECK_ELEMENTS:
        return False
    size = op.outputs[0].shape[group[0]]
    if size < 2 or size % 2:
        return False
    gen = torch.Generator().manual_seed(0)
    values = {id(t): _random(t, gen) for t in op.inputs}

    def call(pick) -> torch.Tensor:
        def bind(x):
            if isinstance(x, IRTensor):
                return pick(op.inputs.index(x), values[id(x)])
            if isinstance(x, (list, tuple)):
                return type(x)(bind(y) for y in x)
            if isinstance(x, dict):
                return {k: bind(v) for k, v in x.items()}
            return x
        with torch.no_grad():
            out = op.target(*bind(list(op.args)), **bind(dict(op.kwargs)))
        return out[0] if isinstance(out, (list, tuple)) else out

    try:
        whole = call(lambda i, v: v)
        halves = []
        for half in range(2):
            def pick(i, v, half=half):
                d = group.get(i + 1)
                return v if d is None else v.narrow(d, half * (v.shape[d] // 2), v.shape[d] // 2)
            halves.append(call(pick))
        joined = torch.cat(halves, dim=group[0])
    except Exception:   # noqa: BLE001 - the op refuses the pieces: the split is not trusted
        return False
    if joined.shape != whole.shape or joined.dtype != whole.dtype:
        return False
    if whole.dtype.is_floating_point or whole.dtype.is_complex:
        return bool(torch.allclose(joined, whole, rtol=1e-5, atol=1e-6, equal_nan=True))
    return bool(torch.equal(joined, whole))


@functools.lru_cache(maxsize=None)
def covered(name: str) -> bool:
    """Whether DTensor has a single-dim strategy for an ATen op of this name (``aten::name``)."""
    return any(getattr(op, "_schema", None) is not None and op._schema.name.split("::")[-1] == name
               for op in _strategies_table())
