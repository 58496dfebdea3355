"""Runs a pipeline schedule: this rank's forward and backward micro-steps, in order.

A forward micro-step runs the rank's generated forward on one micro-batch:
values for other stages are sent (``cube.runtime.p2p``, tags offset by the
micro-batch) and their send markers kept; the last stage keeps the loss. A
backward micro-step runs autograd from that micro-batch's markers and, on the
last stage, from its loss divided by the number of micro-batches, so the
gradients are those of the mean loss (gradient accumulation). Parameter
gradients are summed over ranks once, after the last micro-step.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from cube.runtime import p2p

LOSS_TAG = (1 << 30) - 1


def run(model, batches: Sequence[Sequence[torch.Tensor]], actions: Sequence[str],
        loss_from: Optional[int] = None, loss_to: Sequence[int] = ()) -> torch.Tensor:
    """Runs ``actions`` (``"F3"``, ``"B0"``, ...) over ``batches`` (one per micro-batch).

    Returns:
        The mean over micro-batches of the loss, on every rank.
    """
    nmicros = len(batches)
    markers: List[List[torch.Tensor]] = [[] for _ in range(nmicros)]
    losses: List[Optional[torch.Tensor]] = [None] * nmicros
    if model._reducer is not None:
        model._reducer.hold()
    for act in actions:
        kind, i = act[0], int(act[1:])
        if kind == "F":
            p2p.set_micro(i)
            out = model(*batches[i])
            markers[i] = p2p.take_markers()
            if loss_from is None:
                losses[i] = out
        else:
            p2p.set_micro(i)
            p2p.backward(losses[i], markers[i], scale=1.0 / nmicros)
            markers[i] = []
    p2p.set_micro(0)
    p2p.finish()
    model.reduce_gradients()
    if loss_from is None:
        loss = torch.stack([x.detach() for x in losses]).mean()
        works = [dist.isend(loss, dst, tag=LOSS_TAG) for dst in loss_to]
        for w in works:
            w.wait()
        return loss
    loss = torch.empty((), dtype=torch.float32, device=model.device)
    dist.recv(loss, loss_from, tag=LOSS_TAG)
    return loss
