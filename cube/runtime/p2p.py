"""Tagged sends and receives between device groups, as autograd functions.

A value made on rank ``src`` and read on rank ``dst`` moves with ``send`` on
``src`` and ``recv`` on ``dst`` (same ``tag``). The gradient moves back the
same way. Sends never block: they are posted (``isend``) and waited for at the
end of the step (:func:`finish`). Only receives block, so two ranks that
exchange several values in any order cannot wait on each other.

On ``src``, ``send`` returns an empty *marker* that carries the gradient's
receive into backward; the step runs backward from the markers as well as from
the loss (:func:`backward`).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

_PENDING: List = []     # posted sends of this step
_MARKERS: List[torch.Tensor] = []
_MICRO = [0]            # the micro-batch being run: tags are offset by it
TAG_STRIDE = 1 << 16


def set_micro(i: int) -> None:
    """Offsets the tags of the following sends and receives by micro-batch ``i``."""
    _MICRO[0] = i


def take_markers() -> List[torch.Tensor]:
    """The send markers made since the last call (one micro-batch's), forgotten here."""
    out = list(_MARKERS)
    _MARKERS.clear()
    return out


def _tag(tag: int) -> int:
    return tag + _MICRO[0] * TAG_STRIDE


def _isend(x: torch.Tensor, dst: int, tag: int) -> None:
    """Posts a send; ``tag`` already carries the micro-batch offset."""
    x = x.detach().contiguous()
    _PENDING.append((dist.isend(x, dst, tag=tag), x))


class _Send(Function):
    @staticmethod
    def forward(ctx, x, dst, tag):
        tag = _tag(tag)
        ctx.args = (dst, tag, x.shape, x.dtype, x.device)
        _isend(x, dst, tag)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        dst, tag, shape, dtype, device = ctx.args
        grad = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(grad, dst, tag=tag)
        return grad, None, None


class _Recv(Function):
    @staticmethod
    def forward(ctx, anchor, src, tag, shape, dtype):
        tag = _tag(tag)
        ctx.args = (src, tag)
        y = torch.empty(shape, dtype=dtype, device=anchor.device)
        dist.recv(y, src, tag=tag)
        return y

    @staticmethod
    def backward(ctx, grad):
        src, tag = ctx.args
        _isend(grad, src, tag)
        return None, None, None, None, None


def send(x: torch.Tensor, dst: int, tag: int, grad: bool = True) -> None:
    """Sends ``x`` to ``dst``; with ``grad`` and when ``x`` needs one, its gradient comes back in backward."""
    if grad and torch.is_grad_enabled() and x.requires_grad:
        _MARKERS.append(_Send.apply(x, dst, tag))
    else:
        _isend(x, dst, _tag(tag))


def recv(src: int, tag: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
         requires_grad: bool) -> torch.Tensor:
    """Receives a value from ``src``; with ``requires_grad`` its gradient is sent back in backward."""
    if requires_grad and torch.is_grad_enabled():
        anchor = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
        return _Recv.apply(anchor, src, tag, tuple(shape), dtype)
    y = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(y, src, tag=_tag(tag))
    return y


def backward(loss: Optional[torch.Tensor], markers: Optional[List[torch.Tensor]] = None,
             scale: float = 1.0) -> None:
    """Backward from the loss (when this rank made it; its gradient is ``scale``) and from send
    markers (default: those made since the last ``take_markers``, which are then forgotten)."""
    if markers is None:
        markers = take_markers()
    roots = list(markers)
    grads = [torch.empty(0, dtype=m.dtype, device=m.device) for m in markers]
    if loss is not None and loss.requires_grad:
        roots.append(loss)
        grads.append(torch.full_like(loss, scale))
    if roots:
        torch.autograd.backward(roots, grads)


def finish() -> None:
    """Waits for this step's sends (their buffers must live until they are out)."""
    for work, _ in _PENDING:
        work.wait()
    _PENDING.clear()
