"""Batch, group and instance norm over a tensor split along its batch or spatial dims:
statistics of the whole.

Each piece sums its elements, their squares and their count per channel (in
double precision, so ``E[x^2] - E[x]^2`` loses nothing a float32 batch norm
keeps); one all-reduce over the pieces' group makes the global sums, from
which every piece normalizes its block and updates the running statistics
exactly as the single-device module does. The all-reduce's adjoint is an
all-reduce of the gradients of the sums, so backward is exact too.

Group and instance norm sum per sample and group (an instance norm's group is one
channel) over the pieces of the sample's spatial dims. Each piece writes its
samples' sums into their rows of a ``(batch, groups, 3)`` table of the whole
batch (zeros elsewhere), so one all-reduce serves a group split along the batch
too: an instance norm's running statistics average over every sample.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Function

from cube.runtime.collectives import group
from cube.runtime.compiled import outside_graph


@outside_graph
def _sum(x: torch.Tensor, ranks: Sequence[int]) -> torch.Tensor:
    x = x.clone()
    dist.all_reduce(x, group=group(tuple(ranks)))
    return x


class _SumOver(Function):
    """Sums a value over ``ranks``, each of which reads the sum: backward sums the gradients."""

    @staticmethod
    def forward(ctx, x, ranks):
        ctx.ranks = ranks
        return _sum(x, ranks)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad.contiguous(), ctx.ranks), None


def batch_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor], training: bool,
               momentum: float, eps: float, cudnn_enabled: bool = True, ranks: Sequence[int] = ()
               ) -> torch.Tensor:
    """``aten.batch_norm`` on this rank's piece with the statistics of all pieces of ``ranks``."""
    if not training or len(ranks) < 2:
        return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, training,
                                                 momentum, eps, cudnn_enabled)
    dims = [0] + list(range(2, x.dim()))
    xd = x.double()
    local = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                       xd.new_full((1,), float(x.numel() // x.shape[1]))])
    total = _SumOver.apply(local, tuple(ranks))
    c = x.shape[1]
    count = total[2 * c]
    mean = total[:c] / count
    var = (total[c:2 * c] / count - mean * mean).clamp_min(0)
    shape = [1, c] + [1] * (x.dim() - 2)
    invstd = torch.rsqrt(var + eps)
    y = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if running_mean is not None:
        with torch.no_grad():
            n = count.item()
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((var * (n / max(n - 1, 1))).to(running_var.dtype), alpha=momentum)
    return y


def _moments(x: torch.Tensor, groups: int, ranks: Sequence[int], batch: Sequence[int]):
    """(mean, biased variance, count) per sample and group of the whole batch, in double:
    ``(total, groups)`` each (``batch``: this piece's first sample and the batch's size)."""
    start, total = batch
    n = x.shape[0]
    xd = x.double().reshape(n, groups, -1)
    local = torch.stack([xd.sum(2), (xd * xd).sum(2), xd.new_full((n, groups), float(xd.shape[2]))], 2)
    local = torch.nn.functional.pad(local, (0, 0, 0, 0, start, total - start - n))
    sums = _SumOver.apply(local, tuple(ranks))
    count = sums[..., 2]
    mean = sums[..., 0] / count
    return mean, (sums[..., 1] / count - mean * mean).clamp_min(0), count


def _normalize(x, mean, var, eps, groups, weight, bias):
    n = x.shape[0]
    shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
    xg = x.reshape(n, groups, -1)
    y = ((xg - mean.to(x.dtype).unsqueeze(2)) * torch.rsqrt(var + eps).to(x.dtype).unsqueeze(2)).reshape(x.shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y


def group_norm(x: torch.Tensor, num_groups: int, weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5, cudnn_enabled: bool = True,
               ranks: Sequence[int] = (), batch: Sequence[int] = ()) -> torch.Tensor:
    """``aten.group_norm`` on this rank's piece with the statistics of each sample and group over
    all pieces of ``ranks`` (``batch``: this piece's first sample and the batch's size)."""
    if len(ranks) < 2:
        return torch.ops.aten.group_norm.default(x, num_groups, weight, bias, eps, cudnn_enabled)
    start, n = batch[0], x.shape[0]
    mean, var, _ = _moments(x, num_groups, ranks, batch)
    return _normalize(x, mean[start:start + n], var[start:start + n], eps, num_groups, weight, bias)


def instance_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                  use_input_stats: bool, momentum: float, eps: float, cudnn_enabled: bool = True,
                  ranks: Sequence[int] = (), batch: Sequence[int] = ()) -> torch.Tensor:
    """``aten.instance_norm`` on this rank's piece with the statistics of each sample and channel
    over all pieces of ``ranks``; running statistics as the single-device module updates them (the
    batch's mean of each sample's update, the variance unbiased by the sample's count)."""
    if not use_input_stats or len(ranks) < 2:
        return torch.ops.aten.instance_norm.default(x, weight, bias, running_mean, running_var, use_input_stats,
                                                    momentum, eps, cudnn_enabled)
    c, start, n = x.shape[1], batch[0], x.shape[0]
    mean, var, count = _moments(x, c, ranks, batch)
    if running_mean is not None:
        with torch.no_grad():
            k = count[0, 0].item()
            unbiased = var * (k / max(k - 1, 1))
            # ATen updates a copy of the running statistics per sample, then averages the copies
            new_mean = (running_mean.double() * (1 - momentum) + mean * momentum).mean(0)
            new_var = (running_var.double() * (1 - momentum) + unbiased * momentum).mean(0)
            running_mean.copy_(new_mean.to(running_mean.dtype))
            running_var.copy_(new_var.to(running_var.dtype))
    return _normalize(x, mean[start:start + n], var[start:start + n], eps, c, weight, bias)
