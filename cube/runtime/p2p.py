"""Tagged sends and receives between device groups, as autograd functions.

A value made on rank ``src`` and read on rank ``dst`` moves with ``send`` on
``src`` and ``recv`` on ``dst`` (same ``tag``). The gradient moves back the
same way. Sends never block: they are posted (``isend``) and waited for at the
end of the step (:func:`finish`). Only receives block, so two ranks that
exchange several values in any order cannot wait on each other.

On ``src``, ``send`` returns an empty *marker* that carries the gradient's
receive into backward; the step runs backward from the markers as well as from
the loss (:func:`backward`).

A pipeline executor posts receives before they are needed (``irecv``), so the
data lands while this rank computes: :func:`post` for a later micro-batch's
forward inputs (the receives a forward makes are listed by :func:`recorded`),
and, under :func:`early_gradients`, each send's gradient receive as soon as the
send is made. A receive finds its posted twin by source and tag.

A rank running several pipeline stages hands a value from one of its stages to
a later one with :func:`stash` and :func:`unstash` (same ``tag``): no message,
but the same autograd cut as a send, so each stage's backward runs through its
own graph once; the gradient waits in memory until the earlier stage's backward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.runtime.collectives import wire

_PENDING: List = []     # posted sends of this step
_MARKERS: List[torch.Tensor] = []
_MICRO = [0]            # the micro-batch being run: tags are offset by it
TAG_STRIDE = 1 << 16
_POSTED: Dict[Tuple[int, int], Tuple[object, torch.Tensor]] = {}   # (src, tag) -> posted irecv and its buffer
_RECVS: List[tuple] = []   # (src, tag, shape, dtype, device) of the receives made since the last ``recorded``
_EARLY = [False]           # post each send's gradient receive when the send is made
_STASHED: Dict[Tuple[int, str], torch.Tensor] = {}   # (tag, "value" or "grad") -> what waits for a later stage


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


def _take(src: int, tag: int, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The value of the receive ``(src, tag)`` (tag with its micro-batch offset): its posted
    ``irecv`` if there is one, else a blocking receive."""
    posted = _POSTED.pop((src, tag), None)
    if posted is not None:
        posted[0].wait()
        return posted[1].to(device)
    y = torch.empty(tuple(shape), dtype=dtype, device=wire(device))
    dist.recv(y, src, tag=tag)
    return y.to(device)


def _post(src: int, tag: int, shape, dtype: torch.dtype, device) -> None:
    if (src, tag) not in _POSTED:
        y = torch.empty(tuple(shape), dtype=dtype, device=wire(device))
        _POSTED[(src, tag)] = (dist.irecv(y, src, tag=tag), y)


def post(recvs: Sequence[tuple], micro: int) -> None:
    """Posts the receives ``recvs`` (as :func:`recorded` lists them) of micro-batch ``micro``."""
    for src, tag, shape, dtype, device in recvs:
        _post(src, tag + micro * TAG_STRIDE, shape, dtype, device)


def recorded() -> List[tuple]:
    """The receives made since the last call (``(src, tag, shape, dtype, device)``, tags without
    the micro-batch offset), forgotten here."""
    out = list(_RECVS)
    _RECVS.clear()
    return out


@contextmanager
def early_gradients():
    """Inside, each send posts the receive of its gradient at once (every forward of the
    block must get its backward before the block ends, as a pipeline schedule does)."""
    _EARLY[0] = True
    try:
        yield
    finally:
        _EARLY[0] = False


def _isend(x: torch.Tensor, dst: int, tag: int) -> None:
    """Posts a send; ``tag`` already carries the micro-batch offset."""
    x = x.detach().contiguous().to(wire(x.device))
    _PENDING.append((dist.isend(x, dst, tag=tag), x))


class _Send(Function):
    @staticmethod
    def forward(ctx, x, dst, tag, value=True):
        tag = _tag(tag)
        ctx.args = (dst, tag, x.shape, x.dtype, x.device)
        if value:
            _isend(x, dst, tag)
        if _EARLY[0]:
            _post(*ctx.args)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return _take(*ctx.args), None, None, None


