"""Gradient sums of parameters held whole (or in equal pieces) on several ranks.

Parameters are packed into buckets (same ranks, same dtype, up to
``bucket_bytes``) in the order their gradients become ready, which is roughly
the reverse of their first use in forward. When the last gradient of a bucket
is accumulated, the bucket is flattened and all-reduced asynchronously, so the
communication overlaps the rest of backward, as DDP does. ``finish`` waits for
the buckets and writes the sums back into ``.grad``.

Under the main-parameter recipe (``cube.runtime.amp.MainParams`` sets ``main``) the buckets sum
the float32 main gradients (``param.main_grad``; a low-precision ``.grad`` is widened first) and
the sums go back to ``main_grad``; ``on_grad`` runs first in each gradient hook (the main
gradient's accumulation).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cube import config
from cube.runtime.collectives import group, nccl, reduce_scatter_single

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024   # a small first bucket starts communication early (as DDP does)


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], ranks: Tuple[int, ...], main: bool = False):
        self.params = params
        self.ranks = ranks
        self.dtype = params[0].dtype   # the gradients' sum (float32 main gradients under the main recipe)
        self.main = main
        self.ready = 0
        self.work = None
        self.flat = None
        self.shard = None       # a ZeRO optimizer's chunk of this bucket (cube.runtime.zero)
        self.keep_full = True   # ZeRO-1 keeps the full gradients, ZeRO-2/3 only the chunk

    def launch(self) -> None:
        grads = [self._grad(p) for p in self.params]
        self.flat = _flatten_dense_tensors(grads)
        grp = group(self.ranks)
        if self.shard is not None and not self.keep_full and nccl(self.flat, grp):
            # only this rank's chunk is kept: reduce-scatter (gloo has none, so all-reduce there)
            padded = torch.zeros(self.shard.padded, dtype=self.flat.dtype, device=self.flat.device)
            padded[:self.flat.numel()].copy_(self.flat)
            self.flat = torch.empty(self.shard.chunk, dtype=self.flat.dtype, device=self.flat.device)
            self.work = reduce_scatter_single(self.flat, padded, group=grp, async_op=True)
            return
        self.work = dist.all_reduce(self.flat, group=grp, async_op=True)

    def _grad(self, p: torch.nn.Parameter) -> torch.Tensor:
        g = getattr(p, "main_grad", None) if self.main else None
        if g is None:
            g = p.grad
        if g is None:
            return torch.zeros(p.shape, dtype=self.dtype, device=p.device)
        return g if g.dtype == self.dtype else g.to(self.dtype)

    def finish(self) -> None:
        if self.work is None:
            self.launch()
        self.work.wait()
        if self.shard is not None:
            self.shard.take_gradient(self.flat, self.keep_full)
        if self.shard is None or self.keep_full:
            for p, g in zip(self.params, _unflatten_dense_tensors(self.flat, self.params)):
                if self.main:   # the float32 sum is the main gradient; the low-precision one is spent
                    p.main_grad, p.grad = g, None
                else:
                    p.grad = g   # a view of the summed bucket: no copy back
        self.ready, self.work, self.flat = 0, None, None


class Reducer:
    """Sums gradients over ranks in buckets, overlapped with backward.

    Args:
        entries: ``(parameter, ranks)`` in the order their gradients are expected
            to be ready; every rank of ``ranks`` lists its matching parameters
            in the same order with the same shapes.
        bucket_bytes: the size at which a bucket is closed (default ``CUBE_BUCKET_MB`` or 25 MiB).
        after: parameters summed only by ``finish``, in buckets of their own placed after the
            others: their gradients are ready at different points of backward on different
            ranks of the group, where a sum launched from backward could meet another collective.
    """

    def __init__(self, entries: Sequence[Tuple[torch.nn.Parameter, Tuple[int, ...]]],
                 bucket_bytes: int = 0, first_bucket_bytes: int = 0,
                 after: Sequence[torch.nn.Parameter] = ()):
        bucket_bytes = bucket_bytes or config.bucket_bytes(DEFAULT_BUCKET_BYTES)
        first_bucket_bytes = first_bucket_bytes or min(bucket_bytes, FIRST_BUCKET_BYTES)
        self.buckets: List[_Bucket] = []
        self._of: Dict[int, _Bucket] = {}
        open_: Dict[tuple, Tuple[List[torch.nn.Parameter], int]] = {}
        late = {id(p) for p in after}
        for p, ranks in entries:
            if len(ranks) < 2:
                continue
            key = (tuple(ranks), p.dtype, p.device, id(p) in late)
            params, size = open_.get(key, ([], 0))
            params.append(p)
            size += p.numel() * p.element_size()
            cap = first_bucket_bytes if not any(b.ranks == key[0] for b in self.buckets) else bucket_bytes
            if size >= cap:
                self._close(params, key[0])
                open_.pop(key, None)
            else:
                open_[key] = (params, size)
        for key, (params, _) in open_.items():
            self._close(params, key[0])
        order = {id(p): i for i, (p, _) in enumerate(entries)}
        self.buckets.sort(key=lambda b: (id(b.params[0]) in late, min(order[id(p)] for p in b.params)))
        self._hooked = len([b for b in self.buckets if id(b.params[0]) not in late])
        self._next = 0   # buckets launch in this order on every rank, so collectives match
        self._held = False
        self.on_grad = None   # called first in each gradient hook (cube.runtime.amp.MainParams)
        for b in self.buckets[:self._hooked]:
            for p in b.params:
                p.register_post_accumulate_grad_hook(self._hook)

    @property
    def main(self) -> bool:
        """Whether the buckets sum float32 main gradients (``param.main_grad``)."""
        return any(b.main for b in self.buckets)

    @main.setter
    def main(self, value: bool) -> None:
        for b in self.buckets:
            b.main = value

    def hooked(self) -> set:
        """Ids of the parameters whose gradient hook is this reducer's."""
        return {id(p) for b in self.buckets[:self._hooked] for p in b.params}

    def _close(self, params: List[torch.nn.Parameter], ranks: Tuple[int, ...]) -> None:
        b = _Bucket(list(params), ranks)
        self.buckets.append(b)
        for p in params:
            self._of[id(p)] = b

    def hold(self) -> None:
        """Launches nothing from hooks until ``finish`` (gradients accumulate over micro-batches)."""
        self._held = True

    def _hook(self, p: torch.nn.Parameter) -> None:
        if self.on_grad is not None:
            self.on_grad(p)
        if self._held:
            return
        b = self._of[id(p)]
        b.ready += 1
        while self._next < self._hooked:
            nxt = self.buckets[self._next]
            if nxt.ready < len(nxt.params):
                break
            nxt.launch()
            self._next += 1

    def finish(self) -> None:
        """Waits for every bucket (launching those not yet ready, in order) and stores the sums."""
        for b in self.buckets:
            b.finish()
        self._next = 0
        self._held = False
