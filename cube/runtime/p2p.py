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

What is in flight (posted sends and receives, send markers, stashes, the
micro-batch offset) belongs to the running program: a
:class:`~cube.runtime.session.P2PState` of the active runtime state
(:func:`cube.runtime.session.current`). The module functions act on it; an
autograd function keeps the one it was made under for its backward.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube import config
from cube.errors import CubeInternalError
from cube.runtime import session
from cube.runtime.collectives import box_index, to_wire, wire
from cube.runtime.compiled import outside_graph
from cube.runtime.session import P2PState

TAG_STRIDE = 1 << 16
_TORCH = "torch.distributed.distributed_c10d"   # where torch's own isend/irecv are defined


def _world():
    """The default process group, called directly; None where ``torch.distributed``'s isend or
    irecv is not torch's own (the in-process world of :mod:`cube.debug` replaces them, and so may
    a test), or no group is up (torch's functions then raise their own error).

    ``dist.isend``/``dist.irecv`` only check their arguments and call the group's ``send``/``recv``
    (ranks of the default group are global ranks). The checks cost about 5 µs of CPU a message
    (a round trip of a tiny message between two gloo ranks: 110 µs through them, 93 µs without),
    and on ranks that share cores every rank's CPU is on the critical path.
    """
    if dist.isend.__module__ != _TORCH or dist.irecv.__module__ != _TORCH:
        return None
    return dist.GroupMember.WORLD


class P2POrderError(RuntimeError):
    """Under ``CUBE_P2P_ORDER=strict``, a receive met another message than the one it waits for: NCCL,
    which pairs a send with a receive by posting order per pair of ranks, would pair them."""


def order_error(src: int, dst: int, tag: int, sent: int) -> P2POrderError:
    return P2POrderError(
        f"CUBE_P2P_ORDER=strict: rank {dst}'s receive of message {tag % TAG_STRIDE} (micro-batch "
        f"{tag // TAG_STRIDE}) from rank {src} meets that rank's send of message {sent % TAG_STRIDE} (micro-batch "
        f"{sent // TAG_STRIDE}): the two ranks post their messages in other orders. NCCL pairs them by posting "
        f"order, tags ignored, so on GPUs this step would hang or mix the values up. The schedule must post each "
        f"pair's messages in one order on both ranks.")


class _Checked:
    """Strict order on gloo: a receive posted as a header (the sender's tag) and its payload, both under tag
    0, so gloo matches them by posting order as NCCL does; waiting checks the header first."""

    def __init__(self, header: torch.Tensor, works, src: int, tag: int):
        self.header, self.works, self.src, self.tag = header, works, src, tag

    def wait(self, timeout=None) -> bool:
        self.works[0].wait()
        if int(self.header[0]) != self.tag:
            raise order_error(self.src, dist.get_rank(), self.tag, int(self.header[0]))
        self.works[1].wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


class _Both:
    def __init__(self, works, keep):
        self.works, self.keep = works, keep   # keep: the header tensor lives until sent

    def wait(self, timeout=None) -> bool:
        for w in self.works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


def _strict_gloo(pg) -> bool:
    return pg is not None and config.p2p_strict() and dist.get_backend() == "gloo"


def _send_work(x: torch.Tensor, dst: int, tag: int):
    """Posts the send of ``x`` (contiguous, in wire memory) to global rank ``dst``: its work."""
    pg = _world()
    if pg is None:
        return dist.isend(x, dst, tag=tag)
    x = torch.view_as_real(x) if x.is_complex() else x
    if _strict_gloo(pg):
        header = torch.tensor([tag], dtype=torch.int64)
        return _Both([pg.send([header], dst, 0), pg.send([x], dst, 0)], header)
    return pg.send([x], dst, tag)


