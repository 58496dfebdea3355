"""How an op piece is called on its local tensors.

Most pieces call the same ATen op on smaller tensors. The exceptions:

- shape arguments (``view``/``reshape``/``expand`` sizes, ``unflatten`` sizes)
  become the piece's own output shape;
- a piece whose output is a partial sum adds a bias-like input only once (the
  piece whose partial indices are all 0), so the sum of the pieces is exact;
- a mean (or mean-reduced loss) over a split dimension becomes the piece's
  sum divided by the *global* count, so the partial values add up to the
  global mean exactly: no rescaling of the loss or the gradients anywhere.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from cube.errors import CubeInternalError
from cube.ir.halo import conv_groups
from cube.ir.layout import PieceLayout, box_shape
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation

_SHAPE_ARGS = ("size", "shape")


def _schema_args(op: IRFwOperation) -> List[str]:
    return [a.name for a in op.target._schema.arguments]


def _get(op: IRFwOperation, names: List[str], name: str, default=None):
    i = names.index(name)
    if i < len(op.args):
        return op.args[i]
    return op.kwargs.get(name, default)


def _set(args: list, kwargs: dict, names: List[str], name: str, value) -> None:
    i = names.index(name)
    if i < len(args):
        args[i] = value
    else:
        kwargs[name] = value


def local_call(op: IRFwOperation, layout: PieceLayout, term_ranks: Tuple[int, ...], count=None
               ) -> Tuple[Optional[str], list, dict]:
    """``(function, args, kwargs)`` for the piece; function None means ``op.target``.

    Arguments keep ``IRTensor`` objects (the printer maps them to local names).
    ``count``: a value holding the global weight of a mean loss's valid targets,
    counted on the whole batch (else the pieces sum it over ``term_ranks``).
    """
    args, kwargs = list(op.args), dict(op.kwargs)
    info = op_info(op.name)
    if info.shape_view and len(args) == 2 and not kwargs:
        # a view's input may arrive with other strides than in the trace (received from another
        # rank, made by a collective, or by a kernel choosing another layout): reshape copies only then
        fn = "aten.reshape.default"
    else:
        fn = None
    share = getattr(op.root, "micro_share", None)
    if share is not None:   # a pipeline micro-batch's share of a mean over the global batch, split or not
        return _micro_share(op, share, count, term_ranks)
    if getattr(op.target, "_schema", None) is None or not op.splits:
        return fn, args, kwargs
    names = _schema_args(op)
    out_shapes = [box_shape(b) for b in layout.outputs]
    full = [tuple(t.shape) for t in op.outputs]
    if out_shapes and out_shapes[0] != full[0]:
        for n in _SHAPE_ARGS:
            if n in names and _get(op, names, n) is not None and not isinstance(_get(op, names, n), int):
                _set(args, kwargs, names, n, list(out_shapes[0]))
        if op.name == "unflatten":
            dim = _get(op, names, "dim") % op.inputs[0].ndim
            sizes = _get(op, names, "sizes")
            _set(args, kwargs, names, "sizes", list(out_shapes[0][dim:dim + len(sizes)]))
    groups = conv_groups(op, box_shape(layout.inputs[0]))
    if groups is not None:
        _set(args, kwargs, names, "groups", groups)
    partial = bool(layout.out_terms and layout.out_terms[0])
    if not partial:
        return fn, args, kwargs
    if layout.unread:
        if op.name == "addmm":
            return "aten.mm.default", [op.inputs[1], op.inputs[2]], {}
        bias = op.inputs[layout.unread[0]]
        args = [None if a is bias else a for a in args]
        kwargs = {k: (None if v is bias else v) for k, v in kwargs.items()}
    if op.name == "mean":
        x = op.inputs[0]
        dims = _get(op, names, "dim") if "dim" in names else None
        count = _count(x.shape, dims)
        keepdim = bool(_get(op, names, "keepdim", False)) if "keepdim" in names else False
        dtype = _get(op, names, "dtype") if "dtype" in names else None
        return "runtime.ops.mean_part", [x, dims, keepdim, count], ({"dtype": dtype} if dtype else {})
    reduction = _get(op, names, "reduction", 1) if "reduction" in names else None
    if info.counts_targets and reduction == 1:
        fn = "runtime.ops.cross_entropy_part" if op.name == "cross_entropy_loss" else "runtime.ops.nll_part"
        kw = {"weight": _get(op, names, "weight"), "ignore_index": _get(op, names, "ignore_index", -100)}
        kw.update({"count": count} if count is not None else {"ranks": tuple(term_ranks)})
        if op.name == "cross_entropy_loss":
            kw["label_smoothing"] = _get(op, names, "label_smoothing", 0.0)
        return fn, [op.inputs[0], op.inputs[1]], kw
    if info.mean_loss and reduction == 1:
        extra: Dict[str, Any] = {}
        if op.name == "smooth_l1_loss":
            extra["beta"] = _get(op, names, "beta", 1.0)
        return "runtime.ops.pointwise_loss_part", [op.name, op.inputs[0], op.inputs[1], op.inputs[0].numel()], extra
    return fn, args, kwargs


def _micro_share(op: IRFwOperation, share: tuple, count, term_ranks) -> Tuple[Optional[str], list, dict]:
    """A piece of a mean over the batch in a micro-batch graph (``cube.passes.micro``): its sum over
    the count of the *global* batch (``("mean", n)``), or over the weight of the valid targets of the
    global batch (``("targets", k)``: the value ``count``, passed in by the step), so the
    micro-batches' shares add up to the global mean whether or not the piece is also split."""
    names = _schema_args(op)
    kind, n = share[:2]
    if kind == "value":   # loss_sum / count: the count of the global batch, passed in by the step
        if count is None:
            raise CubeInternalError(f"{op.name} ({op.where()}): a micro-batch's share divided by a count "
                                    f"without the count of the global batch")
        args = list(op.args)
        args[share[2]] = count
        return None, args, dict(op.kwargs)
    if op.name == "mean":
        dims = _get(op, names, "dim") if "dim" in names else None
        keepdim = bool(_get(op, names, "keepdim", False)) if "keepdim" in names else False
        dtype = _get(op, names, "dtype") if "dtype" in names else None
        return "runtime.ops.mean_part", [op.inputs[0], dims, keepdim, n], ({"dtype": dtype} if dtype else {})
    if kind == "mean":
        extra: Dict[str, Any] = {}
        if op.name == "smooth_l1_loss":
            extra["beta"] = _get(op, names, "beta", 1.0)
        return "runtime.ops.pointwise_loss_part", [op.name, op.inputs[0], op.inputs[1], n], extra
    if count is None:
        raise CubeInternalError(f"{op.name} ({op.where()}): a micro-batch's mean loss without the count of the "
                                f"global batch's valid targets")
    fn = "runtime.ops.cross_entropy_part" if op.name == "cross_entropy_loss" else "runtime.ops.nll_part"
    kw = {"weight": _get(op, names, "weight"), "ignore_index": _get(op, names, "ignore_index", -100), "count": count}
    if op.name == "cross_entropy_loss":
        kw["label_smoothing"] = _get(op, names, "label_smoothing", 0.0)
    return fn, [op.inputs[0], op.inputs[1]], kw


def _count(shape, dims) -> int:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = range(len(shape))
    elif isinstance(dims, int):
        dims = [dims]
    n = 1
    for d in dims:
        n *= shape[d % len(shape)]
    return n
