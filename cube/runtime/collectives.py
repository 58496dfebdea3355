"""Communication primitives between tensor pieces, as autograd functions.

Every primitive takes ``ranks``, the tuple of global ranks holding the pieces
(this rank among them); piece ``i`` belongs to ``ranks[i]``, so "rank order"
means the order of ``ranks``, which need not be sorted. Each backward is the
adjoint of its forward under the layout of the gradient noted below (R:
replicated, V: partial values to be summed, D(dim): split along ``dim``):

==============================  ==================  =====================
primitive                       forward             backward (gradient)
==============================  ==================  =====================
all_reduce                      V -> R              R -> R (identity)
identity_fw_all_reduce_bw       R -> R (identity)   V -> R (all-reduce)
all_gather                      D(dim) -> R         V -> D(dim)
all_gather(grad="R")            D(dim) -> R         R -> D(dim) (chunk)
reduce_scatter                  V -> D(dim)         D(dim) -> R
all_to_all                      D(c) -> D(s)        D(s) -> D(c)
chunk                           R -> D(dim)         D(dim) -> R
==============================  ==================  =====================

All pieces of one call have the same shape. With ``len(ranks) == 1`` each
primitive returns its input without touching ``torch.distributed``.
"""
from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.runtime import session
from cube.runtime.compiled import outside_graph

Ranks = Tuple[int, ...]


def group(ranks: Sequence[int]) -> Optional[dist.ProcessGroup]:
    """The cached process group of ``ranks`` (None for the world); see :meth:`cube.runtime.session.Groups.get`.

    The groups are those of the active runtime state, a table every compile of the
    process shares (``cube.runtime.session``).
    """
    return session.current().groups.get(ranks)


def create_groups(rank_tuples: Iterable[Sequence[int]]) -> None:
    """Creates groups on every rank at start-up; see :meth:`cube.runtime.session.Groups.create`."""
    session.current().groups.create(rank_tuples)


# ---------------------------------------------------------------- raw communication

def _index(ranks: Ranks) -> int:
    rank = dist.get_rank()
    if rank not in ranks:
        raise ValueError(f"rank {rank} is not in ranks {ranks}")
    return ranks.index(rank)


def nccl(x: torch.Tensor, grp) -> bool:
    """Whether ``x`` is communicated by NCCL in ``grp`` (which has the ``*_tensor`` collectives gloo lacks)."""
    return x.is_cuda and "nccl" in str(dist.get_backend(grp))


_CPU = torch.device("cpu")
_INDEX: dict = {}   # a box -> its index (slices): made once, not on every message
_INDEX_MAX = 4096


def wire(device: torch.device) -> torch.device:
    """Where a point-to-point message to or from ``device`` is buffered: ``device`` itself,
    except CUDA memory under gloo, whose send and receive take host memory only (ranks
    sharing a GPU in tests, ``CUBE_BACKEND=gloo``), which goes through the CPU."""
    if device == _CPU:   # no .type: it formats the device's name into a new string each call
        return device
    if device.type == "cuda" and "nccl" not in str(dist.get_backend()):
        return _CPU
    return device


