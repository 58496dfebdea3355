"""What a plan holds under mixed precision (``precision="bf16"``: low-precision weights, no casts of
them, float32 main parameters, gradients and AdamW state, 18 bytes per parameter; the rest of
this docstring is the autocast recipe, ``"bf16-autocast"``): the dtype each activation has when the forward runs
under ``torch.autocast``, and the low-precision copies of the weights autocast makes.

A plan compiled with ``precision="bf16"``/``"fp16"`` keeps float32 parameters, gradients and AdamW
state (``cube.runtime.amp``: 16 bytes per parameter) and runs each forward call under autocast,
which decides every op's output dtype (``OpInfo.autocast``): matrix products, convolutions and
attention compute in the low precision, normalizations, softmax, losses and reductions in float32,
every other op in the widest dtype of its float inputs. So a transformer's residual stream, made
by a float32 embedding and added to low-precision projections, stays float32, while the linear
layers' outputs are half the size. Autocast casts each float32 weight a low-precision op reads once
per forward call (its cache lives until the call returns) and autograd keeps the cast copy until
the op's backward.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from cube.ir.graph import IRGraph
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import TensorKind
from cube.runtime.amp import DTYPES, main_params


def autocast_dtypes(graph: IRGraph, precision: Optional[str]) -> Dict[int, torch.dtype]:
    """Per logical activation (by id) its dtype under ``torch.autocast`` at ``precision`` (``"bf16"``,
    ``"fp16"``); empty without one (every tensor has its traced dtype)."""
    low = DTYPES.get(precision) if precision else None
    if low is None:
        return {}
    out: Dict[int, torch.dtype] = {}
    half = main_params(precision)   # the weights themselves are low precision (float32 main parameters)

    def dtype_of(t):
        if half and t.kind is TensorKind.PARAM and t.requires_grad:
            return low
        return out.get(id(t), t.dtype)
    for op in graph.select(ntype=IRFwOperation):
        if half:
            for t in op.inputs:
                if t.kind is TensorKind.PARAM and t.requires_grad and t.dtype.is_floating_point:
                    out[id(t)] = low
        rule = op_info(op.name).autocast
        floats = [dtype_of(t) for t in op.inputs if t.dtype.is_floating_point]
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
