"""What a plan holds and computes in under mixed precision.

``precision="bf16"``/``"fp16"`` (Megatron-LM's recipe): low-precision weights, no casts of them,
float32 main parameters, gradients and AdamW state (18 bytes per parameter). The forward runs in
the weights' dtype with the float32 islands ``cube.passes.precision`` decides (losses read float32);
the simulator takes that pass's dtypes and casts, on a GPU (``run_dtypes``), so it prices the
program the ranks run. ``"fp8"`` is ``"bf16"``'s with the linear layers the pass marks run in
float8 (``run_precision``; priced by ``cube.sim.cluster.DeviceCosts``).

``"bf16-autocast"``/``"fp16-autocast"``: float32 parameters, gradients and AdamW state (16 bytes
per parameter), each forward call under autocast, which decides every op's output dtype
(``OpInfo.autocast``): matrix products, convolutions and attention compute in the low precision,
normalizations, softmax, losses and reductions in float32, every other op in the widest dtype of
its float inputs. So a transformer's residual stream, made by a float32 embedding and added to
low-precision projections, stays float32, while the linear layers' outputs are half the size.
Autocast casts each float32 weight a low-precision op reads once per forward call (its cache
lives until the call returns) and autograd keeps the cast copy until the op's backward.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from cube.ir.graph import IRGraph
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.passes.precision import low_precision
from cube.runtime.amp import DTYPES, main_params

GPU = "cuda"   # the device type the simulator prices (its float32 islands: cube.passes.precision)


def run_dtypes(graph: IRGraph, precision: Optional[str]) -> Tuple[Dict[int, torch.dtype], Optional[dict]]:
    """``(dtypes, casts)``: per value (by id) its dtype when a rank runs at ``precision``, and a
    main-parameter plan's casts (``cube.passes.precision.LowPrecision.casts``; None under autocast,
    whose casts follow each op's list, and without a precision)."""
    dtypes, casts, _ = run_precision(graph, precision)
    return dtypes, casts


def run_precision(graph: IRGraph, precision: Optional[str]) -> Tuple[Dict[int, torch.dtype], Optional[dict], dict]:
    """``run_dtypes``, and the ops a ``precision="fp8"`` plan runs in float8 (id of the traced op ->
    its output's dtype: ``cube.passes.precision.LowPrecision.float8``; empty otherwise)."""
    if main_params(precision):   # (the pass reads the graph's precision, as the ranks do)
        plan = low_precision(graph, GPU)
        return plan.dtypes, plan.casts, plan.float8
    return autocast_dtypes(graph, precision), None, {}


def autocast_dtypes(graph: IRGraph, precision: Optional[str]) -> Dict[int, torch.dtype]:
    """Per logical activation (by id) its dtype when the rank runs at ``precision``: under
    ``torch.autocast`` (``"bf16-autocast"``, ``"fp16-autocast"``), or in the weights' dtype
    (``"bf16"``, ``"fp16"``: ``run_dtypes``); empty without one (every tensor has its traced dtype)."""
    low = DTYPES.get(precision) if precision else None
    if low is None:
        return {}
    if main_params(precision):
        return run_dtypes(graph, precision)[0]
    out: Dict[int, torch.dtype] = {}
    for op in graph.select(ntype=IRFwOperation):
        rule = op_info(op.name).autocast
        floats = [out.get(id(t), t.dtype) for t in op.inputs if t.dtype.is_floating_point]
        traced = {t.dtype for t in op.inputs if t.dtype.is_floating_point}
        for t in op.outputs:
            if not t.dtype.is_floating_point:
                continue
            if rule == "low":
                out[id(t)] = low
            elif rule == "fp32":
                out[id(t)] = torch.float32
            elif rule == "cast":   # .to(dtype) / .float(): the dtype it names, else its input's
                named = [a for a in (*op.args, *op.kwargs.values()) if isinstance(a, torch.dtype)]
                out[id(t)] = named[0] if named else _widest(floats) if floats else t.dtype
            elif floats and t.dtype in traced:   # computes in its inputs' dtype (not a cast)
                out[id(t)] = _widest(floats)
    return out


def casts_weights(op) -> bool:
    """Whether autocast casts the float32 weights ``op`` reads to the low precision."""
    return op_info(op.name).autocast == "low"


def _widest(dtypes) -> torch.dtype:
    best = dtypes[0]
    for d in dtypes[1:]:
        best = torch.promote_types(best, d)
    return best
