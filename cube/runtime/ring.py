"""Ring attention: ``scaled_dot_product_attention`` on a sequence split over a ring of ranks.

Each rank of a split group holds one block of the sequence of the query, the
key and the value (self-attention: one layout for all three). :func:`attention`
computes this rank's block of the output without ever holding the whole key or
value: the key/value blocks travel around the ring (rank ``p`` sends to
``p + 1`` and receives from ``p - 1``), the next block in flight while the
current one's attention is computed, and the partial outputs are merged with
their log-sum-exp (online softmax). Backward passes the key/value blocks around
once more; the gradient of each key/value block travels with it, collecting
every rank's contribution, and arrives back at its owner after ``n`` hops.

Under a causal mask the blocks are first put in zigzag order (``cube.ir.ring``:
rank ``p`` holds sequence chunks ``p`` and ``2n - 1 - p`` of ``2n``), so every
rank computes the same number of unmasked chunk pairs; the output goes back to
the contiguous layout the rest of the model uses. Both moves are one
point-to-point exchange (:class:`Rechunk`), whose adjoint is the reverse move.

Chunk pairs are computed with matmul and softmax in (at least) float32, exactly
the math of ``F.scaled_dot_product_attention``; a pair wholly in the future of
its queries is skipped.

A mask tensor's rows stay with their queries (each rank holds its block of rows
over every key; under zigzag its rows move along with the queries). An
additive float mask may need a gradient (T5's learned position bias): the
gradient of a chunk pair's scores is the gradient of the mask's entries it
read, so backward fills this rank's rows of ``d(mask)`` key block by key block
(summed over the dims the mask broadcasts), in float32 like the rest.
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.ir import ring as geometry
from cube.runtime.collectives import to_wire, wire
from cube.runtime.compiled import outside_graph

# key/value blocks, their gradients and re-chunked blocks travel under their own tags, so messages
# of two exchanges in flight between one pair of ranks never match each other
TAG_KV, TAG_GRAD, TAG_CHUNK = 0x5249, 0x5247, 0x5243


@outside_graph
def _post(sends: Sequence[Tuple[int, torch.Tensor]], recvs: Sequence[Tuple[int, torch.Tensor]], tag: int) -> tuple:
    """Starts every send and receive at once; returns what to wait on: the works, and the tensors
    they read and write (kept alive until the wait: a send may still be reading a temporary)."""
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for peer, t in recvs]
    return (dist.batch_isend_irecv(ops) if ops else [], ops)


@outside_graph
def _wait(pending: tuple) -> None:
    for w in pending[0] if pending else ():
        w.wait()


def _out(t: torch.Tensor) -> torch.Tensor:
    return to_wire(t)


def _in(like: torch.Tensor) -> torch.Tensor:
    return torch.empty(like.shape, dtype=like.dtype, device=wire(like.device))


def _shift(tensors: Sequence[torch.Tensor], nxt: int, prv: int, tag: int) -> Tuple[tuple, List[torch.Tensor]]:
    """Sends ``tensors`` to ``nxt`` and receives tensors of the same shapes from ``prv``
    (started, not waited on)."""
    bufs = [_in(t) for t in tensors]
    return _post([(nxt, _out(t)) for t in tensors], [(prv, b) for b in bufs], tag), bufs


# ---------------------------------------------------------------------------------------------- blocks
def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Key/value heads repeated for grouped-query attention (as ``enable_gqa=True`` does)."""
    g = heads // kv.shape[-3]
    return kv if g == 1 else kv.repeat_interleave(g, dim=-3)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The adjoint of :func:`_heads`: the gradients of a group's repeated heads summed."""
    g = grad.shape[-3] // kv_heads
    if g == 1:
        return grad
    return grad.unflatten(-3, (kv_heads, g)).sum(-3)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with rows that see no key (-inf) at 0, so ``exp(scores - lse)`` is 0 there, not NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _mask_block(mask: Optional[torch.Tensor], i: int, m: int, kc: int, cols: int) -> Optional[torch.Tensor]:
    """The mask's part for this rank's query chunk ``i`` (of ``m``) and key chunk ``kc`` (``cols``
    columns each; dims of size 1 broadcast)."""
    if mask is None:
        return None
    rows = mask if mask.shape[-2] == 1 else mask.chunk(m, dim=-2)[i]
    return rows if rows.shape[-1] == 1 else rows[..., kc * cols:(kc + 1) * cols]