class _GradTo(Function):
    @staticmethod
    def forward(ctx, x, dst, tag):
        ctx.args = (dst, _tag(tag))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _isend(grad, *ctx.args)
        return grad, None, None


class _Recv(Function):
    @staticmethod
    def forward(ctx, anchor, src, tag, shape, dtype):
        ctx.args = (src, _tag(tag))
        return _take(src, _tag(tag), shape, dtype, anchor.device)

    @staticmethod
    def backward(ctx, grad):
        src, tag = ctx.args
        _isend(grad, src, tag)
        return None, None, None, None, None


class _Stash(Function):
    @staticmethod
    def forward(ctx, x, tag):
        ctx.tag = tag
        _STASHED[(tag, "value")] = x.detach()
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return _STASHED.pop((ctx.tag, "grad"), None), None


class _Unstash(Function):
    @staticmethod
    def forward(ctx, anchor, tag):
        ctx.tag = tag
        return _STASHED.pop((tag, "value"))

    @staticmethod
    def backward(ctx, grad):
        _STASHED[(ctx.tag, "grad")] = grad
        return None, None


def stash(x: torch.Tensor, tag: int, grad: bool = True) -> None:
    """Keeps ``x`` for a later pipeline stage of this rank (:func:`unstash` with the same ``tag``);
    with ``grad`` and when ``x`` needs one, its gradient comes back in backward, like a send's."""
    if grad and torch.is_grad_enabled() and x.requires_grad:
        _MARKERS.append(_Stash.apply(x, _tag(tag)))
    else:
        _STASHED[(_tag(tag), "value")] = x.detach()


def unstash(tag: int, requires_grad: bool) -> torch.Tensor:
    """The value an earlier stage of this rank stashed; with ``requires_grad`` its gradient goes
    back to that stage (a new leaf of autograd, as a received value is)."""
    key = (_tag(tag), "value")
    if requires_grad and torch.is_grad_enabled():
        anchor = torch.empty(0, device=_STASHED[key].device, requires_grad=True)
        return _Unstash.apply(anchor, key[0])
    return _STASHED.pop(key)


def send(x: torch.Tensor, dst: int, tag: int, grad: bool = True, dtype: Optional[torch.dtype] = None,
         value: bool = True) -> None:
    """Sends ``x`` to ``dst``; with ``grad`` and when ``x`` needs one, its gradient comes back in backward.

    ``dtype``: the type the receiver expects (mixed precision computes some values in a lower one).
    ``value=False``: nothing goes out, only the gradient comes back (``x`` replicates a piece another
    rank sent; the receiver returns the gradient here too with :func:`grad_to`).
    """
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    if grad and torch.is_grad_enabled() and x.requires_grad:
        _MARKERS.append(_Send.apply(x, dst, tag, value))
    elif value:
        _isend(x, dst, _tag(tag))


