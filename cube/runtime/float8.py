"""Float8 linear layers with dynamic tensorwise scaling (``precision="fp8"``; docs/precision.md).

The recipe is torchao's float8 training (``Float8LinearConfig``, recipe ``"tensorwise"``), which
torchtitan offers: each of a linear layer's three matrix products runs through
``torch._scaled_mm`` on float8 operands.

- forward: ``out = x @ w.T`` with the input ``x`` and the weight ``w`` cast to ``float8_e4m3fn``;
- backward: ``grad_x = grad_out @ w`` and ``grad_w = grad_out.T @ x``, ``grad_out`` cast to
  ``float8_e5m2`` (more range, less precision: gradients), ``x`` and ``w`` as in the forward.

Each operand's scale is ``fp8_max / max(amax, 1e-12)`` (computed in float64, kept in float32), its
``amax`` the largest absolute value of the whole tensor: ``q = saturate(x.float() * scale)``,
and ``_scaled_mm`` multiplies the product by the two inverse scales. Outputs come in the weights'
dtype (bf16), or float32 for a tensor-parallel partial sum reduced in float32
(``cube.compile(tp_reduce_dtype=torch.float32)``). A bias is added after the product.

When the operand is a piece of a larger tensor that one process would scale whole (a weight split
by tensor parallelism, an input split along features or sequence, the gradient of a split output),
``ranks`` names the ranks holding the other pieces of the same batch rows and the ``amax`` is the
maximum over them (one all-reduce of two numbers in forward, one in backward), so every rank
quantizes with the scale one process would use. The pieces of a data-parallel batch split (dim 0
of the input) keep their own scales, as torchao under FSDP: each batch piece is scaled alone.

Eagerly, an operand's amax and its scale-and-cast are seven kernels that move 33 bytes per element
of a bf16 operand (``abs``, ``max``, the amax's float32 cast, a float32 copy, the product by the
scale, the clamp, the 1-byte cast), more than a float8 product saves at most sizes
(``cube.sim.float8`` prices both). On a CUDA device each is therefore one ``torch.compile`` kernel (``CUBE_FP8_FUSED``, ``cube.config.fp8_fused``): the
amax reads the operand once, the cast reads it once and writes one byte, as torchao's float8 runs
under ``torch.compile``. The fused kernels compute the same float32 values and round them the same
way, so the result does not change; where ``torch.compile`` cannot build them (no Triton), the
eager kernels run and a warning says so once.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, Optional, Sequence

import torch
import torch.distributed as dist

from cube import config
from cube.runtime.collectives import group
from cube.runtime.compiled import outside_graph

E4M3 = torch.float8_e4m3fn   # input and weight
E5M2 = torch.float8_e5m2     # gradient of the output
EPS = 1e-12                  # the smallest amax a scale divides by (torchao's)
# CUDA's float8 products need both dims of a weight divisible by 16 (torchtitan's filter)
ALIGN = 16


log = logging.getLogger("cube")


def _amax(x: torch.Tensor) -> torch.Tensor:
    return x.abs().max().to(torch.float32)


def _quantizer(dtype: torch.dtype) -> Callable:
    top = torch.finfo(dtype).max

    def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x.to(torch.float32) * scale).clamp(-top, top).to(dtype)
    return quantize


_EAGER: Dict[object, Callable] = {"amax": _amax, E4M3: _quantizer(E4M3), E5M2: _quantizer(E5M2)}
_FUSED: Dict[object, Callable] = {}
_fused_failed = False
_lock = threading.Lock()


def _kernel(key, x: torch.Tensor) -> Callable:
    """The amax (``key="amax"``) or scale-and-cast (``key``: the float8 dtype) function for ``x``:
    fused by ``torch.compile`` where ``cube.config.fp8_fused`` asks for it (module docstring)."""
    mode = config.fp8_fused()
    if _fused_failed or mode == "0" or (mode == "auto" and not x.is_cuda):
        return _EAGER[key]
    with _lock:
        if key not in _FUSED:
            _FUSED[key] = torch.compile(_EAGER[key], dynamic=True, fullgraph=True)
        return _FUSED[key]


def _run(key, x: torch.Tensor, *args) -> torch.Tensor:
    global _fused_failed
    fn = _kernel(key, x)
    if fn is _EAGER[key]:
        return fn(x, *args)
    try:
        return fn(x, *args)
    except Exception as e:   # noqa: BLE001 - any failure to build the kernel: the eager one computes the same
        with _lock:
            if not _fused_failed:
                log.warning("cube.runtime.float8: torch.compile could not fuse the float8 casts (%s: %s); "
                            "running them eagerly, slower (CUBE_FP8_FUSED=0 skips the attempt)",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _fused_failed = True
        return _EAGER[key](x, *args)


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest absolute value of ``x`` (a 0-dim float32 tensor)."""
    return _run("amax", x.detach())