def _mask_grad(mask: Optional[torch.Tensor], dt: torch.dtype, need: bool) -> Optional[torch.Tensor]:
    """Zeros for this rank's rows of the mask's gradient (in ``dt``), or None when it needs none."""
    if mask is None or not need:
        return None
    return torch.zeros(mask.shape, dtype=dt, device=mask.device)


def _add_mask_grad(dmask: torch.Tensor, ds: torch.Tensor, i: int, m: int, kc: int, cols: int) -> None:
    """Adds a chunk pair's score gradient ``ds`` to the mask entries it read (:func:`_mask_block`'s
    block of ``dmask``), summed over the dims the mask broadcasts."""
    block = _mask_block(dmask, i, m, kc, cols)
    lead = ds.ndim - block.ndim
    g = ds.sum(dim=tuple(range(lead))) if lead else ds
    dims = tuple(d for d in range(block.ndim) if block.shape[d] == 1 and g.shape[d] != 1)
    block.add_(g.sum(dim=dims, keepdim=True) if dims else g)


def _scores(q, k, scale, kind, mask):
    """Scaled scores of a query chunk against a key chunk, the causal triangle (``kind="diag"``)
    and the mask applied; None when the mask hides every pair (the chunk pair is skipped)."""
    if mask is not None and not (mask.any() if mask.dtype == torch.bool else (mask != float("-inf")).any()):
        return None
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if kind == "diag":
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    return s


def _merge(acc, out, lse):
    """Online softmax: two partial outputs over disjoint keys, weighted by their log-sum-exps
    (rows no key reached so far stay 0 with lse -inf)."""
    o0, l0 = acc
    m = torch.logaddexp(l0, lse)
    f = _finite(m)
    return o0 * torch.exp(l0 - f).unsqueeze(-1) + out * torch.exp(lse - f).unsqueeze(-1), m


def _pairs(layout, pos: int, src: int, causal: bool):
    """``(i, j, kc, kind)`` for the chunk pairs of this rank's queries and ``src``'s keys to compute."""
    for i, qc in enumerate(layout[pos]):
        for j, kc in enumerate(layout[src]):
            kind = geometry.pair(qc, kc, causal)
            if kind != "skip":
                yield i, j, kc, kind


