"""Random ops: which ops draw, in which order, and what a single device draws at each.

Every op that draws random numbers (dropout, attention with dropout, ``rand``...)
gets a ``Draw`` (``op.draw``) when the model is traced: its index among the
step's draws in the single-device (trace) order, and the shape the single
device draws at. Generated code calls each random piece through
``cube.runtime.rng.call`` with that index and the piece's box in the full
tensor; the runtime decides the numbers (see ``cube.runtime.rng`` for both
modes and the seed derivation):

- default: every piece draws from a generator seeded from (the user's seed,
  the step, the op's index, the micro-batch, the piece's box), so replicas of
  a tensor (same box) draw the same mask and the pieces of a split tensor
  (data-parallel ranks: pieces along the batch) draw independent ones;
- ``exact_rng=True``: every rank draws the *whole* mask of each op in the
  single device's order from the state the single device's generator has at
  that op, and keeps its piece, so any plan draws the single device's numbers.

Exact mode reproduces a draw only where cube knows the op's draw: ``dropout``,
``native_dropout`` and ``scaled_dot_product_attention`` with dropout (its mask
is what ``dropout`` draws on the attention weights, on CPU); anything else is
refused when planning (``check_exact``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation
from cube.trace import inplace

_SDPA = "scaled_dot_product_attention"


@dataclass(frozen=True)
class Draw:
    """One op's draw in a step of the single device.

    Attributes:
        index: position among the step's draws in trace (single-device) order.
        kind: how exact mode reproduces it: ``"dropout"``, ``"native_dropout"``, ``"sdpa"`` (the
            dropout ``dropout`` draws on the attention weights), or None (cannot).
        shape: the shape drawn for the global batch (the mask's shape).
        dtype: the dtype drawn in.
        p: the dropout probability.
        rows: in a pipeline plan's micro-batch graph, the micro-batch's rows of dim 0 when the
            mask's dim 0 is the batch (micro-batch ``k`` takes rows ``[k rows, (k+1) rows)`` of the
            global mask); None when the draw does not depend on the batch (every micro-batch takes
            the whole mask) or outside pipelines.
        why: why exact mode cannot reproduce it (None: it can).
        strides: the strides of a dropout's input on the single device when not contiguous: the
            op draws its mask in the input's memory order (``empty_like``), so the whole mask is
            drawn on a tensor of ones laid out alike (None: contiguous).
    """

    index: int
    kind: Optional[str]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    p: float = 0.0
    rows: Optional[int] = None
    why: Optional[str] = None
    strides: Optional[Tuple[int, ...]] = None


def _arg(op: IRFwOperation, name: str, default=None):
    names = [a.name for a in op.target._schema.arguments]
    if name not in names:
        return default
    i = names.index(name)
    return op.args[i] if i < len(op.args) else op.kwargs.get(name, default)


def draws(op) -> bool:
    """Whether ``op`` draws random numbers when it runs (``cube.trace.inplace.draws``)."""
    return isinstance(op, IRFwOperation) and inplace.draws(op.target, op.args, op.kwargs)


def _reproduce(op: IRFwOperation) -> Tuple[Optional[str], Tuple[int, ...], torch.dtype, float, Optional[str]]:
    """(kind, shape, dtype, p, why) of a random op's draw (``Draw``)."""
    out = op.outputs[0] if op.outputs else None
    if op.name in ("dropout", "native_dropout"):
        x = op.inputs[0]
        return op.name, tuple(x.shape), x.dtype, float(_arg(op, "p")), None
    if op.name == _SDPA:
        q, k = op.inputs[0], op.inputs[1]
        shape = tuple(torch.broadcast_shapes(tuple(q.shape[:-2]), tuple(k.shape[:-2]))) + (q.shape[-2], k.shape[-2])
        why = "grouped-query attention (enable_gqa) repeats keys inside the op" if _arg(op, "enable_gqa") else None
        return "sdpa", shape, q.dtype, float(_arg(op, "dropout_p")), why
    shape = tuple(out.shape) if out is not None else ()
    dtype = out.dtype if out is not None else torch.float32
    if op.name == "rand" and op.target == torch.ops.aten.rand.default and out is not None and \
            dtype.is_floating_point:   # uniform numbers of the output's shape (timm's and HF's drop path)
        return "rand", shape, dtype, 0.0, None
    return None, shape, dtype, 0.0, (f"cube reproduces the draws of dropout, native_dropout, "
                                     f"scaled_dot_product_attention's dropout and rand only, not of {op.name!r}")