def _recv_work(y: torch.Tensor, src: int, tag: int):
    """Posts the receive into ``y`` (contiguous, in wire memory) from global rank ``src``: its work."""
    pg = _world()
    if pg is None:
        return dist.irecv(y, src, tag=tag)
    y = torch.view_as_real(y) if y.is_complex() else y
    if _strict_gloo(pg):
        header = torch.empty(1, dtype=torch.int64)
        return _Checked(header, [pg.recv([header], src, 0), pg.recv([y], src, 0)], src, tag)
    return pg.recv([y], src, tag)


# ---------------------------------------------------------------- the ordered channel
def ordered() -> bool:
    """Whether messages go over ordered channels: on NCCL, which pairs a send with a receive by
    posting order per pair of ranks and ignores tags, and under ``CUBE_P2P_ORDER=strict``, which
    makes gloo and the in-process world match that way.

    Every message then travels as a header (its tag, dtype and shape) and its payload, in the order
    the sender posts them; a receiver reads its channel from a peer in that order and keeps a
    message another part of its program waits for (``P2PState.mailbox``) until it is asked for.
    So the two ranks of a pair never have to post in the same order: a rank holding several
    pipeline stages (interleaved 1F1B, ZB-V, DualPipeV) consumes a neighbour's messages in its own
    schedule's order, and gradients sent in autograd's order arrive where they are awaited. The
    price is one small header message per value, and no receive posted ahead (NCCL: a posted
    receive would hold the pair's queue).
    """
    if config.p2p_strict():
        return True
    return dist.is_initialized() and "nccl" in str(dist.get_backend())


CHANNEL_TAG = (1 << 30) - 3   # the ordered channel's messages all carry this tag: matched in order
_HEADER = 12                  # int64 slots: tag, dtype, ndim, up to 9 sizes
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
           torch.float8_e5m2)


def _raw_send(x: torch.Tensor, dst: int):
    pg = _world()
    x = torch.view_as_real(x) if x.is_complex() else x
    return dist.isend(x, dst, tag=CHANNEL_TAG) if pg is None else pg.send([x], dst, CHANNEL_TAG)


def _raw_recv(y: torch.Tensor, src: int):
    pg = _world()
    y = torch.view_as_real(y) if y.is_complex() else y
    return dist.irecv(y, src, tag=CHANNEL_TAG) if pg is None else pg.recv([y], src, CHANNEL_TAG)


def _channel_send(x: torch.Tensor, dst: int, tag: int):
    """Posts ``x`` (contiguous, in wire memory) on the ordered channel to ``dst``: header, then payload."""
    if x.ndim > _HEADER - 3:
        raise CubeInternalError(f"a point-to-point value of {x.ndim} dims (at most {_HEADER - 3} travel)")
    head = [tag, _DTYPES.index(x.dtype), x.ndim, *x.shape] + [0] * (_HEADER - 3 - x.ndim)
    header = torch.tensor(head, dtype=torch.int64, device=x.device)
    return _Both([_raw_send(header, dst), _raw_send(x, dst)], header)


def _channel_take(st: P2PState, src: int, tag: int, device) -> torch.Tensor:
    """The message ``tag`` from ``src``: kept from an earlier read, or read off the channel, keeping
    the messages before it for whoever waits for them."""
    kept = st.mailbox.pop((src, tag), None)
    if kept is not None:
        return kept
    on = wire(device)
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64, device=on)
        _raw_recv(header, src).wait()
        got, code, ndim, *sizes = header.tolist()
        y = torch.empty(sizes[:ndim], dtype=_DTYPES[code], device=on)
        _raw_recv(y, src).wait()
        if got == tag:
            return y
        if (src, got) in st.mailbox:
            raise CubeInternalError(f"two messages with tag {got} from rank {src} in one step")
        st.mailbox[(src, got)] = y


def _state() -> P2PState:
    return session.current().p2p


def set_micro(i: int) -> None:
    """Offsets the tags of the following sends and receives by micro-batch ``i``."""
    _state().micro = i


def take_markers() -> List[torch.Tensor]:
    """The send markers made since the last call (one micro-batch's), forgotten here."""
    st = _state()
    out = list(st.markers)
    st.markers.clear()
    return out


def _tag(st: P2PState, tag: int) -> int:
    return tag + st.micro * TAG_STRIDE


