"""Split backward for zero-bubble pipelines: input gradients now (B), weight gradients later (W).

Under a schedule that splits backward (``cube.schedule.sched_zb_h1``,
``sched_zbv``), the generated code calls :func:`linear` instead of
``aten.linear`` for a linear layer whose weight is a parameter of this rank.
Its backward computes the input's gradient at once, the gradient the previous
stage waits for, and, while a B action runs (:func:`collecting`), leaves the
weight and bias gradients as work in the collecting list: the layer's saved
input and output gradient. The pipeline runs that work in the action's W
(:func:`apply`), where the rank would otherwise wait for its neighbours. What a
W computes is what autograd would have: ``grad_out^T @ input`` in the forward's
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

# (input, output gradient, weight or None, bias or None, the forward's compute dtype)
Work = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], torch.dtype]


class _Linear(Function):
    @staticmethod
    def forward(ctx, x, w, b, st):
        out = F.linear(x, w, b)
        ctx.st, ctx.w, ctx.b, ctx.dtype = st, w, b, out.dtype
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        w, b, dtype = ctx.w, ctx.b, ctx.dtype
        gx = (g @ w.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        wants = (w if ctx.needs_input_grad[1] else None, b if b is not None and ctx.needs_input_grad[2] else None)
        if wants == (None, None):
            return gx, None, None, None
        work = (x, g, wants[0], wants[1], dtype)
        sink = ctx.st.wgrads.sink
        if sink is not None and all(t is None or t.is_leaf for t in wants):
            sink.append(work)
            return gx, None, None, None
        gw, gb = _weight_grads(work)
        return gx, gw, gb, None


def _weight_grads(work: Work) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    x, g, w, b, dtype = work
    g2 = g.reshape(-1, g.shape[-1])
    gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(dtype)).to(w.dtype) if w is not None else None
    gb = g2.sum(0).to(b.dtype) if b is not None else None
    return gw, gb


@outside_graph
def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``aten.linear`` whose weight gradient a B action defers to its W (see the module docstring)."""
    if not torch.is_grad_enabled() or not (weight.requires_grad or (bias is not None and bias.requires_grad)):
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias, session.current())


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
    """Computes the deferred weight gradients and accumulates them (one autograd call, so hooks fire)."""
    params, grads = [], []
    for item in work:
        gw, gb = _weight_grads(item)
        for p, grad in ((item[2], gw), (item[3], gb)):
            if p is not None:
                params.append(p)
                grads.append(grad)
    work.clear()
    if params:
        torch.autograd.backward(params, grads)
