"""In-place writes made functional.

ATen training IR keeps the model's in-place ops (``x[:, 1:] = y`` is a ``slice``
view of ``x`` and a ``copy_`` into it). cube's IR is functional: an op makes new
tensors and the ops that read ``x`` later must see the write. So the builder
turns each in-place write into its functional op and writes the result back
through the views it went through (``slice_scatter``, ``select_scatter``, a
reshape or transpose back), up to the tensor that owns the memory; every later
read of that tensor or of one of its views reads the new value. Splitting those
ops then splits the write with the tensor written into.

Writes into parameters, buffers and constants stay in place: they change the
model's state, which must outlive the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten

# views whose result is the same elements as their input (shape aside)
_IDENTITY = {"alias", "detach", "to", "contiguous", "lift_fresh"}
_RESHAPES = {"view", "_unsafe_view", "reshape", "flatten", "unflatten", "unsqueeze", "squeeze",
             "view_as", "reshape_as", "expand"}
_SLICES = {"split", "split_with_sizes", "chunk", "tensor_split"}


@dataclass
class View:
    """A traced value that shares memory with an earlier one.

    Attributes:
        parent: the fx node it is a view of (for an item, the multi-output view).
        root: the fx node that owns the memory (not a view itself).
        node: the fx node that made it (None for an identity alias).
        index: for an item of a multi-output view (``split``, ``unbind``), its position.
        version: the root's version its value was computed from.
    """

    parent: torch.fx.Node
    root: torch.fx.Node
    node: Optional[torch.fx.Node]
    index: Optional[int]
    version: int


def _storage(val):
    if isinstance(val, (list, tuple)):
        val = val[0] if val else None
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (NotImplementedError, RuntimeError):   # tensors without storage (sparse, nested)
        return None


def is_view(node: torch.fx.Node) -> bool:
    """Whether ``node``'s result may share memory with its first argument (by its schema)
    and does in the trace (the fake values share a storage)."""
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is None or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return False
    first = schema.arguments[0].alias_info if schema.arguments else None
    if first is None or first.is_write:
        return False
    a, b = _storage(node.args[0].meta.get("val")), _storage(node.meta.get("val"))
    return a is not None and a == b


def written(target) -> List[int]:
    """Positions of the arguments an op writes into (``Tensor(a!)``)."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return []
    return [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]


def effect(op) -> bool:
    """Whether IR op ``op`` does more than make its outputs: writes a tensor, or draws random
    numbers (dropping or reshaping it would change the draws)."""
    target = op.target
    if not op.outputs or not isinstance(target, torch._ops.OpOverload) or written(target):
        return True
    tags = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags or any(w in op.name for w in ("dropout", "rand", "bernoulli"))


def draws(target, args, kwargs) -> bool:
    """Whether a call of ``target`` on ``args`` and ``kwargs`` (an IR op's or an exported program's
    node's, laid out by the op's schema) draws random numbers: an op with a dropout probability
    (dropout, attention, RNNs) when it is above 0 in training, else an op torch tags
    ``nondeterministic_seeded`` (``rand``, ``bernoulli``, ...)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    names = [a.name for a in target._schema.arguments]

    def arg(name: str, default=None):
        i = names.index(name)
        return args[i] if i < len(args) else kwargs.get(name, default)
    for prob in ("p", "dropout_p", "dropout"):
        if prob in names and (prob != "p" or "train" in names):   # ``p`` alone may be a norm's order
            train = arg("train", None) if "train" in names else None
            return (train is None or bool(train)) and float(arg(prob, 0.0) or 0.0) > 0
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def functional(target) -> Optional[Any]:
    """The out-of-place op of an in-place one: ``aten.add_.Tensor`` -> ``aten.add.Tensor``."""
    schema = target._schema
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or schema.name.split("::")[0] != "aten":
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, schema.overload_name or "default", None)


def _arg(node: torch.fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def scatter(view: torch.fx.Node, index: Optional[int], base_shape: Tuple[int, ...],
            out_shapes: List[Tuple[int, ...]]) -> Optional[Tuple[Any, list]]:
    """How to write a new value of ``view`` (item ``index`` of it) back into its input.

    Returns ``(target, args)`` where the args hold ``"base"`` and ``"src"`` for the
    input's current value and the view's new one, or None when cube cannot write
    back through this view. ``out_shapes``: the view's result shapes.
    """
    name = view.target._schema.name.split("::")[-1]
    ndim = len(base_shape)
    if name == "slice":
        return aten.slice_scatter.default, ["base", "src", _arg(view, 1, "dim", 0), _arg(view, 2, "start"),
                                            _arg(view, 3, "end"), _arg(view, 4, "step", 1)]
    if name == "select":
        return aten.select_scatter.default, ["base", "src", _arg(view, 1, "dim"), _arg(view, 2, "index")]
    if name == "narrow":
        start = _arg(view, 2, "start")
        return aten.slice_scatter.default, ["base", "src", _arg(view, 1, "dim"), start,
                                            start + _arg(view, 3, "length"), 1]
    if name == "unbind" and index is not None:
        return aten.select_scatter.default, ["base", "src", _arg(view, 1, "dim", 0), index]
    if name in _SLICES and index is not None:
        dim = _arg(view, 2, "dim", 0) % ndim
        start = sum(s[dim] for s in out_shapes[:index])
        return aten.slice_scatter.default, ["base", "src", dim, start, start + out_shapes[index][dim], 1]
    if index is not None:
        return None
    if name in _IDENTITY and tuple(out_shapes[0]) == tuple(base_shape):
        return "same", ["src"]
    if name in _RESHAPES and name != "expand":
        return aten.reshape.default, ["src", list(base_shape)]
    if name == "expand" and tuple(out_shapes[0]) == tuple(base_shape):
        return "same", ["src"]
    if name in ("transpose", "swapaxes"):
        return aten.transpose.int, ["src", _arg(view, 1, "dim0"), _arg(view, 2, "dim1")]
    if name in ("t", "numpy_T"):
        return aten.permute.default, ["src", list(range(ndim))[::-1]]
    if name == "permute":
        dims = [d % ndim for d in _arg(view, 1, "dims")]
        return aten.permute.default, ["src", sorted(range(ndim), key=lambda k: dims[k])]
    return None
