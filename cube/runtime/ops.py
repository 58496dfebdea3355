"""Partial versions of mean reductions, for pieces of an op split along the reduced dims.

Each returns this piece's share of the global mean: its local sum divided by
the global count, so the shares of all pieces add up to the mean of the whole.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from cube.runtime.collectives import group
from cube.runtime.compiled import outside_graph


def mean_part(x: torch.Tensor, dims, keepdim: bool, count: int, dtype=None) -> torch.Tensor:
    """``x.sum(dims) / count``, where ``count`` is the number of elements the whole mean averages."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        s = x.sum(dtype=dtype) if not keepdim else x.sum(dim=tuple(range(x.dim())), keepdim=True, dtype=dtype)
    else:
        s = x.sum(dim=dims, keepdim=keepdim, dtype=dtype)
    return s / count


def valid_count(target: torch.Tensor, ignore_index: int = -100, weight: Optional[torch.Tensor] = None,
                dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight of the targets a mean loss averages over (their number without ``weight``),
    counted on the whole batch, so pieces of the loss need no communication for it."""
    valid = target != ignore_index
    if weight is None:
        return valid.sum().to(dtype)
    return (weight.detach()[target.clamp(min=0)] * valid).sum().to(dtype)


@outside_graph
def _start_denominator(target: torch.Tensor, weight: Optional[torch.Tensor], ignore_index: int,
                       ranks: Sequence[int], dtype: torch.dtype):
    """Starts summing the weight of the valid targets over ``ranks``; returns (value, work)."""
    local = valid_count(target, ignore_index, weight, dtype)
    if len(ranks) < 2:
        return local, None
    return local, dist.all_reduce(local, group=group(ranks), async_op=True)


def _divide(total: torch.Tensor, pending) -> torch.Tensor:
    value, work = pending
    if work is not None:
        _wait(work)
    return total / value


@outside_graph
def _wait(work) -> None:
    work.wait()


def class_rows(logits: torch.Tensor, target: torch.Tensor):
    """``(N, C)`` rows and ``(N,)`` targets of an ``(N, C, d1, ...)`` cross entropy whose classes are
    innermost in memory (``logits.permute(0, 2, 1)`` of ``(B, S, C)`` logits,
    ``cube.trace.rows.unflatten_loss``): a view, where ``log_softmax`` along dim 1 would first copy
    the logits (and run 4-7 times as long on a CPU). Other logits are returned as they are."""
    if logits.dim() > 2 and logits.stride(1) == 1 and logits.shape[1] > 1:
        return logits.movedim(1, -1).reshape(-1, logits.shape[1]), target.reshape(-1)
    return logits, target


def _cross_entropy_loss(logits, target, weight=None, reduction: int = 1, ignore_index: int = -100,
                        label_smoothing: float = 0.0):
    rows, flat = class_rows(logits, target)
    out = torch.ops.aten.cross_entropy_loss.default(rows, flat, weight, reduction, ignore_index, label_smoothing)
    return out.view(target.shape) if reduction == 0 else out


_lib = torch.library.Library("cube_loss", "FRAGMENT")
_lib.define("cross_entropy_loss(Tensor self, Tensor target, Tensor? weight=None, int reduction=1, "
            "SymInt ignore_index=-100, float label_smoothing=0.0) -> Tensor")
torch.library.impl("cube_loss::cross_entropy_loss", "CompositeImplicitAutograd", lib=_lib)(_cross_entropy_loss)
# ``aten.cross_entropy_loss`` with its schema and meaning, computed on class rows where the classes are innermost
# in memory (``class_rows``): what ``cube.trace.rows.unflatten_loss`` calls on its ``(B, C, S)`` logits
cross_entropy_loss = torch.ops.cube_loss.cross_entropy_loss.default


def cross_entropy_part(logits: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
                       ignore_index: int = -100, label_smoothing: float = 0.0,
                       ranks: Sequence[int] = (), count: Optional[torch.Tensor] = None) -> torch.Tensor:
    """This piece's share of a mean cross entropy: its summed loss over the global weight of valid
    targets (``count`` when known from the whole batch, else summed over ``ranks`` while the loss
    is computed)."""
    pending = (count, None) if count is not None else \
        _start_denominator(target, weight, ignore_index, ranks, logits.dtype)
    rows, flat = class_rows(logits, target)
    total = F.cross_entropy(rows, flat, weight, ignore_index=ignore_index, reduction="sum",
                            label_smoothing=label_smoothing)
    return _divide(total, pending)


def nll_part(logp: torch.Tensor, target: torch.Tensor, weight: Optional[torch.Tensor] = None,
             ignore_index: int = -100, ranks: Sequence[int] = (), count: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """This piece's share of a mean negative log likelihood (see ``cross_entropy_part``)."""
    pending = (count, None) if count is not None else \
        _start_denominator(target, weight, ignore_index, ranks, logp.dtype)
    total = F.nll_loss(logp, target, weight, ignore_index=ignore_index, reduction="sum")
    return _divide(total, pending)


def pointwise_loss_part(name: str, x: torch.Tensor, y: torch.Tensor, count: int, **kw) -> torch.Tensor:
    """This piece's share of a mean pointwise loss (``mse_loss``, ``l1_loss``, ``smooth_l1_loss``)."""
    fn = {"mse_loss": F.mse_loss, "l1_loss": F.l1_loss, "smooth_l1_loss": F.smooth_l1_loss}[name]
    return fn(x, y, reduction="sum", **kw) / count
