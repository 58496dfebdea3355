"""How a main-parameter plan (``precision="bf16"``/``"fp16"``) computes: in the weights' dtype,
without ``torch.autocast``, with float32 where the numbers need it.

Megatron-LM's recipe runs the model itself in the low precision: every op computes in the dtype
of its inputs, so the residual stream, a norm's output and attention's probabilities are bf16,
and the kernels keep their statistics in float32 inside (a layer norm's mean and variance, a
softmax's maximum and sum, attention's online softmax), as Megatron-LM's fused kernels do. The
float32 islands this pass adds on top are an op row's ``half`` (``cube.ir.ops``):

- losses read their float inputs widened to float32 (Megatron-LM's ``logits.float()`` before the
  cross entropy): the loss, and the log-probabilities behind it, in float32;
- ``log_softmax`` on the CPU reads float32 and rounds its output back to its input's dtype (the
  CPU kernel rounds an intermediate to bf16; CUDA's computes in float32);
- an op of autocast's low list (matrix products, convolutions, attention) reads every float input
  in the low precision (a float32 buffer, batch value or widened result meets a bf16 weight), as
  do norms whose input and weights differ and any other op that refuses its inputs' mixed dtypes;
- batch norm reads its weight and bias in float32 beside its float32 running statistics (the
  kernels' mixed mode; the statistics are buffers it updates in place, so they cannot be cast).

The pass runs the traced ops once on fake tensors (no memory, no compute) with these casts, the
trainable floating parameters in the low precision, and records each value's dtype. The
generated code prints the casts (``cube.codegen.emit``), point-to-point messages travel in the
recorded dtypes (a wider wire would change the receiving stage's arithmetic, a narrower one would
round), and the simulator prices exactly this program (``cube.sim.precision``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from cube.ir.graph import IRGraph
from cube.ir.layout import piece_layout
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.passes.float8 import float8_ops
from cube.runtime.amp import DTYPES, main_params


def device_type() -> str:
    """The device type the generated code runs on (the CPU's kernels need one more float32 island)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class LowPrecision:
    """What the forward of a main-parameter plan computes in.

    Attributes:
        dtypes: value id (a logical tensor's, and each of its pieces') -> its dtype at run time.
        casts: id of a traced op (``op.root``) -> {id of a logical input: the dtype it is cast to
            before the op reads it}.
        out_casts: id of a traced op -> the dtype its (single) output is cast to.
        float8: id of a traced op whose products run in float8 (``precision="fp8"``,
            ``cube.passes.float8``) -> the dtype of its output (bf16; float32 when it is a partial
            sum reduced in float32).
    """

    dtypes: Dict[int, torch.dtype] = field(default_factory=dict)
    casts: Dict[int, Dict[int, torch.dtype]] = field(default_factory=dict)
    out_casts: Dict[int, torch.dtype] = field(default_factory=dict)
    float8: Dict[int, torch.dtype] = field(default_factory=dict)


def low_precision(graph: IRGraph, kind: str = "") -> LowPrecision:
    """The casts and run-time dtypes of ``graph``'s forward under its main-parameter precision;
    empty for other precisions (every value has its traced dtype, or autocast's in the forward
    only). ``kind``: the device type (default: this machine's, ``device_type``)."""
    precision = getattr(graph, "precision", None)
    plan = LowPrecision()
    if not main_params(precision):
        return plan
    low = DTYPES[precision]
    kind = kind or device_type()
    out = plan.dtypes
    seen = set()
    fp8 = float8_ops(graph)
    wide = getattr(graph, "tp_reduce_dtype", None)
    partial = partial_products(graph) if wide is not None else set()
    widened = set()   # logical values made wide (partial sums reduced in ``wide``): read back in ``low``

    def dtype_of(t: IRTensor) -> torch.dtype:
        t = t.logical
        if id(t) in out:
            return out[id(t)]
        return low if low_weight(t) else t.dtype

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def run(op, casts):
            def fake(v):
                if isinstance(v, IRTensor):
                    dtype = casts.get(id(v.logical), dtype_of(v))
                    return torch.empty(tuple(v.logical.shape), dtype=dtype, device="cpu")
                return v
            args, kwargs = tree_map(fake, tuple(op.args)), tree_map(fake, dict(op.kwargs))
            return op.target(*args, **kwargs)

        for piece in graph.select(ntype=IRFwOperation):
            op = piece.root
            if id(op) in seen:
                continue
            seen.add(id(op))
            info = op_info(op.name)
            floats = [t.logical for t in op.inputs if t.dtype.is_floating_point]
            casts: Dict[int, torch.dtype] = {}
            out_cast = None
            if id(op) in partial:   # a partial product leaves in ``wide``: its inputs in ``wide``, or for a
                reads = low if id(op) in fp8 else wide   # float8 product (float32 out_dtype) in ``low``
                casts = {id(t): reads for t in floats if dtype_of(t) != reads}
            elif info.half == "fp32" or (info.half == "fp32_cpu" and kind == "cpu"):
                casts = {id(t): torch.float32 for t in floats if dtype_of(t) != torch.float32}
                if info.half == "fp32_cpu" and casts:   # its output back in its input's dtype
                    out_cast = dtype_of(floats[0])
            elif info.autocast == "low" or (info.half == "same" and len({dtype_of(t) for t in floats}) > 1):
                casts = {id(t): low for t in floats if dtype_of(t) != low}
            elif info.half == "stats":   # weight and bias beside float32 running statistics
                casts = {id(a.logical): torch.float32 for a in op.args[1:3]
                         if isinstance(a, IRTensor) and dtype_of(a) != torch.float32}
            if id(op) not in partial:   # a sum reduced in ``wide`` is rounded once, where it is read
                casts.update({id(t): low for t in floats if id(t) in widened})
            try:
                result = run(op, casts)
            except Exception:   # mixed dtypes an op refuses: every float input in the low precision
                casts = {id(t): low for t in floats if dtype_of(t) != low}
                try:
                    result = run(op, casts)
                except Exception:   # an op without a fake kernel: its outputs keep the inputs' widest dtype
                    result = None
            if casts:
                plan.casts[id(op)] = casts
            if result is None:
                wide = [casts.get(id(t), dtype_of(t)) for t in floats]
                for o in op.outputs:
                    if o.dtype.is_floating_point and wide and o.dtype == torch.float32:
                        out[id(o.logical)] = _widest(wide)
                continue
            got = [r for r in tree_leaves(result) if isinstance(r, torch.Tensor)]
            if len(got) == len(op.outputs):
                for o, r in zip(op.outputs, got):
                    out[id(o.logical)] = r.dtype
            if id(op) in fp8:
                plan.float8[id(op)] = low
            if id(op) in partial:
                for o in op.outputs:
                    out[id(o.logical)] = wide
                    widened.add(id(o.logical))
                if id(op) in fp8:
                    plan.float8[id(op)] = wide
            if out_cast is not None and len(op.outputs) == 1 and out.get(id(op.outputs[0].logical)) != out_cast:
                plan.out_casts[id(op)] = out_cast
                out[id(op.outputs[0].logical)] = out_cast
    del mode
    for piece in graph.select(ntype=IRFwOperation):   # the pieces' values: their logical tensor's dtype
        for t in (*piece.inputs, *piece.outputs):
            if t.part_of is not None and id(t.part_of) in out:
                out[id(t)] = out[id(t.part_of)]
    return plan


def low_weight(t: IRTensor) -> bool:
    """Whether a main-parameter plan holds ``t`` in its low precision: a trainable floating parameter
    (its float32 values are the optimizer's main parameter)."""
    t = t.logical
    return t.kind is TensorKind.PARAM and t.requires_grad and t.dtype.is_floating_point


def partial_products(graph: IRGraph) -> set:
    """Ids of the traced matrix products (autocast's low list) a piece of which makes a partial sum
    (tensor parallel: its reduction split over ranks) and whose readers take a low-precision input:
    under ``cube.compile(tp_reduce_dtype=torch.float32)`` these compute in float32, are summed over
    ranks in float32 and rounded to the low precision once, where they are read. A product read by
    a float32 island (a loss) keeps its low-precision sum: the island would widen the rounded value
    again, a second cast the generated code does not print."""
    cache: dict = {}
    found = set()
    for piece in graph.select(ntype=IRFwOperation):
        lay = piece_layout(piece, cache)
        if op_info(piece.root.name).autocast == "low" and lay.out_terms and lay.out_terms[0]:
            found.add(id(piece.root))
    if not found:
        return found
    outputs = {id(o.logical): id(piece.root) for piece in graph.select(ntype=IRFwOperation)
               if id(piece.root) in found for o in piece.root.outputs}
    for piece in graph.select(ntype=IRFwOperation):
        if op_info(piece.root.name).half in ("fp32", "fp32_cpu", "stats"):
            for t in piece.root.inputs:
                found.discard(outputs.get(id(t.logical)))
    return found


def runtime_dtypes(graph: IRGraph, kind: str = "") -> Dict[int, torch.dtype]:
    """Value id -> its dtype at run time under the graph's main-parameter precision (``low_precision``)."""
    return low_precision(graph, kind).dtypes


def _widest(dtypes) -> torch.dtype:
    best = dtypes[0]
    for d in dtypes[1:]:
        best = torch.promote_types(best, d)
    return best
