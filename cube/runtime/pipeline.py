"""Runs a pipeline schedule: this rank's forward and backward micro-steps, in order.

A step takes the global batch (what one process would train on) and cuts it
along dim 0 into ``nmicros`` equal micro-batches (``micro_batches``). The
generated code of a micro-batch computes its *share* of the global loss
(``cube.passes.micro``: a mean over the batch is the micro-batch's sum over the
global count, a mean over valid targets divides by the valid targets of the
whole batch), so the step's loss is the sum of the shares and equals the loss
of the whole batch, and so do the gradients.

A forward micro-step runs the rank's generated forward on one micro-batch:
values for other stages are sent (``cube.runtime.p2p``, tags offset by the
micro-batch) and their send markers kept; the last stage keeps the loss share.
A backward micro-step runs autograd from that micro-batch's markers and, on the
last stage, from its share, unscaled. Zero-bubble schedules split it: a B
micro-step leaves the linear layers' weight gradients as work
(``cube.runtime.zb``) that the micro-batch's W micro-step runs later. Parameter gradients are summed over
ranks once, after the last micro-step.

A rank holding several stages (virtual stages, interleaved 1F1B) has one
generated method per stage; its actions name the stage (``F3.s2``), a forward
runs ``model(stage, *batch)`` and a backward starts from the markers (and loss)
of that micro-batch's forward of that stage only. Its stages hand values to
each other with ``p2p.stash``, which cuts autograd like a send, so no backward
runs through another stage's graph.

Receives are posted ahead (``irecv``) so their data lands while this rank
computes: before each forward, its own inputs' and the next forward's (the
receives a stage's forward makes are learned from its first one and kept on
the model); each send's gradient receive when the send is made. Over gloo,
tags match the messages, so posting ahead is safe in any order. NCCL matches a
pair's messages in the order they are posted instead, and a rank holding
several stages consumes a neighbour's messages in its own schedule's order,
not in the order the neighbour sends them (inputs of one stage, gradients of
another; gradients sent in autograd's order). On NCCL, and under
``CUBE_P2P_ORDER=strict`` on gloo and in the in-process world, messages
therefore travel on ordered channels (``cube.runtime.p2p.ordered``): each with a
header naming it, read in sending order and kept until asked for. Every
schedule runs on them.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from cube.runtime import p2p, session, zb
from cube.runtime.collectives import wire

LOSS_TAG = (1 << 30) - 1

Step = Tuple[str, int, Optional[int]]   # (kind "F"/"B"/"W", micro-batch, stage or None: the rank's only stage)


def parse_action(action: str) -> Step:
    """``"F3"`` -> ``("F", 3, None)``; ``"B0.s2"`` -> ``("B", 0, 2)``."""
    micro, _, stage = action[1:].partition(".s")
    return action[0], int(micro), int(stage) if stage else None


def micro_batches(batch: Sequence[torch.Tensor], nmicros: int, interleave: int = 1,
                  extra: Sequence[torch.Tensor] = ()) -> List[tuple]:
    """The ``nmicros`` micro-batches of a global batch, each followed by ``extra``.

    Every tensor is cut along dim 0 into ``interleave`` equal parts and micro-batch ``i`` is the
    ``i``-th of ``nmicros`` equal slices of every part, in part order (with ``interleave`` 1: the
    ``i``-th of ``nmicros`` equal slices of the batch, views without copies). A rank keeping part
    ``d`` of ``D`` of each micro-batch (``D`` dividing ``interleave``) so reads exactly rows
    ``[d B / D, (d + 1) B / D)`` of the global batch over the whole step.

    Raises:
        ValueError: a tensor's dim 0 does not cut into ``interleave x nmicros`` equal slices.
    """
    parts = []
    for t in batch:
        if t.ndim == 0 or t.shape[0] % (interleave * nmicros):
            raise ValueError(f"a pipeline step cuts the global batch into {nmicros} micro-batches along dim 0 "
                             f"(in {interleave} data parallel parts), but a batch tensor has shape "
                             f"{list(t.shape)}: use a global batch size that is a multiple of "
                             f"{interleave * nmicros}")
        if interleave == 1:
            parts.append(t.chunk(nmicros))
        else:
            v = t.unflatten(0, (interleave, nmicros, -1))
            parts.append([v[:, i].flatten(0, 1) for i in range(nmicros)])
    return [tuple(p[i] for p in parts) + tuple(extra) for i in range(nmicros)]


def run(model, batches: Sequence[Sequence[torch.Tensor]], actions: Sequence[str],
        loss_from: Optional[int] = None, loss_to: Sequence[int] = ()) -> torch.Tensor:
    """Runs ``actions`` (``"F3"``, ``"B0"``, or ``"F3.s2"`` on a rank holding several stages) over
    ``batches`` (one per micro-batch).

    Returns:
        The sum over micro-batches of their loss shares (the loss of the global batch), on every rank.
    """
    steps = [parse_action(a) for a in actions]
    with session.running(model):   # the model's runtime state, also when called outside its step
        return _run(model, batches, steps, loss_from, loss_to, actions)


def _run(model, batches: Sequence[Sequence[torch.Tensor]], steps: List[Step], loss_from: Optional[int],
         loss_to: Sequence[int], actions: Sequence[str]) -> torch.Tensor:
    nmicros = len(batches)
    forwards = [(i, s) for kind, i, s in steps if kind == "F"]
    split = any(kind == "W" for kind, _, _ in steps)   # zero-bubble: B leaves weight gradients to W
    # a B followed at once by its own W (DualPipeV's full backwards) is one whole backward: nothing to defer
    whole = {k for k, (kind, i, s) in enumerate(steps[:-1]) if kind == "B" and steps[k + 1] == ("W", i, s)}
    deferred: Dict[Tuple[int, Optional[int]], list] = session.current().wgrads.pending
    roots: Dict[Tuple[int, Optional[int]], tuple] = {}   # (micro, stage) -> its loss (or None) and markers
    losses: List[Optional[torch.Tensor]] = [None] * nmicros
    if model._reducer is not None:
        model._reducer.hold()
    recvs = model.__dict__.setdefault("_pipeline_recvs", {})   # stage -> the receives of its forward, once learned
    nforward = 0
    with p2p.early_gradients():
        for k, (kind, i, s) in enumerate(steps):
            p2p.set_micro(i)
            if kind == "F":
                _post_ahead(recvs, forwards[nforward:nforward + 2])
                nforward += 1
                p2p.recorded()
                out = model(*batches[i]) if s is None else model(s, *batches[i])
                recvs.setdefault(s, p2p.recorded())
                roots[(i, s)] = (out, p2p.take_markers())
                if out is not None:   # the stage making the loss
                    losses[i] = out
            elif kind == "B" and split and k not in whole:
                out, markers = roots.pop((i, s))
                with zb.collecting() as work:   # the linears' weight gradients wait for this W
                    p2p.backward(out, markers, scale=1.0)
                deferred[(i, s)] = work
            elif kind == "B":
                out, markers = roots.pop((i, s))
                p2p.backward(out, markers, scale=1.0)   # a share of the global loss: no rescaling
            elif k - 1 not in whole:
                zb.apply(deferred.pop((i, s)))
    p2p.set_micro(0)
    p2p.finish()
    if deferred:   # a B without its W: the schedule validator makes this impossible
        raise RuntimeError(f"pipeline step ended with the weight gradients of {sorted(deferred)} not applied; "
                           f"actions {list(actions)}")
    if p2p.untaken():   # posted for a forward or backward that did not run, or stashed for nobody: a cube bug
        raise RuntimeError(f"pipeline step ended with receives posted or values stashed but not taken: "
                           f"{p2p.untaken()}; actions {list(actions)}")
    model.reduce_gradients()
    if loss_from is None:
        loss = torch.stack([x.detach() for x in losses]).sum()
        out = loss.to(wire(loss.device))
        works = [p2p.send_value(out, dst, LOSS_TAG) for dst in loss_to]
        for w in works:
            w.wait()
        return loss
    # sent last, after every gradient to this rank: on ordered channels it comes after them too
    return p2p.recv_value(loss_from, LOSS_TAG, (), torch.float32, model.device)


def _post_ahead(recvs: Dict[Optional[int], list], forwards: List[Tuple[int, Optional[int]]]) -> None:
    """Posts the receives of the forwards ``(micro, stage)`` whose stage's receives are learned."""
    for i, s in forwards:
        if s in recvs:
            p2p.post(recvs[s], i)