def global_amax(values: Sequence[torch.Tensor], ranks: Sequence[int]) -> torch.Tensor:
    """The amaxes of ``values``, each the maximum over ``ranks`` (one all-reduce) when there are several."""
    out = torch.stack([amax(v) for v in values])
    if len(ranks) > 1:
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group(tuple(ranks)))
    return out


def scale_of(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fp8_max / max(amax, EPS)`` in float64, as float32 (torchao's ``amax_to_scale``)."""
    return (torch.finfo(dtype).max / torch.clamp(a.to(torch.float64), min=EPS)).to(torch.float32)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x * scale`` in float32, saturated to ``dtype``'s range and cast to it."""
    return _run(dtype, x, scale)


def scaled_mm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor,
              out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """``(a8 / sa) @ (b8 / sb)`` by ``torch._scaled_mm``: ``a8`` row-major, ``b8`` column-major (CUDA's
    layout rule; a copy only where the operand is not). ``fast_accum``: CUDA's faster, less exact
    accumulation (torchao uses it for the forward's product only)."""
    if not a8.is_contiguous():
        a8 = a8.contiguous()
    if not b8.t().is_contiguous():
        b8 = b8.t().contiguous().t()
    return torch._scaled_mm(a8, b8, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=out_dtype,
                            use_fast_accum=fast_accum and a8.is_cuda)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, ranks, out_dtype):
        ax, aw = global_amax((x, w), ranks)
        sx, sw = scale_of(ax, E4M3), scale_of(aw, E4M3)
        x8 = quantize(x.reshape(-1, x.shape[-1]), sx, E4M3)
        w8 = quantize(w, sw, E4M3)
        out = scaled_mm(x8, sx, w8.t(), sw, out_dtype or x.dtype, fast_accum=True)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.ranks, ctx.shape, ctx.dtypes = ranks, x.shape, (x.dtype, w.dtype)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        sg = scale_of(global_amax((g,), ctx.ranks)[0], E5M2)
        g8 = quantize(g, sg, E5M2)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = scaled_mm(g8, sg, w8, sw, grad.dtype).reshape(ctx.shape)
        if ctx.needs_input_grad[1]:
            grad_w = scaled_mm(g8.t(), sg, x8, sx, ctx.dtypes[1])
        return grad_x, grad_w, None, None


@outside_graph
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
           ranks: Sequence[int] = (), out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``aten.linear`` with its three matrix products in float8 (tensorwise dynamic scaling).

    Args:
        x: the input, ``(..., in_features)``, in the weights' dtype.
        weight: ``(out_features, in_features)``.
        bias: added to the product (in the output's dtype), or None.
        ranks: the ranks whose pieces of ``x``, ``weight`` and the output's gradient are scaled
            together (the maximum of their amaxes); empty or one rank: this piece alone.
        out_dtype: the product's dtype (default: ``x``'s); float32 for a partial sum reduced in
            float32. The gradients come in the dtypes of ``x`` and ``weight``.
    """
    out = _Float8Linear.apply(x, weight, tuple(ranks), out_dtype)
    return out if bias is None else out + bias.to(out.dtype)