def to_wire(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a message's buffer: contiguous, in :func:`wire` memory; ``x`` itself when it already
    is one (no call into the dispatcher: on ranks that share cores, each microsecond a message
    spends in Python delays the other ranks too)."""
    if x.is_cuda:
        x = x.to(wire(x.device))
    return x if x.is_contiguous() else x.contiguous()


def _divisible(x: torch.Tensor, n: int, dim: int) -> None:
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of shape {tuple(x.shape)} does not split into {n} equal pieces")


def _split(x: torch.Tensor, n: int, dim: int) -> Tuple[torch.Tensor, ...]:
    _divisible(x, n, dim)
    return x.chunk(n, dim)


def _own(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy, safe to communicate into and to return."""
    return x.clone(memory_format=torch.contiguous_format)


def _chunk(x: torch.Tensor, ranks: Ranks, dim: int) -> torch.Tensor:
    """A copy of this rank's chunk of ``x`` along ``dim`` (R -> D)."""
    return _own(_split(x, len(ranks), dim)[_index(ranks)])


def _all_reduce(x: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    y = _own(x)
    dist.all_reduce(y, group=group(ranks))
    return y


def all_gather_single(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """torch's ``all_gather_into_tensor``: named ``all_gather_single`` since torch 2.13, where the
    old name warns (FutureWarning) and forwards; looked up at each call (the in-process world
    replaces it)."""
    op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return op(out, x, group=group, async_op=async_op)


def reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group=None, async_op: bool = False):
    """torch's ``reduce_scatter_tensor`` (a sum): ``reduce_scatter_single`` since torch 2.13 (see
    :func:`all_gather_single`)."""
    op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return op(out, x, group=group, async_op=async_op)


# (backend, op) found missing: all_gather_single, reduce_scatter_single. A fact about this
# process's torch build, the same for every compile, so it is not runtime state.
_NO_TENSOR_OPS: set = set()


def _tensor_op(op, out: torch.Tensor, x: torch.Tensor, grp) -> bool:
    """``op`` (:func:`all_gather_single` or :func:`reduce_scatter_single`) where the backend has
    it (NCCL; gloo in recent torch): one buffer, no list of pieces. False (nothing sent) where it
    is missing."""
    if _NO_TENSOR_OPS and (str(dist.get_backend(grp)), op.__name__) in _NO_TENSOR_OPS:
        return False
    try:
        op(out, x, group=grp)
    except (RuntimeError, NotImplementedError) as e:   # refused before anything was sent
        key = (str(dist.get_backend(grp)), op.__name__)
        if "nccl" in key[0] or not any(w in str(e).lower() for w in ("support", "implement")):
            raise
        _NO_TENSOR_OPS.add(key)
        return False
    return True


def _all_gather(x: torch.Tensor, ranks: Ranks, dim: int) -> torch.Tensor:
    grp, n, x = group(ranks), len(ranks), x.contiguous()
    _index(ranks)
    order = sorted(ranks)   # the group's own rank order
    if x.dim() > 0 and (nccl(x, grp) or x.device.type == "cpu"):
        buf = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]))
        if _tensor_op(all_gather_single, buf, x, grp):
            if dim % x.dim() == 0 and list(ranks) == order:
                return buf   # the pieces lie in place already
            parts = buf.chunk(n)
            return torch.cat([parts[order.index(r)] for r in ranks], dim=dim)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=grp)
    return torch.cat([parts[order.index(r)] for r in ranks], dim=dim)


def _reduce_scatter(x: torch.Tensor, ranks: Ranks, dim: int) -> torch.Tensor:
    grp, n, me = group(ranks), len(ranks), _index(ranks)
    if nccl(x, grp):
        chunks = _split(x, n, dim)
        out = torch.empty_like(chunks[me], memory_format=torch.contiguous_format)
        dist.reduce_scatter(out, [chunks[ranks.index(r)].contiguous() for r in sorted(ranks)], group=grp)
        return out
    if x.device.type == "cpu" and x.dim() > 0:   # chunks laid out along dim 0 in the group's order
        order = sorted(ranks)
        d = dim % x.dim()
        if d == 0 and list(ranks) == order:   # laid out so already (no views of the chunks made)
            _divisible(x, n, 0)
            src = x.contiguous()
        else:
            chunks = _split(x, n, dim)
            src = torch.cat([chunks[ranks.index(r)] for r in order], dim=0)
        shape = list(x.shape)
        shape[d] //= n
        out = torch.empty(shape, dtype=x.dtype, device=x.device)   # the shape of src's chunks too
        if _tensor_op(reduce_scatter_single, out, src, grp):
            return out
    return _chunk(_all_reduce(x, ranks), ranks, dim)


def all_to_all_data(x: torch.Tensor, ranks: Ranks, split_dim: int, concat_dim: int) -> torch.Tensor:
    """``x`` cut in ``len(ranks)`` pieces along ``split_dim``, piece ``q`` sent to ``ranks[q]``, the pieces
    received concatenated along ``concat_dim`` in rank order: the all-to-all outside autograd."""
    grp, n, me = group(ranks), len(ranks), _index(ranks)
    chunks = [c.contiguous() for c in _split(x, n, split_dim)]
    if nccl(x, grp):
        order = sorted(ranks)   # the group's own rank order
        out = [torch.empty_like(chunks[me]) for _ in range(n)]
        dist.all_to_all(out, [chunks[ranks.index(r)] for r in order], group=grp)
        return torch.cat([out[order.index(r)] for r in ranks], dim=concat_dim)
    # gloo's all_to_all (where it has one) copies through one buffer: non-blocking sends and
    # receives with every peer instead, received into their place in the result (through the
    # host for CUDA memory, which gloo's send and receive do not take)
    chunks = [to_wire(c) for c in chunks]
    shape = list(chunks[me].shape)
    shape[concat_dim] *= n
    out = chunks[me].new_empty(shape)
    slots = out.chunk(n, concat_dim)
    received = [s if s.is_contiguous() else torch.empty_like(chunks[me]) for s in slots]
    slots[me].copy_(chunks[me])
    ops = []
    for i, peer in enumerate(ranks):
        if i != me:
            ops.append(dist.P2POp(dist.isend, chunks[i], peer, grp))
            ops.append(dist.P2POp(dist.irecv, received[i], peer, grp))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for i, (slot, got) in enumerate(zip(slots, received)):
        if i != me and got is not slot:
            slot.copy_(got)
    return out.to(x.device)


