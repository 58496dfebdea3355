"""Dims merged for a moment, undone: a chain of views and transposes rewritten as one view and one permute.

``nn.MultiheadAttention`` (and code written like it) moves the heads out of the features through
a dim that merges the batch with the heads: ``q`` of shape ``(T, B, E)`` is viewed as
``(T, B * H, D)``, transposed to ``(B * H, T, D)`` and viewed again as ``(B, H, T, D)``. A tensor
parallel split of the heads is a strided piece of the merged dim ``B * H`` (every batch row, half
the heads), which no box of that tensor is, so the split stops there and the projections run
whole. Yet the chain as a whole only moves data: ``q.view(T, B, H, D).permute(1, 2, 0, 3)`` is
the same tensor, element for element, through dims that are never merged.

This pass, run once on the traced graph before any policy, finds each maximal chain of ``view``,
``reshape``, ``transpose`` and ``permute`` ops whose intermediate tensors only the next op of the
chain reads, and follows every dim of the chain's input through it as a product of *factors*
(a view splits a factor when a new dim boundary falls inside it). When an intermediate tensor
merges factors of two different input dims and the chain's output merges none, the chain is
replaced by a view of the input into its factors, one permute, and (when the output merges
factors of one input dim) a view to the output's shape. The output is the same ``IRTensor``, so
every reader is unchanged; the values are the model's (only the layout ops differ).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from cube.ir.graph import IRGraph, readers as graph_readers
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.trace.rules import Registry

_VIEWS = {"view", "_unsafe_view", "reshape"}
_LAYOUT = _VIEWS | {"transpose", "permute"}


class _Factors:
    """The factors of a chain's tensors: each factor's size and the input dim it comes from."""

    def __init__(self):
        self.size: List[int] = []
        self.origin: List[int] = []
        self.parts: Dict[int, List[int]] = {}   # a factor split by a view -> its two parts

    def new(self, size: int, origin: int) -> int:
        self.size.append(size)
        self.origin.append(origin)
        return len(self.size) - 1

    def leaves(self, f: int) -> List[int]:
        """``f`` as the factors it is split into now, in order."""
        if f not in self.parts:
            return [f]
        return [x for p in self.parts[f] for x in self.leaves(p)]

    def flat(self, dims: List[List[int]]) -> List[List[int]]:
        return [[x for f in d for x in self.leaves(f)] for d in dims]


def _regroup(factors: _Factors, dims: List[List[int]], shape: Tuple[int, ...]) -> Optional[List[List[int]]]:
    """The factors of a view of a tensor whose dims are ``dims`` to ``shape``, splitting a factor
    where a dim of ``shape`` ends inside it; None when no split of whole factors makes ``shape``.

    A factor of one element joins the dim after it (the one it is merged into in ``(B * H)`` with
    ``B = 1``), the last one when none follows: a batch of one sample is followed through the
    chain as a batch of several is, so both decide alike (a pipeline's micro-batches of one sample
    are traced apart from the global batch, and the two graphs must run the same ops)."""
    queue = [f for d in factors.flat(dims) for f in d]
    out: List[List[int]] = []
    for size in shape:
        group, left = [], size
        while queue and factors.size[queue[0]] == 1 and (left > 1 or not group):
            group.append(queue.pop(0))
            if left == 1:
                break
        while left > 1:
            if not queue:
                return None
            f = queue.pop(0)
            s = factors.size[f]
            if s == 1:
                group.append(f)
            elif left % s == 0:
                group.append(f)
                left //= s
            elif s % left == 0:   # the dim ends inside f: split it into (left, s // left)
                a, b = factors.new(left, factors.origin[f]), factors.new(s // left, factors.origin[f])
                factors.parts[f] = [a, b]
                group.append(a)
                queue.insert(0, b)
                left = 1
            else:
                return None
        out.append(group)
    if any(factors.size[f] != 1 for f in queue):
        return None
    if queue:
        if not out:
            return None
        out[-1].extend(queue)
    return out


def _follow(chain: List[IRFwOperation], x: IRTensor) -> Optional[Tuple[_Factors, List[List[List[int]]]]]:
    """The factors of ``x`` and of each output of ``chain`` (per tensor, per dim, its factors)."""
    factors = _Factors()
    dims = [[factors.new(s, d)] for d, s in enumerate(x.shape)]
    seen = []
    for op in chain:
        out = op.outputs[0]
        n = len(dims)
        if op.name in _VIEWS:
            dims = _regroup(factors, dims, tuple(out.shape))
            if dims is None:
                return None
        elif op.name == "transpose":
            a, b = op.args[1] % n, op.args[2] % n
            dims = list(dims)
            dims[a], dims[b] = dims[b], dims[a]
        else:   # permute
            dims = [dims[d % n] for d in op.args[1]]
        seen.append(dims)
    return factors, seen


def _cross(factors: _Factors, dims: List[List[int]]) -> bool:
    """Whether a dim merges factors of two different input dims."""
    return any(len({factors.origin[f] for f in d}) > 1 for d in factors.flat(dims))


def _chain_from(op: IRFwOperation, readers, loss) -> List[IRFwOperation]:
    chain = [op]
    while True:
        t = chain[-1].outputs[0]
        after = readers.get(id(t), [])
        if t is loss or len(after) != 1 or not _layout(after[0], t):
            return chain
        chain.append(after[0])


def _layout(op: IRFwOperation, t: IRTensor) -> bool:
    """``op`` is a view, reshape, transpose or permute of ``t`` alone."""
    if op.name not in _LAYOUT or op.inputs != [t] or len(op.outputs) != 1 or op.kwargs or \
            not op.args or op.args[0] is not t:
        return False
    if op.name == "transpose":
        return len(op.args) == 3 and all(isinstance(a, int) for a in op.args[1:])
    if op.name == "permute":
        return len(op.args) == 2 and isinstance(op.args[1], (list, tuple))
    return True


def _op(like: IRFwOperation, target, inp: IRTensor, arg, shape, registry: Registry, out=None) -> IRFwOperation:
    out = out if out is not None else IRTensor(tuple(shape), inp.dtype, inp.requires_grad, TensorKind.ACTIVATION,
                                               like.outputs[0].hint)
    op = IRFwOperation(name=target._schema.name.split("::")[-1], inputs=[inp], outputs=[out], target=target,
                       args=(inp, list(arg)), kwargs={}, module_path=like.module_path, source=like.source,
                       grad_enabled=like.grad_enabled)
    registry.annotate(op)
    return op


def _rewrite(chain: List[IRFwOperation], registry: Registry) -> Optional[List[IRFwOperation]]:
    """The view, permute and view replacing ``chain`` (module docstring), or None: left as it is."""
    x, y = chain[0].inputs[0], chain[-1].outputs[0]
    followed = _follow(chain, x)
    if followed is None:
        return None
    factors, seen = followed
    if not any(_cross(factors, d) for d in seen[:-1]) or _cross(factors, seen[-1]):
        return None
    x_dims = factors.flat([[d] for d in range(x.ndim)])
    order = [f for d in x_dims for f in d]
    final = [f for d in factors.flat(seen[-1]) for f in d]
    if sorted(order) != sorted(final):
        return None
    sizes = [factors.size[f] for f in order]
    perm = [order.index(f) for f in final]
    view = torch.ops.aten.reshape.default if any(op.name == "reshape" for op in chain) else torch.ops.aten.view.default
    ops: List[IRFwOperation] = []
    t = x
    if list(x.shape) != sizes:
        ops.append(_op(chain[0], torch.ops.aten.view.default, t, sizes, sizes, registry))
        t = ops[-1].outputs[0]
    if perm != list(range(len(perm))):
        shape = [sizes[p] for p in perm]
        last = list(y.shape) == shape
        ops.append(_op(chain[-1], torch.ops.aten.permute.default, t, perm, shape, registry, out=y if last else None))
        t = ops[-1].outputs[0]
    if t is not y:
        ops.append(_op(chain[-1], view, t, list(y.shape), y.shape, registry, out=y))
    return ops


def unmerge(graph: IRGraph, registry: Registry) -> IRGraph:
    """``graph`` with every chain of layout ops through a transient merged dim (module docstring)
    rewritten; the graph itself when there is none."""
    readers = graph_readers(graph.ops)
    replace: Dict[int, List[IRFwOperation]] = {}
    inside = set()
    for op in graph.ops:
        if id(op) in inside or not isinstance(op, IRFwOperation) or not op.inputs or \
                not _layout(op, op.inputs[0]):
            continue
        chain = _chain_from(op, readers, graph.loss)
        inside.update(id(c) for c in chain)
        if len(chain) < 2:
            continue
        new = _rewrite(chain, registry)
        if new is None:
            continue
        replace[id(chain[0])] = new
        replace.update((id(c), []) for c in chain[1:])
    if not replace:
        return graph
    return IRGraph([new for op in graph.ops for new in replace.get(id(op), [op])], graph.attrs, graph.loss,
                   graph.name)
