"""Context parallel through a recurrence: the mixer split by heads, as Megatron-LM's all-to-all context parallel.

A recurrence along the sequence (Mamba's causal conv and selective scan, Mamba-2's chunked scan, a delta
rule passing its state chunk to chunk) cannot run on a block of tokens: each token needs the state of
every token before it. ``cube.ir.follow.context_flow`` stops the sequence split there, and the mixer
would run whole on its inputs gathered, on every rank. Its channels and heads, though, are independent
of each other: Megatron-LM's context parallel for state-space layers (``MambaContextParallel``)
exchanges the sequence-split projections all-to-all into head-split ones before the conv and the scan,
and back after them.

``head_parallel`` does the same from the graph's structure. The *region* of a lost sequence split is
the op that loses it and every op after it that the sequence split leaves whole and that reads, directly
or through such ops, what the region makes (the mixer up to where its output meets the sequence split
again: the gate, the output projection). Each op of the region that Megatron's tensor-parallel plan
(``megatron_flow``) splits takes that split (heads, channels, a row linear's contraction); the others
follow it where their rules can. Where the region meets the sequence split (its input projections, its
gate, its output), ``cube.passes.adapter`` exchanges the tensors all-to-all, as Megatron-LM does.

The same holds for any op the sequence split stops at that tensor parallel splits by heads: a
``flex_attention`` whose query blocks a rank's tokens would cut runs on each rank's heads, q, k and v
exchanged all-to-all (as DeepSpeed-Ulysses runs attention), rather than on its inputs gathered.

A region op left whole that gathers what a linear tensor parallel keeps whole by design makes
(``Flow.shared``: Mamba-2's ``B`` and ``C`` of one group, contracted in ``C^T B`` and read whole by
every head; Megatron-LM replicates a group no rank's heads split) is no lost split: it reads its input
gathered, as the heads it feeds read it whole. Any other op left whole on a gathered input (a flip
of the sequence, an op tensor parallel loses too) stays a lost split (``cube.ir.lost``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import List, Set

from cube.ir.follow import Flow, follow, gathers
from cube.ir.graph import IRGraph, constant, makers as graph_makers
from cube.ir.megatron import megatron_flow
from cube.ir.operator import IRFwOperation

_STEPS = 6   # the most one-input ops (a transpose, a cast) between a shared linear and the op gathering it


def head_parallel(graph: IRGraph, flow: Flow, num: int, within: int = 1) -> Flow:
    """``flow`` (a sequence split ``num`` ways, ``context_flow``) with the region of each lost split
    split by heads where tensor parallel splits it (module docstring); ``flow`` itself when no region
    gains a split.

    ``within``: the degree tensor parallel splits the same heads further, inside each of these blocks
    (its mesh dim comes after this one). The region takes the splits of a tensor-parallel plan
    ``num * within`` ways, so its heads divide among both: a head count neither plan can split that
    far leaves its ops whole (a lost split, refused under ``strict=True``), not an uneven split."""
    if not flow.losses:
        return flow
    ops = graph.select(ntype=IRFwOperation)
    region: List[IRFwOperation] = []
    made: Set[int] = set()
    for op in ops:
        if id(op) in flow.splits:
            continue
        if id(op) in flow.losses or any(id(t) in made for t in op.inputs):
            region.append(op)
            made.update(id(t) for t in op.outputs)
    tensor = megatron_flow(graph, num * within)
    start = {id(op): tensor.splits[id(op)][1:] for op in region if id(op) in tensor.splits}
    if not start:
        return _too_few(graph, flow, region, tensor, num, within)
    inside = {id(op) for op in region}
    base = flow.copy(losses={k: v for k, v in flow.losses.items() if k not in inside})
    out = follow(graph, {}, num, flow=base, start=start,
                 drop={id(op) for op in ops if id(op) not in inside and id(op) not in flow.splits})
    out.empty = flow.empty
    _losses(graph, out, inside, tensor, num)
    return _too_few(graph, out, region, tensor, num, within)


def _too_few(graph: IRGraph, out: Flow, region: List[IRFwOperation], tensor: Flow, num: int, within: int) -> Flow:
    """``out``, or a copy with each loss in the region saying so where its heads divide ``num`` ways but not
    ``num * within`` (too few heads for context and tensor parallel together)."""
    if within == 1:
        return out
    fewer = megatron_flow(graph, num).splits
    if not any(id(op) in fewer and id(op) not in tensor.splits for op in region):
        return out
    note = (f"; tensor parallel splits each of the {num} blocks of its region's heads {within} ways, and some "
            f"do not divide into {num * within}: choose cp x tp dividing the heads")
    inside = {id(op) for op in region}
    return out.copy(losses={k: replace(loss, why=loss.why + note) if k in inside else loss
                            for k, loss in out.losses.items()})


def _losses(graph: IRGraph, out: Flow, inside: Set[int], tensor: Flow, num: int) -> None:
    """Adds to ``out.losses`` each op of the region (``inside``) left whole that reads a tensor ``out``
    splits, unless it is whole by design (module docstring)."""
    made = graph_makers(graph.ops)

    def shared(t) -> bool:
        """Whether ``t`` is made by a linear of ``tensor.shared``, directly or through ops of one input
        besides parameters or buffers (a cast, a transpose, a scale)."""
        for _ in range(_STEPS + 1):
            maker = made.get(id(t))
            if maker is None:
                return False
            if id(maker) in tensor.shared:
                return True
            if not maker.inputs or not all(constant(x, made) for x in maker.inputs[1:]):
                return False
            t = maker.inputs[0]
        return False

    def by_design(op: IRFwOperation, reads) -> bool:
        return id(op) not in inside or (id(op) not in tensor.losses and all(shared(t) for t in reads))
    gathers(graph, out, num, "context parallel", skip=by_design,
            note="; its region runs split by heads (context parallel through a recurrence, cube.ir.heads), which "
                 "does not reach it")
