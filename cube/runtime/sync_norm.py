"""Batch norm over a tensor split along its batch or spatial dims: statistics of the whole.

Each piece sums its elements, their squares and their count per channel (in
double precision, so ``E[x^2] - E[x]^2`` loses nothing a float32 batch norm
keeps); one all-reduce over the pieces' group makes the global sums, from
which every piece normalizes its block and updates the running statistics
exactly as the single-device module does. The all-reduce's adjoint is an
all-reduce of the gradients of the sums, so backward is exact too.
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