def _take(st: P2PState, src: int, tag: int, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """The value of the receive ``(src, tag)`` (tag with its micro-batch offset): its posted
    ``irecv`` if there is one, else a blocking receive (in order: see :func:`ordered`)."""
    if ordered():
        y = _channel_take(st, src, tag, device)
        return y if y.device == device else y.to(device)
    posted = st.posted.pop((src, tag), None)
    if posted is not None:
        posted[0].wait()
        y = posted[1]
        return y if y.device == device else y.to(device)
    on = wire(device)
    y = torch.empty(tuple(shape), dtype=dtype, device=on)
    _recv_work(y, src, tag).wait()
    return y if on is device else y.to(device)


def _post(st: P2PState, src: int, tag: int, shape, dtype: torch.dtype, device) -> None:
    if ordered():   # nothing is posted ahead: a pair's channel is read in its sender's order
        return
    if (src, tag) not in st.posted:
        y = torch.empty(tuple(shape), dtype=dtype, device=wire(device))
        st.posted[(src, tag)] = (_recv_work(y, src, tag), y)


def post(recvs: Sequence[tuple], micro: int) -> None:
    """Posts the receives ``recvs`` (as :func:`recorded` lists them) of micro-batch ``micro``."""
    st = _state()
    for src, tag, shape, dtype, device in recvs:
        _post(st, src, tag + micro * TAG_STRIDE, shape, dtype, device)


def recorded() -> List[tuple]:
    """The receives made since the last call (``(src, tag, shape, dtype, device)``, tags without
    the micro-batch offset), forgotten here."""
    st = _state()
    out = list(st.recvs)
    st.recvs.clear()
    return out


@contextmanager
def early_gradients():
    """Inside, each send posts the receive of its gradient at once (every forward of the
    block must get its backward before the block ends, as a pipeline schedule does)."""
    st = _state()
    st.early = True
    try:
        yield
    finally:
        st.early = False


def _isend(st: P2PState, x: torch.Tensor, dst: int, tag: int) -> None:
    """Posts a send; ``tag`` already carries the micro-batch offset."""
    x = to_wire(x.detach() if x.requires_grad else x)
    st.pending.append(((_channel_send if ordered() else _send_work)(x, dst, tag), x))


class _Send(Function):
    @staticmethod
    def forward(ctx, x, st, dst, tag, value=True):
        tag = _tag(st, tag)
        ctx.st, ctx.args = st, (dst, tag, x.shape, x.dtype, x.device)
        if value:
            _isend(st, x, dst, tag)
        if st.early:
            _post(st, *ctx.args)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return _take(ctx.st, *ctx.args), None, None, None, None


class _GradTo(Function):
    @staticmethod
    def forward(ctx, x, st, dst, tag):
        ctx.st, ctx.args = st, (dst, _tag(st, tag))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _isend(ctx.st, grad, *ctx.args)
        return grad, None, None, None


class _Recv(Function):
    @staticmethod
    def forward(ctx, anchor, st, src, tag, shape, dtype):
        ctx.st, ctx.args = st, (src, _tag(st, tag))
        return _take(st, src, _tag(st, tag), shape, dtype, anchor.device)

    @staticmethod
    def backward(ctx, grad):
        src, tag = ctx.args
        _isend(ctx.st, grad, src, tag)
        return None, None, None, None, None, None


class _Stash(Function):
    @staticmethod
    def forward(ctx, x, st, tag):
        ctx.st, ctx.tag = st, tag
        st.stashed[(tag, "value")] = x.detach()
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        return ctx.st.stashed.pop((ctx.tag, "grad"), None), None, None


class _Unstash(Function):
    @staticmethod
    def forward(ctx, anchor, st, tag):
        ctx.st, ctx.tag = st, tag
        return st.stashed.pop((tag, "value"))

    @staticmethod
    def backward(ctx, grad):
        ctx.st.stashed[(ctx.tag, "grad")] = grad
        return None, None, None


@outside_graph
def stash(x: torch.Tensor, tag: int, grad: bool = True) -> None:
    """Keeps ``x`` for a later pipeline stage of this rank (:func:`unstash` with the same ``tag``);
    with ``grad`` and when ``x`` needs one, its gradient comes back in backward, like a send's."""
    st = _state()
    if grad and torch.is_grad_enabled() and x.requires_grad:
        st.markers.append(_Stash.apply(x, st, _tag(st, tag)))
    else:
        st.stashed[(_tag(st, tag), "value")] = x.detach()


@outside_graph
def unstash(tag: int, requires_grad: bool) -> torch.Tensor:
    """The value an earlier stage of this rank stashed; with ``requires_grad`` its gradient goes
    back to that stage (a new leaf of autograd, as a received value is)."""
    st = _state()
    key = (_tag(st, tag), "value")
    if requires_grad and torch.is_grad_enabled():
        anchor = torch.empty(0, device=st.stashed[key].device, requires_grad=True)
        return _Unstash.apply(anchor, st, key[0])
    return st.stashed.pop(key)


@outside_graph
def send(x: torch.Tensor, dst: int, tag: int, grad: bool = True, dtype: Optional[torch.dtype] = None,
         value: bool = True) -> None:
    """Sends ``x`` to ``dst``; with ``grad`` and when ``x`` needs one, its gradient comes back in backward.

    ``dtype``: the type the receiver expects (mixed precision computes some values in a lower one).
    ``value=False``: nothing goes out, only the gradient comes back (``x`` replicates a piece another
    rank sent; the receiver returns the gradient here too with :func:`grad_to`).
    """
    if dtype is not None and x.dtype != dtype:
        x = x.to(dtype)
    st = _state()
    if grad and torch.is_grad_enabled() and x.requires_grad:
        st.markers.append(_Send.apply(x, st, dst, tag, value))
    elif value:
        _isend(st, x, dst, _tag(st, tag))


@outside_graph
def grad_to(x: torch.Tensor, dst: int, tag: int) -> torch.Tensor:
    """``x`` itself; in backward its gradient is also sent to ``dst`` (which holds a replica of the
    piece ``x`` came from and waits for it with ``send(..., value=False)``)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _GradTo.apply(x, _state(), dst, tag)
    return x


@outside_graph
def recv(src: int, tag: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
         requires_grad: bool, grad_back: bool = True) -> torch.Tensor:
    """Receives a value from ``src``; with ``requires_grad`` its gradient is sent back in backward.

    ``grad_back=False``: the value still starts a gradient here (the ops after it run backward
    like those on the ranks that do send it back: their collectives must meet), but it is not
    sent: another reader of the same piece returns it (:mod:`cube.passes.exchange`).
    """
    st = _state()
    st.recvs.append((src, tag, tuple(shape), dtype, device))
    if requires_grad and grad_back and torch.is_grad_enabled():
        anchor = torch.empty(0, dtype=dtype, device=device, requires_grad=True)
        return _Recv.apply(anchor, st, src, tag, tuple(shape), dtype)
    y = _take(st, src, _tag(st, tag), shape, dtype, device)
    return y.requires_grad_() if requires_grad and dtype.is_floating_point and torch.is_grad_enabled() else y


def _gather_forward(st: P2PState, x: Optional[torch.Tensor], remote, local, shape, dtype: torch.dtype,
                    device) -> torch.Tensor:
    """Every remote region received at once, straight into its place in the result where that
    place is contiguous (a posted receive's own buffer, or a staging one, is copied in); the
    local regions copied in while the messages land."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    landing = []
    for src, tag, place, _, _ in remote:
        st.recvs.append((src, tag, tuple(e - s for s, e in place), dtype, device))
        tag = _tag(st, tag)
        dst = out[box_index(place)]
        if ordered():
            dst.copy_(_channel_take(st, src, tag, device))
            continue
        posted = st.posted.pop((src, tag), None)
        if posted is not None:
            landing.append((posted[0], posted[1], dst))
        elif dst.is_contiguous() and wire(device) == device:
            landing.append((_recv_work(dst, src, tag), None, None))
        else:
            buf = torch.empty(dst.shape, dtype=dtype, device=wire(device))
            landing.append((_recv_work(buf, src, tag), buf, dst))
    for part, place, _, _ in local:
        out[box_index(place)] = x[box_index(part)]
    for work, buf, dst in landing:
        work.wait()
        if buf is not None:
            dst.copy_(buf)
    return out


class _Gather(Function):
    @staticmethod
    def forward(ctx, anchor, x, st, remote, local, shape, dtype):
        ctx.st = st
        ctx.remote = [(src, _tag(st, tag), place, back, tuple((q, _tag(st, t)) for q, t in links))
                      for src, tag, place, back, links in remote]
        ctx.local = [(part, place, back, tuple((q, _tag(st, t)) for q, t in links))
                     for part, place, back, links in local]
        ctx.x_meta = (x.shape, x.dtype) if x is not None else None
        return _gather_forward(st, x, remote, local, shape, dtype, anchor.device)

    @staticmethod
    def backward(ctx, grad):
        st = ctx.st
        for src, tag, place, back, links in ctx.remote:
            g = grad[box_index(place)]
            if back:
                _isend(st, g, src, tag)
            for q, t in links:
                _isend(st, g, q, t)
        gx = None
        if ctx.x_meta is not None and ctx.needs_input_grad[1]:
            gx = grad.new_zeros(ctx.x_meta[0], dtype=ctx.x_meta[1])
            for part, place, back, links in ctx.local:
                g = grad[box_index(place)]
                for q, t in links:
                    _isend(st, g, q, t)
                if back:
                    gx[box_index(part)] += g
        else:
            for part, place, back, links in ctx.local:
                for q, t in links:
                    _isend(st, grad[box_index(place)], q, t)
        return None, gx, None, None, None, None, None


@outside_graph
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
    st = _state()
    if requires_grad and torch.is_grad_enabled() and dtype.is_floating_point:
        anchor = torch.empty(0, device=device, requires_grad=True)
        return _Gather.apply(anchor, x, st, tuple(remote), tuple(local), tuple(shape), dtype)
    return _gather_forward(st, x, remote, local, shape, dtype, device)


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


def finish(state: Optional[P2PState] = None) -> None:
    """Waits for this step's sends (their buffers must live until they are out).

    Posted receives are left alone: a finished step has taken all it posted
    (see :func:`untaken`), and waiting for one whose message never comes (a step
    that failed half-way, at exit) would hang.

    Args:
        state: whose sends (default: the active state's).
    """
    st = state if state is not None else _state()
    for work, _ in st.pending:
        work.wait()
    st.pending.clear()
    st.recvs.clear()


def forget(state: Optional[P2PState] = None) -> None:
    """Drops every posted receive, pending send and stashed value (at exit, after the process
    group is gone) of ``state`` (default: the active state's)."""
    st = state if state is not None else _state()
    st.posted.clear()
    st.pending.clear()
    st.stashed.clear()
    st.mailbox.clear()
    st.markers.clear()
    st.recvs.clear()


def untaken() -> List[Tuple[object, int]]:
    """``(src, tag)`` of the receives posted ahead (or read off an ordered channel) and not taken
    yet, and ``("stash", tag)`` of stashed values and gradients nobody took."""
    st = _state()
    return list(st.posted) + list(st.mailbox) + [("stash", tag) for tag, _ in st.stashed]


def send_value(x: torch.Tensor, dst: int, tag: int):
    """Posts ``x`` (in wire memory) to ``dst`` outside autograd and returns its work; ``tag`` as is
    (no micro-batch offset). On ordered channels it queues behind this rank's earlier messages to ``dst``."""
    return (_channel_send if ordered() else _send_work)(x.contiguous(), dst, tag)


def recv_value(src: int, tag: int, shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """Receives the value :func:`send_value` sent with ``tag`` from ``src`` (blocking)."""
    return _take(_state(), src, tag, shape, dtype, device)
