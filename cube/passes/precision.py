"""The dtype every value has when a main-parameter plan runs (``precision="bf16"``/``"fp16"``).

The generated forward runs under ``torch.autocast`` over low-precision weights, so a value's dtype
at run time is not its traced (float32) dtype: a projection of the residual stream is bf16, a
normalization's statistics float32, as autocast's op lists for the device decide. Values that
cross ranks point to point (pipeline stages) must travel in exactly that dtype: a wider wire
would change the receiving stage's arithmetic, a narrower one would round. This pass finds the
dtypes by running the traced ops once on fake tensors (no memory, no compute) under the same
autocast, trainable floating parameters in the low precision, as the ranks run them.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.runtime.amp import DTYPES, main_params


def device_type() -> str:
    """The device type the generated code runs on (autocast's op lists differ between CPU and CUDA)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def runtime_dtypes(graph: IRGraph, kind: str = "") -> Dict[int, torch.dtype]:
    """Logical tensor id -> its dtype at run time under the graph's main-parameter precision;
    empty for other precisions (every value has its traced dtype, or autocast's in the forward
    only). ``kind``: the device type (default: this machine's, ``device_type``)."""
    precision = getattr(graph, "precision", None)
    if not main_params(precision):
        return {}
    low = DTYPES[precision]
    kind = kind or device_type()
    out: Dict[int, torch.dtype] = {}
    seen = set()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        def dtype_of(t: IRTensor) -> torch.dtype:
            t = t.logical
            if id(t) in out:
                return out[id(t)]
            if t.kind is TensorKind.PARAM and t.requires_grad and t.dtype.is_floating_point:
                return low
            return t.dtype

        def fake(v):
            if isinstance(v, IRTensor):
                return torch.empty(tuple(v.logical.shape), dtype=dtype_of(v), device=kind)
            return v

        for piece in graph.select(ntype=IRFwOperation):
            op = piece.root
            if id(op) in seen:
                continue
            seen.add(id(op))
            try:
                args, kwargs = tree_map(fake, tuple(op.args)), tree_map(fake, dict(op.kwargs))
                with torch.autocast(kind, dtype=low):
                    result = op.target(*args, **kwargs)
            except Exception:   # an op without a fake kernel: its outputs keep the inputs' widest dtype
                floats = [dtype_of(t) for t in op.inputs if t.dtype.is_floating_point]
                for o in op.outputs:
                    if o.dtype.is_floating_point and floats:
                        wide = floats[0]
                        for d in floats[1:]:
                            wide = torch.promote_types(wide, d)
                        out[id(o.logical)] = wide if o.dtype == torch.float32 else o.dtype
                continue
            got = [r for r in tree_leaves(result) if isinstance(r, torch.Tensor)]
            if len(got) == len(op.outputs):
                for o, r in zip(op.outputs, got):
                    out[id(o.logical)] = r.dtype
    del mode
    return out
