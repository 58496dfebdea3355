"""Runs a pipeline schedule: this rank's forward and backward micro-steps, in order.

A forward micro-step runs the rank's generated forward on one micro-batch:
values for other stages are sent (``cube.runtime.p2p``, tags offset by the
micro-batch) and their send markers kept; the last stage keeps the loss. A
backward micro-step runs autograd from that micro-batch's markers and, on the
last stage, from its loss divided by the number of micro-batches, so the
gradients are those of the mean loss (gradient accumulation). Parameter
gradients are summed over ranks once, after the last micro-step.

Receives are posted ahead (``irecv``) so their data lands while this rank
computes: before each forward, its own inputs' and the next forward's (the
receives a forward makes are learned from the first one and kept on the
model); each send's gradient receive when the send is made; the loss's at the
start.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from cube.runtime import p2p
from cube.runtime.collectives import wire

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
    forwards = [int(a[1:]) for a in actions if a[0] == "F"]
    recvs = model.__dict__.get("_pipeline_recvs")   # the receives of one forward, once learned
    with p2p.early_gradients():
        for act in actions:
            kind, i = act[0], int(act[1:])
            p2p.set_micro(i)
            if kind == "F":
                if recvs is not None:
                    p2p.post(recvs, i)
                    k = forwards.index(i) + 1
                    if k < len(forwards):
                        p2p.post(recvs, forwards[k])
                p2p.recorded()
                out = model(*batches[i])
                if recvs is None:
                    recvs = model.__dict__["_pipeline_recvs"] = p2p.recorded()
                markers[i] = p2p.take_markers()
                if loss_from is None:
                    losses[i] = out
            else:
                p2p.backward(losses[i], markers[i], scale=1.0 / nmicros)
                markers[i] = []
    p2p.set_micro(0)
    p2p.finish()
    if p2p.untaken():   # a receive posted for a forward or backward that did not run: a cube bug
        raise RuntimeError(f"pipeline step ended with receives posted but not taken (src, tag): "
                           f"{p2p.untaken()}; actions {list(actions)}")
    model.reduce_gradients()
    if loss_from is None:
        loss = torch.stack([x.detach() for x in losses]).mean()
        out = loss.to(wire(loss.device))
        works = [dist.isend(out, dst, tag=LOSS_TAG) for dst in loss_to]
        for w in works:
            w.wait()
        return loss
    # received last, after every gradient from ``loss_from``: NCCL ignores tags and matches a
    # pair's messages in the order they are posted, and the last stage sends its loss last
    loss = torch.empty((), dtype=torch.float32, device=wire(model.device))
    dist.recv(loss, loss_from, tag=LOSS_TAG)
    return loss.to(model.device)