# ---------------------------------------------------------------- autograd functions

class AllReduce(Function):
    """V -> R by summing; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, ranks):
        return _all_reduce(x, ranks)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllReduceInPlace(Function):
    """V -> R by summing into the partial value itself; the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, ranks):
        ctx.mark_dirty(x)
        dist.all_reduce(x, group=group(ranks))
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class IdentityAllReduce(Function):
    """Identity forward, all-reduce backward (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, ranks):
        ctx.ranks = ranks
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.ranks), None


class AllGather(Function):
    """D(dim) -> R by concatenation; backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x, ranks, dim):
        ctx.args = (ranks, dim)
        return _all_gather(x, ranks, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, *ctx.args), None, None


class AllGatherKeep(AllGather):
    """D(dim) -> R by concatenation, for readers whose gradient is already complete (R):
    the backward keeps this rank's chunk."""

    @staticmethod
    def backward(ctx, grad):
        ranks, dim = ctx.args
        return _chunk(grad, ranks, dim), None, None


class ReduceScatter(Function):
    """V -> D(dim): sum, keep this rank's chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, ranks, dim):
        ctx.args = (ranks, dim)
        return _reduce_scatter(x, ranks, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None


class AllToAll(Function):
    """D(concat_dim) -> D(split_dim); backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, ranks, split_dim, concat_dim):
        ctx.args = (ranks, concat_dim, split_dim)
        return all_to_all_data(x, ranks, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_data(grad, *ctx.args), None, None, None


class Chunk(Function):
    """R -> D(dim): keep this rank's chunk; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, ranks, dim):
        ctx.args = (ranks, dim)
        return _chunk(x, ranks, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, *ctx.args), None, None


_CHECKED: dict = {}   # rank tuples as generated code passes them -> checked (a literal per call site)


def _ranks(ranks: Sequence[int]) -> Ranks:
    got = _CHECKED.get(ranks) if type(ranks) is tuple else None
    if got is not None:
        return got
    checked = tuple(int(r) for r in ranks)
    if len(set(checked)) != len(checked):
        raise ValueError(f"duplicate ranks in {checked}")
    if type(ranks) is tuple and len(_CHECKED) < 65536:
        _CHECKED[ranks] = checked
    return checked


def _recorded(x: torch.Tensor) -> bool:
    """Whether autograd records an op on ``x``; where it does not, the primitives call the
    collective itself (the same result, without an autograd node's cost: a forward under
    ``torch.no_grad()``, a value nothing differentiates)."""
    return x.requires_grad and torch.is_grad_enabled()


@outside_graph
def all_reduce(x: torch.Tensor, ranks: Sequence[int], inplace: bool = False) -> torch.Tensor:
    """Sums partial values over ``ranks`` (V -> R); the backward is the identity.

    Args:
        x: this rank's partial value.
        ranks: the global ranks holding the partial values.
        inplace: sum into ``x`` itself (no copy). Only for a value nothing reads afterwards
            and whose maker's backward does not need it (the generated code decides).

    Returns:
        The sum, on every rank of ``ranks``.
    """
    ranks = _ranks(ranks)
    if len(ranks) == 1:
        return x
    if inplace and x.is_contiguous() and not x._is_view():
        if not _recorded(x):
            dist.all_reduce(x, group=group(ranks))
            return x
        return AllReduceInPlace.apply(x, ranks)
    return AllReduce.apply(x, ranks) if _recorded(x) else _all_reduce(x, ranks)


class PendingSum:
    """A sum started by :func:`sum_async`; ``wait()`` returns it."""

    def __init__(self, value: torch.Tensor, work):
        self.value, self.work = value, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.value


@outside_graph
def sum_async(x: torch.Tensor, ranks: Sequence[int]) -> PendingSum:
    """Starts summing ``x`` (detached) over ``ranks``; no autograd. For values only reported,
    such as the loss whose backward starts from each rank's part."""
    ranks = _ranks(ranks)
    value = _own(x.detach())
    if len(ranks) == 1:
        return PendingSum(value, None)
    _index(ranks)
    return PendingSum(value, dist.all_reduce(value, group=group(ranks), async_op=True))


@outside_graph
def identity_fw_all_reduce_bw(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    """Returns ``x``; the backward sums the (partial) gradients over ``ranks``.

    Args:
        x: a replicated value.
        ranks: the global ranks holding the replicas.

    Returns:
        ``x``, as a new autograd node.
    """
    ranks = _ranks(ranks)
    return x if len(ranks) == 1 or not _recorded(x) else IdentityAllReduce.apply(x, ranks)


@outside_graph
def all_gather(x: torch.Tensor, ranks: Sequence[int], dim: int, grad: str = "V") -> torch.Tensor:
    """Concatenates the pieces along ``dim`` in rank order (D -> R).

    Args:
        x: this rank's piece.
        ranks: the global ranks holding the pieces, in piece order.
        dim: the dim the pieces are split along.
        grad: the layout of the gradient backward receives: ``"V"`` (partial
            sums: backward reduce-scatters) or ``"R"`` (complete on every rank:
            backward keeps this rank's chunk).

    Returns:
        The whole tensor.
    """
    ranks = _ranks(ranks)
    if grad not in ("V", "R"):
        raise ValueError(f"all_gather: grad must be 'V' or 'R', got {grad!r}")
    if len(ranks) == 1:
        return x
    if not _recorded(x):
        return _all_gather(x, ranks, dim)
    return (AllGather if grad == "V" else AllGatherKeep).apply(x, ranks, dim)


@outside_graph
def reduce_scatter(x: torch.Tensor, ranks: Sequence[int], dim: int) -> torch.Tensor:
    """Sums partial values and keeps this rank's chunk along ``dim`` (V -> D).

    Args:
        x: this rank's partial value; ``x.shape[dim]`` divisible by ``len(ranks)``.
        ranks: the global ranks holding the partial values, in chunk order.
        dim: the dim to split the sum along.

    Returns:
        This rank's chunk of the sum; the backward all-gathers the gradient.
    """
    ranks = _ranks(ranks)
    if len(ranks) == 1:
        return x
    return ReduceScatter.apply(x, ranks, dim) if _recorded(x) else _reduce_scatter(x, ranks, dim)


@outside_graph
def all_to_all(x: torch.Tensor, ranks: Sequence[int], split_dim: int, concat_dim: int) -> torch.Tensor:
    """Sends chunk ``i`` of ``x`` along ``split_dim`` to ``ranks[i]`` and
    concatenates the chunks received along ``concat_dim`` in rank order.

    Args:
        x: this rank's piece along ``concat_dim``; ``x.shape[split_dim]``
            divisible by ``len(ranks)``.
        ranks: the global ranks holding the pieces, in piece order.
        split_dim: the dim the result is split along.
        concat_dim: the dim ``x`` is split along.

    Returns:
        This rank's piece along ``split_dim``; the backward is the reverse all-to-all.
    """
    ranks = _ranks(ranks)
    if len(ranks) == 1:
        return x
    return AllToAll.apply(x, ranks, split_dim, concat_dim) if _recorded(x) else \
        all_to_all_data(x, ranks, split_dim, concat_dim)


@outside_graph
def chunk(x: torch.Tensor, ranks: Sequence[int], dim: int) -> torch.Tensor:
    """Keeps this rank's chunk of a replicated tensor along ``dim`` (R -> D).

    Args:
        x: the replicated tensor; ``x.shape[dim]`` divisible by ``len(ranks)``.
        ranks: the global ranks holding the replicas, in chunk order.
        dim: the dim to split along.

    Returns:
        Chunk ``ranks.index(rank)``; the backward all-gathers the gradient.
    """
    ranks = _ranks(ranks)
    if len(ranks) == 1:
        return x
    return Chunk.apply(x, ranks, dim) if _recorded(x) else _chunk(x, ranks, dim)


# ---------------------------------------------------------------- regions (point-to-point exchange)

def box_index(part) -> Tuple[slice, ...]:
    """The index (slices) of the box ``part`` (``((start, stop), ...)`` per dim)."""
    try:
        index = _INDEX.get(part)
    except TypeError:   # lists: not kept
        return tuple(slice(s, e) for s, e in part)
    if index is None:   # a plan's parts are few and fixed: each made into an index once
        if len(_INDEX) >= _INDEX_MAX:   # a process that compiles plan after plan (the fuzzer)
            _INDEX.clear()
        index = _INDEX[part] = tuple(slice(s, e) for s, e in part)
    return index


def region(x: torch.Tensor, part) -> torch.Tensor:
    """The box ``part`` (``((start, stop), ...)`` per dim, relative to ``x``) of ``x``: a view."""
    return x[box_index(part)]


def assemble(values: Sequence[torch.Tensor], parts, shape: Sequence[int]) -> torch.Tensor:
    """Adds each of ``values`` into its box ``parts[i]`` of a zero tensor of ``shape``.

    The regions of one partial-sum term tile the result, so placing the regions
    and summing the terms is one pass; the gradient of each value is its box of
    the result's gradient (the adjoint).
    """
    shape = tuple(shape)
    boxes = [box_index(part) for part in parts]
    # the first term's regions tile the result: written once (no zeros to add them to); the
    # other terms' regions are added to it
    first, volume, total = 0, 0, 1
    for d in shape:
        total *= d
    while first < len(parts) and volume < total and not any(
            _overlap(parts[first], parts[k]) for k in range(first)):
        volume += _numel(parts[first])
        first += 1
    if volume != total:
        first = 0
    out = values[0].new_empty(shape) if first else values[0].new_zeros(shape)
    for i, (v, box) in enumerate(zip(values, boxes)):
        if i < first:
            out[box] = v
        else:
            out[box] += v
    return out


def _numel(part) -> int:
    n = 1
    for s, e in part:
        n *= max(0, e - s)
    return n


def _overlap(a, b) -> bool:
    return all(max(s0, s1) < min(e0, e1) for (s0, e0), (s1, e1) in zip(a, b))


# ---------------------------------------------------------------- point to point

class SendForward(Function):
    """On ``src``: sends ``x`` to ``dst`` and returns an empty marker; backward receives the gradient."""

    @staticmethod
    def forward(ctx, x, dst):
        ctx.dst, ctx.shape, ctx.dtype, ctx.device = dst, x.shape, x.dtype, x.device
        dist.send(to_wire(x), dst)
        return x.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):
        grad = torch.empty(ctx.shape, dtype=ctx.dtype, device=wire(ctx.device))
        dist.recv(grad, ctx.dst)
        return grad.to(ctx.device), None


class RecvForward(Function):
    """On ``dst``: receives from ``src``; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, anchor, src, shape, dtype):
        ctx.src = src
        y = torch.empty(shape, dtype=dtype, device=wire(anchor.device))
        dist.recv(y, src)
        return y.to(anchor.device)

    @staticmethod
    def backward(ctx, grad):
        dist.send(to_wire(grad), ctx.src)
        return None, None, None, None


@outside_graph
def p2p_shift(x: Optional[torch.Tensor], src: int, dst: int, shape: Sequence[int], dtype: torch.dtype,
              device: Optional[torch.device] = None) -> torch.Tensor:
    """Moves ``x`` from rank ``src`` to rank ``dst``; both ranks call it.

    On ``src`` it sends ``x`` and returns an empty *marker* tensor; on ``dst``
    it returns the received tensor (``x`` is ignored there and may be None).
    The gradient travels back from ``dst`` to ``src``, and both sides block in
    backward until the other side arrives, so callers must make sure that:

    * on ``src``, ``x`` requires grad exactly when ``dst``'s result will get a
      gradient, and the marker reaches the backward pass: add ``marker.sum()``
      (which is 0) to the loss, or pass the marker to ``torch.autograd.backward``
      (its gradient may be ``torch.empty(0)``); a marker left unused means the
      gradient of ``x`` is never received and ``dst`` blocks;
    * on ``dst``, the backward runs through the result: ``loss.backward()`` or
      ``torch.autograd.backward`` does; ``torch.autograd.grad`` with ``inputs``
      that are not upstream of the result skips it and ``src`` blocks.

    Args:
        x: the tensor to send (on ``src``).
        src: the sending global rank.
        dst: the receiving global rank.
        shape: the shape of ``x``.
        dtype: the dtype of ``x``.
        device: where ``dst`` puts the result; by default ``x``'s device, else
            the current CUDA device under NCCL, else the CPU.

    Returns:
        The marker on ``src``, the received tensor on ``dst``; ``x`` when ``src == dst``.
    """
    if src == dst:
        return x
    rank = dist.get_rank()
    if rank == src:
        return SendForward.apply(x, dst)
    if rank != dst:
        raise ValueError(f"rank {rank} is neither src {src} nor dst {dst}")
    if device is None:
        if x is not None:
            device = x.device
        elif "nccl" in str(dist.get_backend()):
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    anchor = torch.empty(0, dtype=dtype, device=device, requires_grad=dtype.is_floating_point)
    return RecvForward.apply(anchor, src, tuple(shape), dtype)
