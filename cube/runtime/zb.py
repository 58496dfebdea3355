"""Split backward for zero-bubble pipelines: input gradients now (B), weight gradients later (W).

Under a schedule that splits backward (``cube.schedule.sched_zb_h1``,
``sched_zbv``), the generated code calls :func:`linear` instead of
``aten.linear`` (and :func:`matmul`, :func:`addmm` instead of ``aten.mm``,
``aten.matmul``, ``aten.addmm``) for a product whose weight is a parameter of
this rank.
Its backward computes the input's gradient at once, the gradient the previous
stage waits for, and, while a B action runs (:func:`collecting`), leaves the
weight and bias gradients as work in the collecting list: the layer's saved
input and output gradient. The pipeline runs that work in the action's W
(:func:`apply`), where the rank would otherwise wait for its neighbours. What a
W computes is what autograd would have: ``grad_out^T @ input`` (or its transpose) in the forward's
compute dtype (autocast's, when it ran under autocast), cast to the weight's
dtype and accumulated into ``.grad`` through autograd (so gradient hooks and
tied weights behave as in one backward).

Outside a B action (no schedule, a forward called on its own) the backward
computes every gradient at once, like ``aten.linear``.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd import Function

from cube.runtime import session
from cube.runtime.compiled import outside_graph

# (input, output gradient, weight or None, bias or None, the forward's compute dtype, weight is (out, in))
Work = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.dtype, bool]


class _Deferred(Function):
    """``out = x @ w^T (+ b)`` (``transposed``: ``w`` is ``(out, in)``, as ``aten.linear``'s) or
    ``x @ w (+ b)`` (``w`` is ``(in, out)``: ``mm``, ``matmul``, ``addmm``)."""

    @staticmethod
    def forward(ctx, x, w, b, st, transposed):
        if transposed:
            out = F.linear(x, w, b)
        else:
            out = x @ w if b is None else torch.addmm(b, x, w) if x.ndim == 2 else x @ w + b
        ctx.st, ctx.w, ctx.b, ctx.dtype, ctx.transposed = st, w, b, out.dtype, transposed
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        w, b, dtype, transposed = ctx.w, ctx.b, ctx.dtype, ctx.transposed
        gx = None
        if ctx.needs_input_grad[0]:
            wd = w.to(dtype)
            gx = (g @ (wd if transposed else wd.t())).to(x.dtype)
        wants = (w if ctx.needs_input_grad[1] else None, b if b is not None and ctx.needs_input_grad[2] else None)
        if wants == (None, None):
            return gx, None, None, None, None
        work = (x, g, wants[0], wants[1], dtype, transposed)
        sink = ctx.st.wgrads.sink
        if sink is not None and all(t is None or t.is_leaf for t in wants):
            sink.append(work)
            return gx, None, None, None, None
        gw, gb = _weight_grads(work)
        return gx, gw, gb, None, None


def _weight_grads(work: Work) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    x, g, w, b, dtype, transposed = work
    g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1]).to(dtype)
    gw = None
    if w is not None:
        gw = (g2.t() @ x2 if transposed else x2.t() @ g2).to(w.dtype)
    gb = g2.sum(0).to(b.dtype) if b is not None else None
    return gw, gb


def _wants_grad(*params) -> bool:
    return torch.is_grad_enabled() and any(p is not None and p.requires_grad for p in params)


def _split(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    """The product on detached weights, so autograd's own (C++) backward computes only the input's
    gradient, and a hook on the output that hands the weights' work to the collecting B action.

    A Python autograd function costs about as much per call as a small layer's products on CPU;
    the hook is one Python call per layer in backward. Where autograd would not reach the hook (an
    input needing no gradient) or the weights are not leaves, ``_Deferred`` does it all."""
    wants = (w if w.requires_grad else None, b if b is not None and b.requires_grad else None)
    if not x.requires_grad or not all(t is None or t.is_leaf for t in wants):
        return _Deferred.apply(x, w, b, session.current(), transposed)
    wd, bd = w.detach(), b.detach() if b is not None else None
    if transposed:
        out = F.linear(x, wd, bd)
    else:
        out = x @ wd if bd is None else torch.addmm(bd, x, wd) if x.ndim == 2 else x @ wd + bd
    st, dtype = session.current(), out.dtype

    def hand_over(g: torch.Tensor) -> None:
        work = (x, g, wants[0], wants[1], dtype, transposed)
        if st.wgrads.sink is not None:
            st.wgrads.sink.append(work)
        else:   # not inside a B action: accumulate at once, as autograd would
            apply([work])

    out.register_hook(hand_over)
    return out


def _untransposed(w: torch.Tensor) -> Optional[torch.Tensor]:
    """The 2-D leaf parameter ``w`` is the transpose of (``param.t()``: a view of it), or None."""
    base = w._base
    if w.ndim != 2 or base is None or not base.is_leaf or base.ndim != 2 or w.shape != base.shape[::-1] or \
            w.stride() != base.stride()[::-1] or w.storage_offset() != base.storage_offset():
        return None
    return base


@outside_graph
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``aten.linear`` whose weight gradient a B action defers to its W (see the module docstring).
    A weight that is the transpose of a parameter (Hugging Face's ``Conv1D`` weight ``(in, out)``,
    run as ``linear(x, w.t(), b)`` on ``(batch, sequence)`` rows by ``cube.trace.rows``) defers the
    parameter's own gradient: ``x @ w + b``."""
    if not _wants_grad(weight, bias):
        return F.linear(x, weight, bias)
    base = _untransposed(weight)
    if base is not None:
        return _split(x, base, bias, False)
    return _split(x, weight, bias, True)


@outside_graph
def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` (``aten.mm``/``aten.matmul`` with a 2-D weight ``(in, out)``), weight gradient deferred."""
    if not _wants_grad(weight) or weight.ndim != 2:
        return x @ weight
    return _split(x, weight, None, False)


@outside_graph
def addmm(bias: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """``aten.addmm`` (Hugging Face's ``Conv1D``: ``bias + x @ weight``), weight and bias gradients deferred."""
    if beta != 1 or alpha != 1 or not _wants_grad(weight, bias):
        return torch.addmm(bias, x, weight, beta=beta, alpha=alpha)
    return _split(x, weight, bias, False)


class collecting:
    """While open, the linear backwards of this program leave their weight gradients in ``work``."""

    def __init__(self):
        self.work: List[Work] = []
        self._state = session.current().wgrads

    def __enter__(self) -> List[Work]:
        self._before, self._state.sink = self._state.sink, self.work
        return self.work

    def __exit__(self, *exc) -> None:
        self._state.sink = self._before


def apply(work: List[Work]) -> None:
    """Computes the deferred weight gradients and accumulates them into ``.grad``.

    A parameter with post-accumulate hooks gets its gradient through autograd (one call for all of
    them, so the hooks fire as in one backward); the others directly, which lets a parameter
    without a gradient yet take the new tensor instead of a copy (autograd copies a gradient the
    caller still holds)."""
    hooked, grads = [], []
    for item in work:
        gw, gb = _weight_grads(item)
        for p, grad in ((item[2], gw), (item[3], gb)):
            if p is None:
                continue
            if getattr(p, "_post_accumulate_grad_hooks", None):
                hooked.append(p)
                grads.append(grad)
            elif p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
    work.clear()
    if hooked:
        torch.autograd.backward(hooked, grads)