def grad_to(x: torch.Tensor, dst: int, tag: int) -> torch.Tensor:
    """``x`` itself; in backward its gradient is also sent to ``dst`` (which holds a replica of the
    piece ``x`` came from and waits for it with ``send(..., value=False)``)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GradTo.apply(x, dst, tag)
    return x


def recv(src: int, tag: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
         requires_grad: bool, grad_back: bool = True) -> torch.Tensor:
    """Receives a value from ``src``; with ``requires_grad`` its gradient is sent back in backward.

    ``grad_back=False``: the value still starts a gradient here (the ops after it run backward
    like those on the ranks that do send it back: their collectives must meet), but it is not
    sent: another reader of the same piece returns it (:mod:`cube.passes.exchange`).
    """
    _RECVS.append((src, tag, tuple(shape), dtype, device))
    if requires_grad and grad_back and torch.is_grad_enabled():
        anchor = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
        return _Recv.apply(anchor, src, tag, tuple(shape), dtype)
    y = _take(src, _tag(tag), shape, dtype, device)
    return y.requires_grad_() if requires_grad and dtype.is_floating_point and torch.is_grad_enabled() else y


def _box(part) -> tuple:
    return tuple(slice(s, e) for s, e in part)


def _gather_forward(x: Optional[torch.Tensor], remote, local, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """Every remote region received at once, straight into its place in the result where that
    place is contiguous (a posted receive's own buffer, or a staging one, is copied in); the
    local regions copied in while the messages land."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    landing = []
    for src, tag, place, _, _ in remote:
        _RECVS.append((src, tag, tuple(e - s for s, e in place), dtype, device))
        tag = _tag(tag)
        dst = out[_box(place)]
        posted = _POSTED.pop((src, tag), None)
        if posted is not None:
            landing.append((posted[0], posted[1], dst))
        elif dst.is_contiguous() and wire(device) == device:
            landing.append((dist.irecv(dst, src, tag=tag), None, None))
        else:
            buf = torch.empty(dst.shape, dtype=dtype, device=wire(device))
            landing.append((dist.irecv(buf, src, tag=tag), buf, dst))
    for part, place, _, _ in local:
        out[_box(place)] = x[_box(part)]
    for work, buf, dst in landing:
        work.wait()
        if buf is not None:
            dst.copy_(buf)
    return out


class _Gather(Function):
    @staticmethod
    def forward(ctx, anchor, x, remote, local, shape, dtype):
        ctx.remote = [(src, _tag(tag), place, back, tuple((q, _tag(t)) for q, t in links))
                      for src, tag, place, back, links in remote]
        ctx.local = [(part, place, back, tuple((q, _tag(t)) for q, t in links)) for part, place, back, links in local]
        ctx.x_meta = (x.shape, x.dtype) if x is not None else None
        return _gather_forward(x, remote, local, shape, dtype, anchor.device)

    @staticmethod
    def backward(ctx, grad):
        for src, tag, place, back, links in ctx.remote:
            g = grad[_box(place)]
            if back:
                _isend(g, src, tag)
            for q, t in links:
                _isend(g, q, t)
        gx = None
        if ctx.x_meta is not None and ctx.needs_input_grad[1]:
            gx = grad.new_zeros(ctx.x_meta[0], dtype=ctx.x_meta[1])
            for part, place, back, links in ctx.local:
                g = grad[_box(place)]
                for q, t in links:
                    _isend(g, q, t)
                if back:
                    gx[_box(part)] += g
        else:
            for part, place, back, links in ctx.local:
                for q, t in links:
                    _isend(grad[_box(place)], q, t)
        return None, gx, None, None, None, None


def gather(x: Optional[torch.Tensor], remote, local, shape: Sequence[int], dtype: torch.dtype, device,
           requires_grad: bool) -> torch.Tensor:
    """A value assembled from regions of other ranks' pieces and of this rank's ``x``, which tile it.

    ``remote``: ``(src, tag, place, grad_back, links)`` per region another rank sends (``place``:
    its box in the result); ``local``: ``(part, place, grad_back, links)`` per region of ``x``
    (``part`` relative to ``x``). In backward each region's gradient goes back to where it came
    from when ``grad_back``, and to each ``(rank, tag)`` of ``links`` (the replicas of its source
    piece, waiting with ``send(..., value=False)``). One call instead of a receive per region
    and an assembly: the receives are all posted before any is waited for, into the result.
    """
    if requires_grad and torch.is_grad_enabled() and dtype.is_floating_point:
        anchor = torch.empty(0, device=device, requires_grad=True)
        return _Gather.apply(anchor, x, tuple(remote), tuple(local), tuple(shape), dtype)
    return _gather_forward(x, remote, local, shape, dtype, device)


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
    """Waits for this step's sends (their buffers must live until they are out).

    Posted receives are left alone: a finished step has taken all it posted
    (see :func:`untaken`), and waiting for one whose message never comes (a step
    that failed half-way, at exit) would hang."""
    for work, _ in _PENDING:
        work.wait()
    _PENDING.clear()
    _RECVS.clear()


def forget() -> None:
    """Drops every posted receive, pending send and stashed value (at exit, after the process
    group is gone)."""
    _POSTED.clear()
    _PENDING.clear()
    _STASHED.clear()
    _MARKERS.clear()
    _RECVS.clear()


def untaken() -> List[Tuple[object, int]]:
    """``(src, tag)`` of the receives posted ahead and not taken yet, and ``("stash", tag)`` of
    stashed values and gradients nobody took."""
    return list(_POSTED) + [("stash", tag) for tag, _ in _STASHED]
