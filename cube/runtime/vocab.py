"""Vocabulary-parallel embedding lookup and cross entropy (Megatron-LM's ``VocabParallelEmbedding``
and ``vocab_parallel_cross_entropy``).

Each rank of a group holds a contiguous block of the vocabulary: ``start`` is its first row (of an
embedding table) or class (of the logits). Both functions return the value of the whole vocabulary
on every rank of the group, and each rank's gradient is that of its own block:

- ``embedding``: ids in the rank's range are looked up, the others give zeros, and one all-reduce
  sums the pieces. Every rank reads the sum whole, and cube gives each reader of a whole value the
  whole gradient, so backward is local (the all-reduce's adjoint is the identity).
- ``cross_entropy``: the logits stay split. Forward all-reduces each row's maximum, then its sum of
  exponentials together with the target's logit (and, under label smoothing, the sum of the row's
  logits); backward is ``softmax - onehot`` (smoothed) on the rank's block, with no communication.
  The statistics are in float32 whatever the logits' dtype (float64 logits: in float64).

A mean over valid targets divides by ``count`` (the global count, given by the step) or by the valid
targets of this piece summed over ``count_ranks`` (the pieces of the batch), as
``cube.runtime.ops.cross_entropy_part`` does.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.errors import CubeInternalError
from cube.runtime import collectives
from cube.runtime.compiled import outside_graph
from cube.runtime.ops import valid_count

_MEAN, _SUM = 1, 2   # ATen's reduction enum (0: none)


@outside_graph
def _reduce(x: torch.Tensor, ranks: Sequence[int], op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``x`` reduced over ``ranks`` (a new tensor; no autograd)."""
    x = x.clone(memory_format=torch.contiguous_format)
    if len(ranks) > 1:
        dist.all_reduce(x, op=op, group=collectives.group(tuple(ranks)))
    return x


def embedding(weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
              sparse: bool = False, *, ranks: Sequence[int], start: int) -> torch.Tensor:
    """``aten.embedding`` of the whole table, this rank holding its rows ``start .. start + len(weight)``."""
    rows = weight.shape[0]
    mine = (indices >= start) & (indices < start + rows)
    local = torch.where(mine, indices - start, torch.zeros_like(indices))
    pad = padding_idx - start if padding_idx >= 0 and 0 <= padding_idx - start < rows else -1
    out = torch.ops.aten.embedding.default(weight, local, pad, scale_grad_by_freq, sparse)
    # through the module: torch.compile's fence swaps collectives.all_reduce for its disabled self
    return collectives.all_reduce(out.masked_fill(~mine.unsqueeze(-1), 0), tuple(ranks))


class _VocabCrossEntropy(Function):
    """Per-row loss of logits ``(rows, block)`` whose classes ``start ..`` are this rank's block."""

    @staticmethod
    def forward(ctx, x, target, ignore_index, smoothing, ranks, start, classes):
        block = x.shape[-1]
        top = _reduce(x.detach().amax(-1), ranks, dist.ReduceOp.MAX)
        shifted = x - top.unsqueeze(-1)
        valid = target != ignore_index
        mine = (target >= start) & (target < start + block) & valid
        local = torch.where(mine, target - start, torch.zeros_like(target))
        exp = shifted.exp()
        stats = [exp.sum(-1), shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1) * mine]
        if smoothing:
            stats.append(shifted.sum(-1))
        total = _reduce(torch.stack(stats), ranks)
        lse = total[0].log()
        loss = lse - total[1]
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (lse - total[2] / classes)
        loss = loss * valid
        ctx.save_for_backward(exp.div_(total[0].unsqueeze(-1)), local, mine, valid)
        ctx.smoothing, ctx.classes = smoothing, classes
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine, valid = ctx.saved_tensors
        g = (grad * valid).unsqueeze(-1)
        out = softmax * g
        hit = -(1 - ctx.smoothing) * g * mine.unsqueeze(-1)
        out.scatter_add_(-1, local.unsqueeze(-1), hit.to(out.dtype))
        if ctx.smoothing:
            out -= ctx.smoothing / ctx.classes * g
        return out, None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
                  reduction: int = _MEAN, ignore_index: int = -100, label_smoothing: float = 0.0, *,
                  ranks: Sequence[int], start: int, classes: int, count: Optional[torch.Tensor] = None,
                  count_ranks: Sequence[int] = ()) -> torch.Tensor:
    """``aten.cross_entropy_loss`` of the whole vocabulary, this rank holding classes
    ``start .. start + logits.shape[1]`` of ``classes`` (class-index targets, no class weights:
    the annotation splits the classes only then)."""
    if weight is not None:   # the annotation keeps the classes whole under class weights
        raise CubeInternalError("a vocabulary-parallel cross entropy was planned with class weights")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))   # float32 at least: float64 stays
    x = x.movedim(1, -1) if x.dim() > 1 else x
    rows = _VocabCrossEntropy.apply(x.reshape(-1, x.shape[-1]), target.reshape(-1), ignore_index,
                                    float(label_smoothing), tuple(ranks), start, classes)
    dtype = torch.float32 if torch.is_autocast_enabled(logits.device.type) else logits.dtype
    if reduction == _SUM:
        return rows.sum().to(dtype)
    if reduction != _MEAN:
        return rows.view(target.shape).to(dtype)
    if count is None:
        count = valid_count(target, ignore_index)
        if len(count_ranks) > 1:
            count = _reduce(count, count_ranks)
    return (rows.sum() / count).to(dtype)