class _Ring(Function):
    """The ring on blocks already in ``layout`` order (chunk ids of every position); ``mask``: this
    rank's rows of an attention mask over every key (broadcast dims of size 1)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, ranks, pos, layout, causal, scale):
        n, m = len(ranks), len(layout[pos])
        nxt, prv = ranks[(pos + 1) % n], ranks[(pos - 1) % n]
        dt, heads, cols = _acc(q.dtype), q.shape[-3], k.shape[-2] // m
        qs = q.to(dt).chunk(m, dim=-2)
        accs = [(x.new_zeros(x.shape[:-1] + v.shape[-1:]), x.new_full(x.shape[:-1], float("-inf"))) for x in qs]
        kk, vv = k, v
        for s in range(n):
            src = (pos - s) % n
            works, bufs = _shift((kk, vv), nxt, prv, TAG_KV) if s < n - 1 else ((), None)
            ks, vs = _heads(kk.to(dt), heads).chunk(m, dim=-2), _heads(vv.to(dt), heads).chunk(m, dim=-2)
            for i, j, kc, kind in _pairs(layout, pos, src, causal):
                sc = _scores(qs[i], ks[j], scale, kind, _mask_block(mask, i, m, kc, cols))
                if sc is None:
                    continue
                lse = torch.logsumexp(sc, dim=-1)
                accs[i] = _merge(accs[i], torch.matmul(torch.exp(sc - _finite(lse).unsqueeze(-1)), vs[j]), lse)
            _wait(works)
            if bufs is not None:
                kk, vv = (b.to(k.device) for b in bufs)
        out = torch.cat([a[0] for a in accs], dim=-2)
        lse = torch.cat([a[1] for a in accs], dim=-1)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.args = (ranks, pos, layout, causal, scale)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse = ctx.saved_tensors
        ranks, pos, layout, causal, scale = ctx.args
        n, m = len(ranks), len(layout[pos])
        nxt, prv = ranks[(pos + 1) % n], ranks[(pos - 1) % n]
        dt, heads, cols = out.dtype, q.shape[-3], k.shape[-2] // m
        qs, dos = q.to(dt).chunk(m, dim=-2), dout.to(dt).chunk(m, dim=-2)
        lses = _finite(lse).chunk(m, dim=-1)
        deltas = (dout.to(dt) * out).sum(-1).chunk(m, dim=-1)   # rowsum(dO * O): softmax's backward
        dq = [torch.zeros_like(x) for x in qs]
        dmask = _mask_grad(mask, dt, ctx.needs_input_grad[3])
        kk, vv = k, v
        grad_works, grad_bufs = (), None
        for s in range(n):
            src = (pos - s) % n
            works, bufs = _shift((kk, vv), nxt, prv, TAG_KV) if s < n - 1 else ((), None)
            ke, ve = _heads(kk.to(dt), heads), _heads(vv.to(dt), heads)
            ks, vs = ke.chunk(m, dim=-2), ve.chunk(m, dim=-2)
            dk, dv = torch.zeros_like(ke), torch.zeros_like(ve)
            dks, dvs = dk.chunk(m, dim=-2), dv.chunk(m, dim=-2)
            for i, j, kc, kind in _pairs(layout, pos, src, causal):
                sc = _scores(qs[i], ks[j], scale, kind, _mask_block(mask, i, m, kc, cols))
                if sc is None:
                    continue
                p = torch.exp(sc - lses[i].unsqueeze(-1))
                dvs[j].add_(torch.matmul(p.transpose(-2, -1), dos[i]))
                ds = p * (torch.matmul(dos[i], vs[j].transpose(-2, -1)) - deltas[i].unsqueeze(-1))
                if dmask is not None:   # the scores' gradient is the gradient of the mask entries added
                    _add_mask_grad(dmask, ds, i, m, kc, cols)
                dq[i].add_(torch.matmul(ds, ks[j]) * scale)
                dks[j].add_(torch.matmul(ds.transpose(-2, -1), qs[i]) * scale)
            dk, dv = _fold(dk, k.shape[-3]), _fold(dv, v.shape[-3])
            # the gradients of this key/value block so far came from the previous rank meanwhile
            _wait(grad_works)
            if grad_bufs is not None:
                dk, dv = dk + grad_bufs[0].to(dk.device), dv + grad_bufs[1].to(dv.device)
            grad_works, grad_bufs = _shift((dk, dv), nxt, prv, TAG_GRAD)
            _wait(works)
            if bufs is not None:
                kk, vv = (b.to(k.device) for b in bufs)
        _wait(grad_works)   # after n hops: this rank's own block, with every rank's contribution
        dk, dv = grad_bufs[0].to(k.device), grad_bufs[1].to(v.device)
        dmask = None if dmask is None else dmask.to(mask.dtype)
        return (torch.cat(dq, dim=-2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dmask) + (None,) * 5


# ---------------------------------------------------------------------------------------------- layouts
def _move(xs: Sequence[torch.Tensor], ranks, pos: int, src: geometry.Layout, dst: geometry.Layout) -> list:
    """Each of ``xs`` (rows in ``src`` order along dim -2) in ``dst`` order: chunks sent to the
    position that holds them in ``dst``, in chunk-id order on both sides of a pair."""
    to, frm = geometry.owner(dst), geometry.owner(src)
    sends, recvs, parts = [], [], []
    for x in xs:
        pieces = dict(zip(src[pos], x.chunk(len(src[pos]), dim=-2)))
        for c in sorted(src[pos]):
            if to[c][0] != pos:
                sends.append((ranks[to[c][0]], _out(pieces[c])))
        got = {}
        for c in sorted(dst[pos]):
            q = frm[c][0]
            if q == pos:
                got[c] = pieces[c]
            else:
                got[c] = _in(pieces[src[pos][0]])
                recvs.append((ranks[q], got[c]))
        parts.append((x, got))
    _wait(_post(sends, recvs, TAG_CHUNK))
    return [torch.cat([got[c].to(x.device) for c in dst[pos]], dim=-2) for x, got in parts]


class Rechunk(Function):
    """Blocks of ``xs`` from chunk layout ``src`` to ``dst`` along dim -2; backward moves the
    gradients back."""

    @staticmethod
    def forward(ctx, ranks, pos, src, dst, *xs):
        ctx.args = (ranks, pos, src, dst)
        return tuple(_move(xs, ranks, pos, src, dst))

    @staticmethod
    def backward(ctx, *grads):
        ranks, pos, src, dst = ctx.args
        return (None, None, None, None) + tuple(_move(grads, ranks, pos, dst, src))


def _rows_to(mask: torch.Tensor, ranks, pos: int, src: geometry.Layout, dst: geometry.Layout) -> torch.Tensor:
    """A mask's rows moved along with their queries: a move of its own, so its gradient moves back
    only when it needs one; a boolean mask travels as bytes (not every backend sends bool)."""
    if mask.dtype == torch.bool:
        return _move([mask.view(torch.uint8)], ranks, pos, src, dst)[0].view(torch.bool)
    return Rechunk.apply(ranks, pos, src, dst, mask)[0]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None, *,
              ranks: Sequence[int], pos: int, causal: bool = False, scale: Optional[float] = None,
              balance: bool = True) -> torch.Tensor:
    """This rank's block of ``F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal,
    scale=scale)`` over the whole sequence, ``q``, ``k``, ``v`` each holding block ``pos`` (dim -2)
    of ``len(ranks)``.

    Args:
        q: ``(..., H, L/n, E)``; k: ``(..., Hkv, L/n, E)``; v: ``(..., Hkv, L/n, Ev)``, ``H`` a
            multiple of ``Hkv`` (grouped-query attention).
        mask: this rank's rows of a boolean (True: attend) or additive mask over every key,
            ``(..., L/n, L)`` (dims of size 1 broadcast); chunk pairs it hides wholly are skipped,
            but its blocks stay contiguous (cube cannot tell a causal mask tensor from another).
            An additive mask that requires grad gets its rows' gradient; under ``causal`` with
            ``balance`` its rows go to zigzag order with the queries (and their gradient back).
        ranks: the ring's ranks in block order.
        pos: this rank's block.
        balance: under ``causal``, compute in zigzag order (equal work on every rank) at the cost
            of moving the blocks there and back.
    """
    n = len(ranks)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ranks = tuple(ranks)
    if not causal and (mask is None or q.shape[-2] % 2):
        return _Ring.apply(q, k, v, mask, ranks, pos, geometry.blocks(n), causal, scale)
    home = geometry.contiguous(n)   # halves of a block: the masked half of the diagonal is skipped
    if causal and balance and n > 1:
        zig = geometry.zigzag(n)
        q, k, v = Rechunk.apply(ranks, pos, home, zig, q, k, v)
        if mask is not None and mask.shape[-2] != 1:
            mask = _rows_to(mask, ranks, pos, home, zig)
        out = _Ring.apply(q, k, v, mask, ranks, pos, zig, causal, scale)
        return Rechunk.apply(ranks, pos, zig, home, out)[0]
    return _Ring.apply(q, k, v, mask, ranks, pos, home, causal, scale)
