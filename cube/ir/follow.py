"""Following one split through the graph: which (input, dim) of each op carries it.

Policies use this to find plans from the graph's structure instead of module
names: the batch dimension from the data operation onward (data parallel), the
sequence (context and sequence parallel), the experts; Megatron's column/row pairs
of linears are found with the same choices in ``cube.ir.megatron``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Set, Tuple

from cube.ir.dispatch import Dispatch, Region
from cube.ir.graph import IRGraph, makers as graph_makers
from cube.ir.metadata import lost_metadata, whole_metadata
from cube.ir.ops import op_info
from cube.ir.operator import IRDataOperation, IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind


@dataclass(frozen=True)
class Loss:
    """An op a split reaches but cannot go through, so it runs whole (``cube.ir.lost`` reports it).

    Attributes:
        op: the op (of the graph the flow was found on).
        why: why it runs whole: what its rule refuses, or where a linear's column split stops.
        what: the split lost (``"data parallel"``, ``"tensor parallel"``, ...).
        gathered: its inputs the flow splits, gathered whole for it; none when nothing is
            gathered (a linear kept whole reads a whole input).
        weights: the parameters a linear kept whole reads, directly or through a view (``x @ w.T``);
            none: its parameter inputs.
    """

    op: IRFwOperation
    why: str
    what: str
    gathered: Tuple[IRTensor, ...] = ()
    weights: Tuple[IRTensor, ...] = ()


@dataclass
class Flow:
    """Where a split goes: per op, the (input, dim) to partition on.

    Attributes:
        splits: op id -> (op, idx, dim).
        tracked: tensor id -> the dim of the tensor the split runs along.
        blocked: ops that read a split tensor but cannot be split along it.
        reduced: ops where the split ends in a partial sum (e.g. a row linear).
        batch: the split is the batch's, so the data operation splits too (dim 0 of its tensors).
        losses: op id -> ``Loss``: the ops that run whole although the split reaches them (a
            blocked op reading a tensor the flow does split: the plan gathers it; a linear
            whose column split stops at an op that cannot carry it).
        empty: what to say when the flow splits nothing (``"no linear pairs found to split"``).
        local: op id -> the token-local dispatch region it belongs to (``cube.ir.dispatch``): ops
            the batch split cannot cut (in ``batch_flow``, those reading split tensors are also
            ``blocked``) that compute, as a whole, each token from that token alone; its outputs
            carry the batch along dim 0. A pipeline runs them on each micro-batch's own tokens.
        unproven: op id of a sort of the tokens -> why cube could not prove its region token-local.
        shared: ids of the linears ``megatron_flow`` keeps whole by design because their output
            features end contracted in a product of two activations (Mamba-2's ``B`` and ``C``, read
            whole by every head): what they make is no lost split where every head reads it.
    """

    splits: Dict[int, Tuple[IRFwOperation, int, int]] = field(default_factory=dict)
    tracked: Dict[int, int] = field(default_factory=dict)
    blocked: List[IRFwOperation] = field(default_factory=list)
    reduced: List[IRFwOperation] = field(default_factory=list)
    batch: bool = False
    losses: Dict[int, Loss] = field(default_factory=dict)
    empty: str = ""
    local: Dict[int, Region] = field(default_factory=dict)
    unproven: Dict[int, str] = field(default_factory=dict)
    shared: Set[int] = field(default_factory=set)

    def split_of(self, op) -> Optional[Tuple[int, int]]:
        """The (idx, dim) to split ``op`` (or a piece of it) on, or None: replicate it."""
        if isinstance(op, IRDataOperation):
            return (0, 0) if self.batch else None
        e = self.splits.get(id(op.root))
        return None if e is None else e[1:]

    def copy(self, **changes) -> "Flow":
        """A copy with its own containers (``changes`` replace fields)."""
        fields = dict(splits=dict(self.splits), tracked=dict(self.tracked), blocked=list(self.blocked),
                      reduced=list(self.reduced), batch=self.batch, losses=dict(self.losses), empty=self.empty,
                      local=dict(self.local), unproven=dict(self.unproven), shared=set(self.shared))
        fields.update(changes)
        return Flow(**fields)


def follow(graph: IRGraph, seeds: Dict[int, int], num: int, flow: Optional[Flow] = None,
           start: Optional[Dict[int, Tuple[int, int]]] = None,
           whole: Optional[Callable[[IRFwOperation], bool]] = None,
           local: Optional[Callable[[IRFwOperation, Dict[int, int]], Optional[Region]]] = None,
           drop: Optional[Set[int]] = None) -> Flow:
    """Follows splits of ``num`` pieces from ``seeds`` (tensor id -> dim) in program order.

    Args:
        start: op id -> (idx, dim) splits to make regardless of tracked inputs
            (e.g. a column linear split on its weight).
        flow: an earlier result to extend (it is copied, not changed). Its splits stand as made,
            and its ``tracked`` alone says which of their outputs carry them: the output of an op
            it splits but does not follow (a key/value projection with fewer heads than ``num``,
            gathered: ``cube.ir.megatron._gathered_columns``; a weight's transpose) is whole here too, so the split
            is not followed on into ops ``flow`` keeps whole (a single key head's rotary slices
            under sequence parallel).
        whole: ops it says True of (and not split by ``flow`` or ``start``) stay whole; the split
            dim is still followed through them when they could carry it, so a later op may run
            on a piece of their output.
        local: called with an op that reads a split tensor but cannot be split and the dims
            tracked so far; a ``Region`` it returns (``cube.ir.dispatch.Dispatch``) joins
            ``Flow.local`` (not ``blocked``), and its outputs are tracked along dim 0.
        drop: ids of ops that stay whole on their whole inputs, their outputs not followed (what
            ``cube.ir.metadata.whole_metadata`` finds).
    """
    out = flow.copy() if flow else Flow()
    out.tracked.update(seeds)
    start = start or {}
    for op in graph.ops:
        if not isinstance(op, IRFwOperation) or id(op) in out.local or (drop and id(op) in drop):
            continue
        if id(op) in start:
            choice = start[id(op)]
        elif id(op) in out.splits:   # split by ``flow``, whose ``tracked`` already says where its outputs go
            choice = out.splits[id(op)][1:]
            if ends_inside(op, *choice):   # its outputs are whole: a split of another dim goes on through it
                other = choose(op, out, num)
                if other is not None:
                    carry(op, *other, out.tracked)
            continue
        else:
            choice = choose(op, out, num)
            if choice is not None and whole is not None and whole(op):
                carry(op, *choice, out.tracked)   # the dim goes on: a later op may split the output
                continue
            if choice is None:
                region = local(op, out.tracked) if local is not None and _reads(op, out) else None
                if region is not None:
                    out.local.update({id(o): region for o in region.ops + region.counting})
                    out.tracked.update({id(t): 0 for t in region.outputs})
                elif _reads(op, out):
                    out.blocked.append(op)
                continue
        idx, dim = choice
        out.splits[id(op)] = (op, idx, dim)
        if carry(op, idx, dim, out.tracked) and op not in out.reduced:
            out.reduced.append(op)
    return out


def carry(op: IRFwOperation, idx: int, dim: int, tracked) -> bool:
    """Tracks the outputs of ``op`` split at ``(idx, dim)``; True when the split ends in a partial sum."""
    factor = op.anno.inputs[idx][dim].head
    partial = False
    for t, group in zip(op.outputs, op.anno.outputs):
        dims = [d for d, g in enumerate(group) if g.head is not None and g.head.name == factor.name]
        if dims:
            tracked[id(t)] = dims[0]
        elif factor.reduce:
            partial = True
    return partial


def _reads(op: IRFwOperation, flow: Flow) -> bool:
    return any(id(t) in flow.tracked for t in op.inputs)


def choose(op: IRFwOperation, flow: Flow, num: int) -> Optional[Tuple[int, int]]:
    """The (idx, dim) that splits every tracked input of ``op`` along its tracked dim, if one factor does."""
    if op.anno is None:
        return None
    algo = op.algorithms("dim")
    factor, choice = None, None
    for idx, t in enumerate(op.inputs):
        if id(t) not in flow.tracked:
            continue
        dim = flow.tracked[id(t)]
        if not algo.satisfy(idx, dim, num):
            return None
        name = op.anno.inputs[idx][dim].head.name
        if factor is None:
            factor, choice = name, (idx, dim)
        elif name != factor:
            return None
    return choice


def refusal(op: IRFwOperation, tracked, num: int) -> str:
    """Why ``op`` cannot be split ``num`` ways along the tracked dims of its inputs (what
    ``choose`` refused), in a few words: no rule, a dim its rule keeps whole, a size ``num``
    does not divide, or inputs split along dims its rule does not split together."""
    if op.anno is None:
        return op.anno_error or "cube has no partition rule for it"
    algo = op.algorithms("dim")
    first = None
    for idx, t in enumerate(op.inputs):
        if id(t) not in tracked:
            continue
        dim = tracked[id(t)]
        if (idx, dim) not in algo.legal():
            return f"its rule '{op.anno}' does not split dim {dim} of input {idx} ('{op.anno.inputs[idx][dim]}')"
        try:
            algo.check(idx, dim, num)
        except ValueError as e:
            ident = algo.ident(idx, dim)
            size = algo.size(ident)
            return f"'{ident.name}' (dim {dim} of input {idx}) has size {size}, which {num} does not divide" \
                if size % num else str(e)
        name = op.anno.inputs[idx][dim].head.name
        if first is None:
            first = (idx, dim, name)
        elif name != first[2]:
            return (f"input {first[0]} is split along dim {first[1]} and input {idx} along dim {dim}, which its "
                    f"rule '{op.anno}' does not split together")
    return "it cannot carry the split"


def gathers(graph: IRGraph, flow: Flow, num: int, what: str,
            skip: Optional[Callable[[IRFwOperation, Tuple[IRTensor, ...]], bool]] = None, note: str = "") -> None:
    """Adds to ``flow.losses`` every op of ``flow.blocked`` that reads a tensor the flow splits (a
    batch tensor under a batch split, or an output of an op it splits): the plan gathers that
    tensor whole for it. A blocked op that reads only tensors the flow follows but leaves whole
    (through ops it keeps whole, or a split it dropped) costs no gather and is not one, nor is an
    op ``skip`` (called with the op and the split tensors it reads) says is whole by the flow's
    design. ``note`` ends each loss's reason."""
    if not flow.blocked:
        return
    made = graph_makers(graph.ops)

    def split(t) -> bool:
        maker = made.get(id(t))
        return id(t) in flow.tracked and (flow.batch if isinstance(maker, IRDataOperation)
                                          else maker is not None and id(maker) in flow.splits)
    for op in flow.blocked:
        if id(op) in flow.losses or id(op) in flow.splits:
            continue
        reads = tuple(t for t in op.inputs if split(t))
        if reads and not (skip is not None and skip(op, reads)):
            why = refusal(op, flow.tracked, num) + note
            if id(op) in flow.local:
                why += ("; it is part of a token-local dispatch region (cube.ir.dispatch), which a pipeline runs "
                        "on each micro-batch's tokens but a batch split runs whole on the tokens gathered")
            flow.losses[id(op)] = Loss(op, why, what, reads)


def batch_flow(graph: IRGraph, num: int) -> Flow:
    """Follows the batch (dim 0 of every batch tensor) split ``num`` ways; ``losses``: the ops
    that read a batch-split tensor but cannot split along the batch (their inputs are gathered).
    A sort of the tokens that starts a region proved token-local (``cube.ir.dispatch``) joins
    ``local`` with its region, whose outputs carry the batch on (the others: ``unproven``)."""
    data = graph.select(ntype=IRDataOperation)[0]
    dispatch = Dispatch(graph)
    while True:   # again without each region whose token inputs made after its sort the batch misses
        dispatch.why.clear()
        flow = follow(graph, {id(t): 0 for t in data.outputs if t.ndim > 0}, num, local=dispatch)
        regions = list({id(r): r for r in flow.local.values()}.values())
        if not dispatch.late(regions, flow.tracked):
            break
    flow.blocked.extend(o for r in regions for o in r.ops if _reads(o, flow))
    flow.batch = True
    flow.unproven = dict(dispatch.why)
    gathers(graph, flow, num, "data parallel")
    return flow


def context_flow(graph: IRGraph, num: int) -> Flow:
    """Follows the sequence (dim 1 of every batch tensor with one) split ``num`` ways: context
    parallel. The batch is read whole (each op piece takes its block); attention splits along the
    sequence as ring attention.

    Where the sequence cannot go on after the last attention it split (a flatten of batch and
    sequence: a block of the sequence is no block of the merged dim; a cross entropy of flattened
    logits is not one, ``cube.trace.rows.unflatten_loss`` gives it the sequence back), the split of an
    activation goes on along the batch when ``num`` divides it, so it is exchanged all-to-all rather
    than gathered whole on every rank. (Before an attention that would end the ring: a flatten
    there, as in Hugging Face's ``Conv1D``, leaves the sequence split only where it reaches.)

    Metadata computed from the batch alone is computed whole on every rank where its split would be
    lost (``cube.ir.metadata``: a padding mask whose key dim reaches ring attention)."""
    data = graph.select(ntype=IRDataOperation)[0]
    seeds = {id(t): 1 for t in data.outputs if t.ndim > 1}
    flow = follow(graph, seeds, num)
    meta = whole_metadata(graph, data, flow)
    if meta:
        flow = follow(graph, seeds, num, drop=meta)
    lost = lost_metadata(graph, data, flow)
    if lost:
        meta |= lost
        flow = follow(graph, seeds, num, drop=meta)
    start: Dict[int, Tuple[int, int]] = {}
    while True:   # eager attention: the scores' query rows, then the rows of their product with the values
        rows = {id(op): (0, op.inputs[0].ndim - 2) for op in flow.blocked if _query_rows(op, flow, num)}
        if not rows:
            break
        start.update(rows)
        flow = follow(graph, seeds, num, start=start, drop=meta)
    order = {id(op): i for i, op in enumerate(graph.ops)}
    rings = [order[k] for k, (op, _, _) in flow.splits.items() if op_info(op.name).inside in ("ring", "gather_kv")]
    made = graph_makers(graph.ops)
    batch = {}
    for op in flow.blocked if rings else ():
        if order[id(op)] < max(rings):
            continue
        # an activation the flow split; an op on the batch alone (the labels shifted for the loss) reads
        # it whole at no cost, and a batch split of it would meet the sequence-split logits at the loss
        tracked = [i for i, t in enumerate(op.inputs) if flow.tracked.get(id(t)) == 1 and
                   id(made.get(id(t))) in flow.splits]
        if op.anno is not None and len(tracked) == 1 and op.algorithms("dim").satisfy(tracked[0], 0, num):
            batch[id(op)] = (tracked[0], 0)
    if batch:   # (the eager attentions' splits above already followed)
        flow = follow(graph, seeds, num, start={**start, **batch}, drop=meta)
    flow.empty = "no sequence dim found to split"
    gathers(graph, flow, num, "context parallel")
    return flow


def _query_rows(op: IRFwOperation, flow: Flow, num: int) -> bool:
    """Whether ``op`` is a matmul of a block of query rows (its first input split along its rows)
    by a tensor the flow splits along another dim: the keys of an eager attention (``q @ k.T``,
    Gemma2's soft-capped scores), or its values (``softmax(scores) @ v``). Context parallel splits
    it along the rows and reads the other input gathered, as the all-gather flavour of context
    parallelism does (each rank holds the layer's keys and values whole for a moment, its scores
    for its own queries only): exact, and no split of it is lost."""
    if op.name not in ("matmul", "bmm") or len(op.inputs) != 2 or op.anno is None:
        return False
    a, b = op.inputs
    return a.ndim >= 2 and flow.tracked.get(id(a)) == a.ndim - 2 and id(b) in flow.tracked and \
        op.algorithms("dim").satisfy(0, a.ndim - 2, num)


def sequence_flow(graph: IRGraph, tensor: Flow, num: int, dim: int = 1) -> Flow:
    """``tensor`` (a Megatron plan of ``num`` pieces) plus, for the ops it leaves whole between
    its regions, the split of the sequence (``dim`` of the batch tensors): Megatron's sequence
    parallel.

    The sequence dim is followed from the batch through the ops ``tensor`` leaves whole. Only
    ops bound by memory split along it; a matmul, convolution or attention stays whole (a
    language model's head runs on the gathered sequence, as in Megatron-LM), and so does an op
    whose parameters hold more than half the elements of its output (an embedding table: split,
    its weight gradient would be partial, summed at ``2 (n-1)/n`` of the table; whole, it costs
    at most a gather of the output's gradient). The dim is still followed through such ops, so
    what comes after them can run on a piece. Of the ops split, a connected run is kept only when
    it meets a tensor-parallel region (reads its partial sums or feeds it): a run that does not
    (after the head: a dtype cast before a loss that needs the whole sequence) would only cut a
    whole value and gather it again. Nor is a run that makes no float tensor: index arithmetic
    on positions, masks and document ids (integer and bool tensors), which Megatron-LM computes
    whole on every rank; split, it would gather them again for what reads them whole (an
    attention's mask function, a scatter by document id).
    """
    data = graph.select(ntype=IRDataOperation)[0]
    seeds = {id(t): dim for t in data.outputs if t.ndim > dim}
    flow = follow(graph, seeds, num, flow=tensor, whole=_whole_in_sequence)
    seq = {k: e for k, e in flow.splits.items() if k not in tensor.splits}
    run = {k: k for k in seq}                 # union-find over the split ops, joined by the tensors between them

    def root(k):
        while run[k] != k:
            run[k] = run[run[k]]
            k = run[k]
        return k
    maker = {id(t): k for k, (op, _, _) in seq.items() for t in op.outputs}
    for k, (op, _, _) in seq.items():
        for t in op.inputs:
            if id(t) in maker:
                run[root(k)] = root(maker[id(t)])
    partial = {id(t) for op in tensor.reduced for t in op.outputs}
    feeds = {id(t) for op, _, _ in tensor.splits.values() for t in op.inputs}
    meets = {root(k) for k, (op, _, _) in seq.items()
             if any(id(t) in partial for t in op.inputs) or any(id(t) in feeds for t in op.outputs)}
    out = tensor.copy(tracked=dict(flow.tracked), blocked=list(flow.blocked))
    activations = {root(k) for k, (op, _, _) in seq.items()
                   if any(t.dtype.is_floating_point or t.dtype.is_complex for t in op.outputs)}
    out.splits.update({k: e for k, e in seq.items() if root(k) in meets and root(k) in activations})
    readers: Dict[int, List[IRFwOperation]] = {}
    for op in graph.select(ntype=IRFwOperation):
        for t in op.inputs:
            readers.setdefault(id(t), []).append(op)

    def designed(op: IRFwOperation, reads) -> bool:
        # a reshape read only by ops whole in the sequence (a flatten before a linear): its gather is
        # the one the plan makes before that op anyway
        return op_info(op.name).alias and all(_whole_in_sequence(r) for t in op.outputs
                                              for r in readers.get(id(t), ()))
    gathers(graph, out, num, "sequence parallel", skip=designed)
    return out


def _whole_in_sequence(op: IRFwOperation) -> bool:
    params = sum(t.numel() for t in op.inputs if getattr(t, "kind", None) is TensorKind.PARAM)
    return op_info(op.name).cost != "memory" or 2 * params > sum(t.numel() for t in op.outputs)


def expert_flow(graph: IRGraph, data: Flow, num: int) -> Flow:
    """``data`` (a data parallel plan) with the experts split ``num`` ways: from each expert weight
    (a parameter of three or more dims read by a batched matmul, its leading dim the experts),
    every op that carries the expert dim splits along it, up to (not including) the op that sums
    it away (the combine). So the tokens, batch-split outside, reach the experts through one
    all-to-all (batch pieces into expert pieces) and go back through one more, and each device
    keeps only its experts' weights.

    Raises:
        ValueError: the graph has no expert weights.
    """
    fused = [op for op in graph.select(ntype=IRFwOperation) if op_info(op.name).inside == "experts"]
    weights = {id(t): 0 for op in graph.select(ntype=IRFwOperation) if op_info(op.name).batched
               for t in op.inputs if getattr(t, "kind", None) is TensorKind.PARAM and t.ndim >= 3}
    if fused:   # sort-dispatch MoE layers fused by cube.ir.experts: split by experts, tokens all-to-all
        out = data.copy()
        for op in fused:
            if num > 1 and op.kwargs.get("by_id"):
                raise ValueError(f"expert parallel: the MoE layer at {op.where()} gathers a per-expert bias by the "
                                 f"sorted expert ids ({op.kwargs['by_id']}) before its experts run; cube splits "
                                 f"such a layer along its tokens (data, sequence, context parallel), not by "
                                 f"experts yet. Drop ep= for this model")
            w = next(i for i, t in enumerate(op.inputs) if getattr(t, "kind", None) is TensorKind.PARAM)
            out.splits[id(op)] = (op, w, 0)
        return out
    if not weights:
        raise ValueError("expert parallel: the model has no expert weights (a parameter with a leading expert "
                         "dim, (E, d, f), read by torch.bmm/einsum/matmul); write the experts as one such "
                         "weight, or drop ep=")
    if num == 1:
        return data
    experts = follow(graph, weights, num)
    ends = {id(op) for op in experts.reduced}
    out = data.copy()
    out.splits.update({k: v for k, v in experts.splits.items() if k not in ends})
    return out


def ends_inside(op: IRFwOperation, idx: int, dim: int) -> bool:
    """Whether splitting ``op`` at ``(idx, dim)`` ends the split inside its call: a ``~`` factor no
    output carries (the call makes them whole)."""
    factor = op.anno.inputs[idx][dim].head
    return factor.inside and not any(d.head is not None and d.head.name == factor.name
                                     for g in op.anno.outputs for d in g)


def cut(graph: IRGraph, node, split, num: int) -> list:
    """``node`` in ``num`` pieces: replicated (``split`` None), split along a letter of its
    annotation (a str), or at ``(idx, dim)``."""
    if split is None:
        return graph.replicate(node, times=num)
    if isinstance(split, str):
        return graph.partition(node, split, num=num)
    algo = node.algorithms("dim") if isinstance(node, IRFwOperation) else None
    return graph.partition(node, algo, idx=split[0], dim=split[1], num=num)


def place(graph: IRGraph, node, split: Optional[Tuple[int, int]], devices: List[int]) -> list:
    """Partitions ``node`` at ``split`` (or replicates it when None) over ``devices``, one piece each."""
    if len(devices) == 1:
        graph.assign(node, devices[0])
        return [node]
    pieces = cut(graph, node, split, len(devices))
    for dev, piece in zip(devices, pieces):
        graph.assign(piece, dev)
    return pieces
