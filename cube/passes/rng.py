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

Exact mode reproduces a draw only where cube knows the op's draw (``_reproduce``):

- ``dropout``, ``native_dropout`` and ``scaled_dot_product_attention`` with dropout (its mask is
  what ``dropout`` draws on the attention weights, on CPU): the mask, drawn on ones laid out as
  the op's input;
- the ops whose output depends only on their input's shape, dtype and layout, not on its values
  (``VALUES``: ``exponential``, ``uniform``, ``normal_``, ``bernoulli`` of a float ``p``,
  ``random``, ``rand_like``, ``randn_like``, ``randint_like``, ``geometric``, ``log_normal``,
  ``cauchy``; the functional forms of ``x.exponential_()``... that tracing produces): the op
  itself on an empty tensor of the output's shape, dtype and layout gives the whole output;
- ``bernoulli`` of a tensor of probabilities: the CPU kernel draws one uniform number per
  element in memory order and keeps ``u < p``, so the whole draw is ``uniform`` on an empty
  tensor laid out alike (float64 for float64 probabilities, else float32) and a piece computes
  ``u < p`` on its own probabilities;
- the creation ops ``rand``, ``randn`` and ``randint`` (``CREATION``): the op with its arguments.

Anything else (``normal`` of a tensor of means, ``multinomial``, an op given its own generator)
is refused when planning (``check_exact``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor
from cube.trace import inplace

_SDPA = "scaled_dot_product_attention"
aten = torch.ops.aten

# random ops whose output depends only on their first input's shape, dtype and layout: the op called on an
# empty tensor of the full shape draws the single device's whole output (checked bit for bit on CPU:
# tests/test_random_draws.py)
VALUES = frozenset(getattr(getattr(aten, packet), overload) for packet, overload in (
    ("exponential", "default"), ("uniform", "default"), ("normal_", "default"), ("normal_functional", "default"),
    ("bernoulli_", "float"), ("bernoulli", "p"), ("random", "default"), ("random", "to"), ("random", "from"),
    ("rand_like", "default"), ("randn_like", "default"), ("randint_like", "default"), ("randint_like", "low_dtype"),
    ("geometric", "default"), ("log_normal", "default"), ("cauchy", "default"))
    if hasattr(getattr(aten, packet, None), overload))
# random creation ops: their arguments (the full shape's) say everything they draw
CREATION = frozenset({aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low})
# the arguments of a random op that set only where and how its output is stored, not what it draws
_STORAGE = ("dtype", "layout", "device", "pin_memory", "memory_format")


@dataclass(frozen=True)
class Draw:
    """One op's draw in a step of the single device.

    Attributes:
        index: position among the step's draws in trace (single-device) order.
        kind: how exact mode reproduces it: ``"dropout"``, ``"native_dropout"``, ``"sdpa"`` (the
            dropout ``dropout`` draws on the attention weights), ``"values"`` (an op of ``VALUES``:
            its output drawn whole), ``"bernoulli"`` (of a tensor of probabilities: the uniform
            numbers it compares them with), ``"rand"`` (a creation op of ``CREATION``), or None (cannot).
        shape: the shape drawn for the global batch (the mask's shape; the output's for the other kinds).
        dtype: the dtype drawn in (the output's for the other kinds).
        p: the dropout probability.
        rows: in a pipeline plan's micro-batch graph, the micro-batch's rows of dim 0 when the
            mask's dim 0 is the batch (micro-batch ``k`` takes rows ``[k rows, (k+1) rows)`` of the
            global mask); None when the draw does not depend on the batch (every micro-batch takes
            the whole mask) or outside pipelines.
        why: why exact mode cannot reproduce it (None: it can).
        strides: the strides of a dropout's input, or of the output of a ``"values"`` or
            ``"bernoulli"`` draw, on the single device when not contiguous: the op draws in that
            tensor's memory order (``empty_like``), so the whole draw is made on a tensor laid out
            alike (None: contiguous).
        call: ``"values"`` and ``"rand"``: ``(op, ((name, value), ...))``, the ATen op and its
            arguments by name but the input and those that only say how the output is stored
            (``dtype``, ``device``...; the full graph's: a creation op's size is the global
            batch's); None otherwise.
    """

    index: int
    kind: Optional[str]
    shape: Tuple[int, ...]
    dtype: torch.dtype
    p: float = 0.0
    rows: Optional[int] = None
    why: Optional[str] = None
    strides: Optional[Tuple[int, ...]] = None
    call: Optional[Tuple[object, tuple]] = None


def _arg(op: IRFwOperation, name: str, default=None):
    names = [a.name for a in op.target._schema.arguments]
    if name not in names:
        return default
    i = names.index(name)
    return op.args[i] if i < len(op.args) else op.kwargs.get(name, default)


def _named(op: IRFwOperation) -> dict:
    """The op's arguments by their schema names, in the schema's order (those given)."""
    names = [a.name for a in op.target._schema.arguments]
    given = dict(zip(names, op.args), **op.kwargs)
    return {n: given[n] for n in names if n in given}


def draws(op) -> bool:
    """Whether ``op`` draws random numbers when it runs (``cube.trace.inplace.draws``)."""
    return isinstance(op, IRFwOperation) and inplace.draws(op.target, op.args, op.kwargs)


def _reproduce(op: IRFwOperation) -> Tuple[Optional[str], Tuple[int, ...], torch.dtype, float, Optional[str],
                                            Optional[Tuple[object, tuple]]]:
    """(kind, shape, dtype, p, why, call) of a random op's draw (``Draw``)."""
    out = op.outputs[0] if op.outputs else None
    if op.name in ("dropout", "native_dropout"):
        x = op.inputs[0]
        return op.name, tuple(x.shape), x.dtype, float(_arg(op, "p")), None, None
    if op.name == _SDPA:
        q, k = op.inputs[0], op.inputs[1]
        shape = tuple(torch.broadcast_shapes(tuple(q.shape[:-2]), tuple(k.shape[:-2]))) + (q.shape[-2], k.shape[-2])
        why = "grouped-query attention (enable_gqa) repeats keys inside the op" if _arg(op, "enable_gqa") else None
        return "sdpa", shape, q.dtype, float(_arg(op, "dropout_p")), why, None
    shape = tuple(out.shape) if out is not None else ()
    dtype = out.dtype if out is not None else torch.float32
    kind, why, call = None, None, None
    if out is None or len(op.outputs) != 1:
        why = "it makes no single tensor"
    elif _arg(op, "generator") is not None:
        why = "it draws from a generator of its own, not the default one"
    elif op.target in VALUES or op.target in CREATION:
        kind = "values" if op.target in VALUES else "rand"
        named = _named(op)
        if kind == "values" and (len(op.inputs) != 1 or not op.args or op.args[0] is not op.inputs[0]):
            why = "cube finds no single input tensor as its first argument"
        named = {n: v for n, v in list(named.items())[1 if kind == "values" else 0:]
                 if n not in _STORAGE and n != "generator"}
        if any(isinstance(v, IRTensor) for v in named.values()):
            why = why or "an argument besides its input is a tensor (its draw depends on its values)"
        call = None if why else (op.target, tuple(named.items()))
        kind = None if why else kind
    elif op.target == aten.bernoulli.default:
        kind = "bernoulli"
        if op.inputs[0].dtype not in (torch.float32, torch.float64):
            kind, why = None, f"its probabilities are {op.inputs[0].dtype}, not float32 or float64"
    else:
        why = (f"cube reproduces the draws of dropout, native_dropout, scaled_dot_product_attention's dropout, "
               f"the ops whose numbers depend only on their input's shape (exponential, uniform, normal_, "
               f"bernoulli, random, rand_like, randn_like, ...) and rand, randn, randint only, not of "
               f"{op.name!r} ({op.target})")
    return kind, shape, dtype, 0.0, why, call


def mark_draws(graph: IRGraph, full: Optional[IRGraph] = None, nmicros: int = 1,
               program: Optional[torch.fx.GraphModule] = None) -> List[IRFwOperation]:
    """Sets ``op.draw`` on every random op of a freshly traced ``graph``; returns them in order.

    Args:
        program: the exported program ``graph`` was built from: the layout of the tensor each
            random op draws in the memory order of (``Draw.strides``), which the IR does not keep.
        full: for a graph traced on one micro-batch of a pipeline step, the graph traced on the
            global batch (the same ops in the same order, ``cube.passes.micro``): draws take its
            shapes, so every micro-batch reads its rows of the global batch's mask.
        nmicros: the micro-batches the global batch is cut into.
    """
    ops = [op for op in graph.ops if draws(op)]
    fops = [op for op in full.ops if draws(op)] if full is not None else ops
    if len(fops) != len(ops):   # micro_shares checked that both traces run the same ops
        raise CubeInternalError(f"{len(fops)} random ops on the global batch, {len(ops)} on a micro-batch")
    layouts = _layouts(ops, program) if program is not None else {}
    for i, (op, fop) in enumerate(zip(ops, fops)):
        kind, shape, dtype, p, why, call = _reproduce(fop)
        strides = fop.draw.strides if full is not None else layouts.get(id(op))
        if kind in _LAID_OUT and full is None and id(op) not in layouts and why is None:
            why = "cube could not find the layout of the tensor it draws on in the exported program"
        rows = None
        if full is not None and why is None:
            micro_shape = _reproduce(op)[1]
            if tuple(micro_shape) != tuple(shape):
                if micro_shape[1:] == shape[1:] and micro_shape[0] * nmicros == shape[0]:
                    rows = micro_shape[0]
                else:
                    why = (f"its mask has shape {list(shape)} on the global batch and {list(micro_shape)} on a "
                           f"micro-batch: cube takes a micro-batch's part of a mask only along dim 0")
        op.draw = Draw(i, kind, tuple(shape), dtype, p, rows, why, strides, call)
    return ops


# the kinds drawn in the memory order of a tensor (``Draw.strides``): a dropout's input, the others' output
_LAID_OUT = ("dropout", "native_dropout", "values", "bernoulli")


def _key(target):
    """An op and its in-place form alike (the graph makes ``exponential_`` functional: ``exponential``)."""
    return (inplace.functional(target) if isinstance(target, torch._ops.OpOverload) else None) or target


def _layouts(ops: List[IRFwOperation], program: torch.fx.GraphModule) -> dict:
    """``id(op) -> strides`` (None: contiguous) of the tensor each random op of ``ops`` draws in the memory
    order of (a dropout's input, the output of the others), read from the exported program's values: the
    n-th op of a target (or of its in-place form) is the program's n-th call of it."""
    keys = {_key(op.target) for op in ops}
    calls: dict = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and _key(node.target) in keys and \
                inplace.draws(node.target, node.args, node.kwargs):   # as the graph's random ops (``draws``)
            calls.setdefault(_key(node.target), []).append(node)
    seen: dict = {}
    out = {}
    for op in ops:
        key = _key(op.target)
        k = seen[key] = seen.get(key, -1) + 1
        nodes = calls.get(key, [])
        if len(nodes) != sum(1 for o in ops if _key(o.target) == key) or k >= len(nodes):
            continue   # not one node per op: unknown (exact mode refuses it)
        if op.name in ("dropout", "native_dropout"):
            val, like = (nodes[k].args[0].meta.get("val") if nodes[k].args else None), op.inputs[0]
        else:
            val, like = nodes[k].meta.get("val"), op.outputs[0] if op.outputs else None
        if isinstance(val, (list, tuple)):
            val = val[0] if val else None
        if not isinstance(val, torch.Tensor) or like is None or \
                not _merge_of(tuple(_int(s) for s in val.shape), tuple(like.shape), val.is_contiguous()):
            continue
        out[id(op)] = None if val.is_contiguous() else tuple(_int(s) for s in val.stride())
    return out


def _merge_of(traced: Tuple[int, ...], shape: Tuple[int, ...], contiguous: bool) -> bool:
    """Whether a draw on ``shape`` is the one the exported program makes on ``traced``: the same shape,
    or, contiguous, ``shape`` with its leading dims merged into one (``(B*H, S, S)`` for ``(B, H, S,
    S)``: ``cube.trace.heads`` and ``cube.trace.rows`` give merged dims back), whose draw fills the
    same memory order with the same numbers."""
    if traced == shape:
        return True
    return contiguous and any(traced == (math.prod(shape[:k]),) + shape[k:] for k in range(2, len(shape)))


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