def mark_draws(graph: IRGraph, full: Optional[IRGraph] = None, nmicros: int = 1,
               program: Optional[torch.fx.GraphModule] = None) -> List[IRFwOperation]:
    """Sets ``op.draw`` on every random op of a freshly traced ``graph``; returns them in order.

    Args:
        program: the exported program ``graph`` was built from: the layout of each dropout's
            input (``Draw.strides``), which the IR does not keep.
        full: for a graph traced on one micro-batch of a pipeline step, the graph traced on the
            global batch (the same ops in the same order, ``cube.passes.micro``): draws take its
            shapes, so every micro-batch reads its rows of the global batch's mask.
        nmicros: the micro-batches the global batch is cut into.
    """
    ops = [op for op in graph.ops if draws(op)]
    fops = [op for op in full.ops if draws(op)] if full is not None else ops
    if len(fops) != len(ops):   # micro_shares checked that both traces run the same ops
        raise CubeInternalError(f"{len(fops)} random ops on the global batch, {len(ops)} on a micro-batch")
    layouts = _input_strides(ops, program) if program is not None else {}
    for i, (op, fop) in enumerate(zip(ops, fops)):
        kind, shape, dtype, p, why = _reproduce(fop)
        strides = fop.draw.strides if full is not None else layouts.get(id(op))
        if kind in ("dropout", "native_dropout") and full is None and id(op) not in layouts and why is None:
            why = "cube could not find the layout of its input in the exported program"
        rows = None
        if full is not None and why is None:
            micro_shape = _reproduce(op)[1]
            if tuple(micro_shape) != tuple(shape):
                if micro_shape[1:] == shape[1:] and micro_shape[0] * nmicros == shape[0]:
                    rows = micro_shape[0]
                else:
                    why = (f"its mask has shape {list(shape)} on the global batch and {list(micro_shape)} on a "
                           f"micro-batch: cube takes a micro-batch's part of a mask only along dim 0")
        op.draw = Draw(i, kind, tuple(shape), dtype, p, rows, why, strides)
    return ops


def _input_strides(ops: List[IRFwOperation], program: torch.fx.GraphModule) -> dict:
    """``id(op) -> strides`` (None: contiguous) of the input of each dropout in ``ops``, read from the
    exported program's values: the n-th op of a target is the program's n-th call of it."""
    calls: dict = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in (torch.ops.aten.dropout.default,
                                                           torch.ops.aten.native_dropout.default) and \
                inplace.draws(node.target, node.args, node.kwargs):   # as the graph's random ops (``draws``)
            calls.setdefault(node.target, []).append(node)
    seen: dict = {}
    out = {}
    for op in ops:
        if op.name not in ("dropout", "native_dropout"):
            continue
        k = seen[op.target] = seen.get(op.target, -1) + 1
        nodes = calls.get(op.target, [])
        val = nodes[k].args[0].meta.get("val") if k < len(nodes) and nodes[k].args else None
        if len(nodes) != sum(1 for o in ops if o.target == op.target) or not isinstance(val, torch.Tensor):
            continue   # no such node, or not one per op: unknown (exact mode refuses it)
        if tuple(_int(s) for s in val.shape) != tuple(op.inputs[0].shape):
            continue
        out[id(op)] = None if val.is_contiguous() else tuple(_int(s) for s in val.stride())
    return out


def _int(s) -> int:
    try:
        return int(s)
    except Exception:   # noqa: BLE001 - a symbolic size (a dynamic batch dim): its traced value
        return int(s.node.hint)


def graph_draws(graph: IRGraph) -> List[Draw]:
    """The draws of a (placed) graph, in the single device's order."""
    seen = {}
    for op in graph.ops:
        d = getattr(op.root, "draw", None) if isinstance(op, IRFwOperation) else None
        if d is not None:
            seen[d.index] = d
    if sorted(seen) != list(range(len(seen))):
        raise CubeInternalError(f"the placed graph holds draws {sorted(seen)}, not every draw of the trace")
    return [seen[i] for i in range(len(seen))]


def check_exact(graph: IRGraph) -> None:
    """Refuses a plan whose random numbers ``exact_rng`` cannot make equal to the single device's.

    Raises:
        ValueError: naming each random op cube cannot reproduce, its model line and why.
    """
    if getattr(graph, "precision", None):
        if graph_draws(graph):
            raise ValueError(f"exact_rng=True with precision={graph.precision!r}: cube reproduces the single "
                             f"device's draws in float32 only so far; train without exact_rng, or in float32")
    bad, seen = [], set()
    for op in graph.ops:
        d = getattr(op.root, "draw", None) if isinstance(op, IRFwOperation) else None
        if d is not None and d.why and d.index not in seen:
            seen.add(d.index)
            bad.append(f"  op {op.name!r} ({op.root.where()}): {d.why}")
    if bad:
        raise ValueError("exact_rng=True: cube cannot draw the single device's random numbers for these ops:\n"
                         + "\n".join(bad) + "\nTurn their randomness off (p=0), or compile without exact_rng "
                         "(replicas share a mask, pieces draw independent ones).")
