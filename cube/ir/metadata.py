"""Metadata a sequence split computes whole: ops that compute from the batch alone (no gradient, no
parameter: torchtitan's document ids and ends, a padding mask) whose split would only be gathered
again for the ops reading them. ``cube.ir.follow.context_flow`` drops them from its split; every
rank computes them from its whole batch, as torchtitan builds its masks."""
from __future__ import annotations

from typing import TYPE_CHECKING, List, Set

from cube.ir.graph import IRGraph, makers as graph_makers, readers as graph_readers
from cube.ir.operator import IRDataOperation, IRFwOperation
from cube.ir.tensor import TensorKind

if TYPE_CHECKING:
    from cube.ir.follow import Flow


def whole_metadata(graph: IRGraph, data: IRDataOperation, flow: "Flow") -> Set[int]:
    """Ops computing metadata from the batch alone, for ops that read it whole: no gradient, no
    parameter, every input the batch (every rank holds it whole under a sequence split), a constant
    or such an op's output; and every reader of their split outputs is such an op or cannot split
    along that dim (torchtitan's document ids and ends, computed from per-token positions with
    ``cumsum``/``scatter``/``gather`` for a ``flex_attention`` mask that reads them whole). Each rank
    computes them whole from its whole batch, as torchtitan builds its masks, instead of splitting
    them and gathering their outputs for the readers (a lost split)."""
    ops = _batch_only(graph, data)
    readers = graph_readers(graph.ops)
    meta: Set[int] = set()
    for op in reversed(ops):
        split_out = False
        for t in op.outputs:
            dim = flow.tracked.get(id(t))
            if dim is None:
                continue
            split_out = True
            for r in readers.get(id(t), []):
                if id(r) in meta or not isinstance(r, IRFwOperation) or r.anno is None:
                    continue
                legal = r.algorithms("dim").legal()
                if any(x is t and (i, dim) in legal for i, x in enumerate(r.inputs)):
                    break
            else:
                continue
            break
        else:
            if split_out:
                meta.add(id(op))
    return _with_makers(ops, meta)


def _batch_only(graph: IRGraph, data: IRDataOperation) -> List[IRFwOperation]:
    """The ops computing from the batch alone (every input the batch, a constant or such an op's
    output), with no gradient and no parameter: every rank can compute them whole."""
    free = {id(t) for t in data.outputs}
    ops: List[IRFwOperation] = []
    for op in graph.ops:
        if isinstance(op, IRFwOperation) and op.outputs and \
                all(id(t) in free or t.kind is TensorKind.CONST for t in op.inputs) and \
                not any(t.requires_grad for t in op.outputs):
            ops.append(op)
            free.update(id(t) for t in op.outputs)
    return ops


def _with_makers(ops: List[IRFwOperation], chosen: Set[int]) -> Set[int]:
    """``chosen`` (ids of ``ops``) with the ops of ``ops`` making what they read: an op is dropped
    only with everything it reads from the batch."""
    makers = {id(t): op for op in ops for t in op.outputs}
    keep: Set[int] = set()
    todo = [op for op in ops if id(op) in chosen]
    while todo:
        o = todo.pop()
        if id(o) in keep:
            continue
        keep.add(id(o))
        todo.extend(makers[id(t)] for t in o.inputs if id(t) in makers)
    return keep


def lost_metadata(graph: IRGraph, data: IRDataOperation, flow: "Flow") -> Set[int]:
    """Metadata ops (``_batch_only``) whose split reaches, through ops that carry it, an op that cannot
    split along it, and nothing else does: a padding mask (batch, 1, 1, keys) added to a learned
    position bias is split along its keys, which ring attention keeps whole. Each rank computes them
    whole instead (the readers take their blocks of a whole tensor locally), as ``whole_metadata`` does
    for ops whose own readers cannot split. A split an activation brings (a path back to the batch
    through an op that is not metadata) is left to be reported lost."""
    ops = _batch_only(graph, data)
    meta = {id(op) for op in ops}
    made = graph_makers(graph.ops)
    chosen: Set[int] = set()
    for op in flow.blocked:
        if op.anno is None:
            continue
        legal = op.algorithms("dim").legal()
        bad = [t for i, t in enumerate(op.inputs) if id(t) in flow.tracked and (i, flow.tracked[id(t)]) not in legal]
        origins: Set[int] = set()
        todo, seen = list(bad), set()
        while todo:
            t = todo.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            maker = made.get(id(t))
            if maker is not None and id(maker) in meta:
                origins.add(id(maker))
            elif maker is not None and id(maker) in flow.splits:
                todo.extend(x for x in maker.inputs if id(x) in flow.tracked)
            else:   # the batch read by an op that is not metadata, or a split from elsewhere
                break
        else:
            chosen |= origins
    return _with_makers(ops, chosen) if chosen else set()
