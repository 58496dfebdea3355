"""Following one split through the graph: which (input, dim) of each op carries it.

Policies use this to find plans from the graph's structure instead of module
names: the batch dimension from the data operation onward (data parallel), or
the output features of a linear onward to the op that sums them away
(Megatron's column/row pairs, attention heads).
"""
from __future__ import annotations

import heapq
from collections import ChainMap
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
            gathered: ``_gathered_columns``; a weight's transpose) is whole here too, so the split
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
            if _ends_inside(op, *choice):   # its outputs are whole: a split of another dim goes on through it
                other = _choose(op, out, num)
                if other is not None:
                    _carry(op, *other, out.tracked)
            continue
        else:
            choice = _choose(op, out, num)
            if choice is not None and whole is not None and whole(op):
                _carry(op, *choice, out.tracked)   # the dim goes on: a later op may split the output
                continue
            if choice is None:
                region = local(op, out.tracked) if local is not None and _reads(op, out) else None
                if region is not None:
                    out.local.update({id(o): region for o in region.ops})
                    out.tracked.update({id(t): 0 for t in region.outputs})
                elif _reads(op, out):
                    out.blocked.append(op)
                continue
        idx, dim = choice
        out.splits[id(op)] = (op, idx, dim)
        if _carry(op, idx, dim, out.tracked) and op not in out.reduced:
            out.reduced.append(op)
    return out


def _carry(op: IRFwOperation, idx: int, dim: int, tracked) -> bool:
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


def _choose(op: IRFwOperation, flow: Flow, num: int) -> Optional[Tuple[int, int]]:
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
    ``_choose`` refused), in a few words: no rule, a dim its rule keeps whole, a size ``num``
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


def megatron_flow(graph: IRGraph, num: int, vocab: bool = False) -> Flow:
    """Megatron's plan found from structure: column-split a linear whose input is whole
    when its output features reach, through ops that can carry the split (activations,
    head reshapes, attention), an op that sums them away (a row linear, a reduction).
    Linears whose split would hit an op that cannot carry it stay whole.

    With ``vocab``, Megatron's vocabulary parallelism too: a column split may also end in
    an op that sums it away inside its call (``~``: the LM head's logits split over the
    vocabulary up to a vocabulary-parallel cross entropy, ``OpInfo.inside="vocab_loss"``),
    and every embedding whose table has as many rows as such a loss has classes (the
    input embedding, tied to the LM head or not) is split along its rows
    (``"vocab_lookup"``), so no rank holds a whole copy of the vocabulary's weights.

    Each linear's trial follows its split only through the ops that read what it
    splits (what ``follow`` from that linear would change), so the whole search
    is linear in the graph's size.

    ``losses`` lists the linears kept whole because their split stops at an op that
    could carry a split but not this one (no rule, a dim its rule keeps whole, a size
    the pieces do not divide: a KV-cache ``cat``, a fused q/k/v ``split``). A split
    that reaches a norm, softmax or loss (a row linear before a residual norm, a
    router, an LM head without ``vocab``) or no sum at all is whole by design and not
    listed, nor is a linear that a listed one keeps whole with it (the output
    projection after a lost q projection)."""
    flow = Flow(empty="no linear pairs found to split")
    readers = _Readers(graph)
    behind = set()   # linears a lost one keeps whole too (the output projection after a q projection)
    for op in readers.ops:
        info = op_info(op.name)   # a matmul of an input and a weight
        if info.cost != "matmul" or info.batched or id(op) in flow.splits or op.anno is None:
            continue
        col = _column(op, readers.makers)
        if col is None or not op.algorithms("dim").satisfy(*col, num):
            continue
        trial = _trial(readers, flow, op, col, num, inside_ends=vocab)
        if trial.stop is None and _sums_activations(trial, readers):
            flow.shared.add(id(op))
            continue
        if trial.stop is None:
            flow.splits.update(trial.splits)
            flow.tracked.update(trial.tracked)
            flow.reduced.extend(trial.reduced)
        elif trial.lost and id(op) not in behind:
            # stopped at a dim the op must read whole (a slice of it) with no sum past it: no Megatron pair
            # was there to lose (DeepSeek-V3's rotary key, one head shared by all: its features are rotary
            # dims, which the rotation's halves mix), so the linear is whole by design. A stop for want of a
            # rule or of a divisible size is a pair lost (a q projection's rotary, a fused q/k/v reshape)
            past = _trial(readers, flow, op, col, num, inside_ends=vocab, past=True)
            if trial.marked and not past.reduced:
                continue
            stop = trial.stop
            flow.losses[id(op)] = Loss(op, f"its column split ({num} pieces of its output features) stops at "
                                           f"op '{stop.name}' ({stop.where()}): {trial.why}", "tensor parallel",
                                       weights=_params_read(op, readers.makers))
            behind.update(past.splits)
    _gathered_columns(readers, flow, num)
    _weight_views(readers, flow, num)
    _pull_splits(readers, flow, num)
    if vocab:
        _vocab_embeddings(readers.ops, flow, num)
    return flow


def _sums_activations(trial: "_Trial", readers: "_Readers") -> bool:
    """Whether a column split ends in the partial sums of a product of two activations: features
    contracted inside a scan or an attention-like product (the state size of a Mamba-2 layer's ``B`` and
    ``C`` in ``C^T B``), whose partial sums (one per token pair and head) dwarf a row linear's. No
    Megatron pair ends so: the linear is whole by design (Megatron-LM keeps ``B`` and ``C`` whole where
    their groups do not split)."""
    return any(op_info(op.name).cost == "matmul" and not any(_from_param(t, readers.makers) for t in op.inputs)
               for op in trial.reduced)


def _from_param(t: IRTensor, makers: Dict[int, IRFwOperation], steps: int = 4) -> bool:
    """Whether ``t`` is a parameter or made of one by a few one-input ops (``W.T``, ``W.to(dtype)``)."""
    for _ in range(steps + 1):
        if t.kind is TensorKind.PARAM:
            return True
        m = makers.get(id(t))
        if m is None or len(m.inputs) != 1:
            return False
        t = m.inputs[0]
    return False


def _params_read(op: IRFwOperation, makers: Dict[int, IRFwOperation]) -> Tuple[IRTensor, ...]:
    """The parameters ``op`` reads, directly or through views (``x @ w.T``)."""
    found: Dict[int, IRTensor] = {}
    for t in op.inputs:
        while t.kind is not TensorKind.PARAM:
            m = makers.get(id(t))
            if m is None or not op_info(m.name).alias or len(m.inputs) != 1:
                break
            t = m.inputs[0]
        if t.kind is TensorKind.PARAM:
            found[id(t)] = t
    return tuple(found.values())


_CHAIN = 8   # the most ops between a parameter and the split op reading it that _weight_views follows


def _weight_views(readers: _Readers, flow: Flow, num: int) -> None:
    """Adds to ``flow`` the split of the ops between a parameter and a split op that reads what they
    make of it, each op one tensor in, one out and read only by the next: ``x @ w.T`` (Falcon's
    linear) cut along the split, so each rank holds its piece of the weight itself, not the whole
    weight and a piece of its transpose; Mamba's ``A = -exp(A_log.float())`` read as
    ``A[None, :, None, :]`` and its ``D[None, :, None]`` in a scan split by channels, so each rank
    holds its channels' rows."""
    makers = readers.makers
    for op, idx, dim in list(flow.splits.values()):
        letter = op.anno.inputs[idx][dim].head
        for j, t in enumerate(op.inputs):
            at = [d for d, g in enumerate(op.anno.inputs[j]) if g.head is not None and g.head.name == letter.name]
            if len(at) != 1 or t.kind is TensorKind.PARAM:
                continue
            chain, cur, d = [], t, at[0]
            while len(chain) < _CHAIN and cur.kind is not TensorKind.PARAM:
                m = makers.get(id(cur))
                if m is None or id(m) in flow.splits or m.anno is None or len(m.inputs) != 1 or \
                        len(m.outputs) != 1 or len(readers.of.get(id(cur), ())) != 1:
                    break
                out = m.anno.outputs[0][d].head
                src = [k for k, g in enumerate(m.anno.inputs[0]) if g.head is not None and out is not None
                       and g.head.name == out.name]
                if len(src) != 1 or not m.algorithms("dim").satisfy(0, src[0], num):
                    break
                chain.append((m, 0, src[0]))
                cur, d = m.inputs[0], src[0]
            if chain and cur.kind is TensorKind.PARAM:
                flow.splits.update((id(m), (m, i, k)) for m, i, k in chain)


def _pull_splits(readers: _Readers, flow: Flow, num: int) -> None:
    """Adds to ``flow`` the split of each op left whole whose output only split ops read, all along one
    dim its rule can split: each rank then computes its piece of that output instead of the whole of
    it to keep a piece (a whole op's output read by a split op is cut locally, so this moves no data).
    Followed back op by op: Mamba-2's ``C^T B`` per head (an einsum over ``B`` and ``C`` repeated to the
    heads) runs on each rank's heads. An op that draws random numbers stays as it is."""
    changed = True
    while changed:
        changed = False
        for op in reversed(readers.ops):
            if id(op) in flow.splits or op.anno is None or len(op.outputs) != 1 or \
                    getattr(op, "draw", None) is not None:
                continue
            t = op.outputs[0]
            dims = set()
            for i in readers.of.get(id(t), ()):
                split = flow.splits.get(id(readers.ops[i]))
                if split is None:
                    dims = None
                    break
                r, idx, dim = split
                letter = r.anno.inputs[idx][dim].head.name
                dims |= {d for k, x in enumerate(r.inputs) if x is t for d, g in enumerate(r.anno.inputs[k])
                         if g.head is not None and g.head.name == letter}
            if not dims or len(dims) != 1:
                continue
            out = op.anno.outputs[0][dims.pop()].head
            src = [(k, d) for k, g in enumerate(op.anno.inputs) for d, x in enumerate(g)
                   if out is not None and x.head is not None and x.head.name == out.name]
            if src and op.algorithms("dim").satisfy(*src[0], num):
                flow.splits[id(op)] = (op, *src[0])
                changed = True


# rules of ops that need every element along the dims they keep whole (a norm, softmax, a loss, a
# max, a top-k or sort): a linear's column split that reaches one is no Megatron pair (a row linear
# before a residual norm, a router before its softmax or its top-k, as GraniteMoE's and GPT-OSS's
# routers pick their experts from the logits), so the linear is whole by design, not lost
_NORMALIZING = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "along_dim", "loss",
                          "pointwise_loss", "max_rule", "topk"})


def _normalizes(op: IRFwOperation) -> bool:
    return op_info(op.name).rule in _NORMALIZING


def _marked(op: IRFwOperation, tracked: Dict[int, int]) -> bool:
    """Whether ``op``'s rule marks whole (``^``) the last dim along which it reads a split input of
    one head all heads share (a dim of size 1 before it, as ``(B, 1, S, D)``): a slice of a shared
    rotary key's features (DeepSeek-V3's ``k_rot``). A slice of a fused projection's features (a
    q/k/v split cube did not cut into its own linears) is no such stop: it stays a lost pair."""
    if op.anno is None:
        return False
    for i, t in enumerate(op.inputs):
        d = tracked.get(id(t))
        if d is None or d != t.ndim - 1 or d >= len(op.anno.inputs[i]) or 1 not in tuple(t.shape[1:d]):
            continue
        head = op.anno.inputs[i][d].head
        if head is not None and head.marked:
            return True
    return False


def _gathered_columns(readers: "_Readers", flow: Flow, num: int) -> None:
    """Adds to ``flow`` the column split of every linear left whole whose input is whole and whose
    output feeds an op the flow splits (through ops it leaves whole, before another matmul): the
    split ends at the linear, whose output the planner gathers (Megatron's column linear with
    ``gather_output``).

    This is a key or value projection of grouped-query attention with fewer key/value heads than
    ``num`` (Phi-3's 2 under 4-way tensor parallelism): its heads cannot be split ``num`` ways, so
    its column split cannot travel to the attention, which reads them repeated per query head.
    Whole, the projection's weight would be on every rank (and its gradient summed over them);
    split, each rank holds ``1/num`` of it, and its output, ``num`` times smaller than the
    queries', is all-gathered (its gradient reduce-scattered). A linear feeding nothing split (a
    language model's head, read by the loss) stays whole as before."""
    for op in readers.ops:
        info = op_info(op.name)
        if info.cost != "matmul" or info.batched or id(op) in flow.splits or op.anno is None \
                or any(id(t) in flow.tracked for t in op.inputs):
            continue
        col = _column(op, readers.makers)
        if col is not None and op.algorithms("dim").satisfy(*col, num) and _feeds_split(readers, flow, op):
            flow.splits[id(op)] = (op, *col)
            flow.losses.pop(id(op), None)   # kept after all: its output is gathered, not the weight


def _feeds_split(readers: "_Readers", flow: Flow, start: IRFwOperation) -> bool:
    """Whether an op ``flow`` splits reads what ``start`` makes, through ops it leaves whole and
    that are not matmuls (the search ends at the next matmul, so it stays near ``start``)."""
    todo, seen = [readers.pos[id(start)]], set()
    while todo:
        op = readers.ops[todo.pop()]
        for t in op.outputs:
            for j in readers.of.get(id(t), ()):
                if j in seen:
                    continue
                seen.add(j)
                nxt = readers.ops[j]
                if id(nxt) in flow.splits:
                    return True
                if op_info(nxt.name).cost != "matmul":
                    todo.append(j)
    return False


def _vocab_embeddings(ops: List[IRFwOperation], flow: Flow, num: int) -> None:
    """Adds to ``flow`` the row split of every embedding whose table has as many rows as a loss the
    flow splits along its classes (inside its call) has classes."""
    classes = {op.inputs[idx].shape[dim] for op, idx, dim in flow.splits.values()
               if op_info(op.name).inside == "vocab_loss"}
    for op in ops:
        if op_info(op.name).inside == "vocab_lookup" and id(op) not in flow.splits and \
                op.inputs[0].shape[0] in classes and op.algorithms("dim").satisfy(0, 0, num):
            flow.splits[id(op)] = (op, 0, 0)


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


class _Readers:
    """The forward ops in program order and, per tensor, the positions of the ops reading it and the
    op making it."""

    def __init__(self, graph: IRGraph):
        self.ops = graph.select(ntype=IRFwOperation)
        self.of: Dict[int, List[int]] = {}
        self.makers: Dict[int, IRFwOperation] = {id(t): op for op in self.ops for t in op.outputs}
        for i, op in enumerate(self.ops):
            for t in op.inputs:
                at = self.of.setdefault(id(t), [])
                if not at or at[-1] != i:
                    at.append(i)
        self.pos = {id(op): i for i, op in enumerate(self.ops)}


class _Overlay:
    """A flow seen through a trial's additions (what ``_choose`` reads)."""

    def __init__(self, flow: Flow, tracked: Dict[int, int]):
        self.tracked = ChainMap(tracked, flow.tracked)


def _ends_inside(op: IRFwOperation, idx: int, dim: int) -> bool:
    """Whether splitting ``op`` at ``(idx, dim)`` ends the split inside its call: a ``~`` factor no
    output carries (the call makes them whole)."""
    factor = op.anno.inputs[idx][dim].head
    return factor.inside and not any(d.head is not None and d.head.name == factor.name
                                     for g in op.anno.outputs for d in g)


@dataclass
class _Trial:
    """What a linear's column split adds to a flow, or where it stops.

    Attributes:
        splits, tracked, reduced: what it adds (when ``stop`` is None).
        stop: the op it stops at (None: the split is kept); the linear itself when it goes nowhere.
        why: why it stops there.
        lost: it stops at an op that could carry a split but not this one (no rule, a dim the
            rule keeps whole, a size the pieces do not divide), not at one that needs every
            feature (a norm, softmax or loss: there the linear is whole by design).
        marked: the stop slices the features of one head all heads share (``_marked``).
    """

    splits: Dict[int, Tuple[IRFwOperation, int, int]] = field(default_factory=dict)
    tracked: Dict[int, int] = field(default_factory=dict)
    reduced: List[IRFwOperation] = field(default_factory=list)
    stop: Optional[IRFwOperation] = None
    marked: bool = False   # ``stop`` slices the features of one head all heads share (``_marked``)
    why: str = ""
    lost: bool = False


def _trial(readers: _Readers, flow: Flow, start: IRFwOperation, col: Tuple[int, int], num: int,
           inside_ends: bool = False, past: bool = False) -> _Trial:
    """Follows a column split of ``start`` through the ops that read the tensors it splits.

    Gives what ``follow(graph, {}, num, flow, start={id(start): col})`` would add
    to ``flow``, visiting only the ops it can change, when the split ends in a sum
    (with ``inside_ends``, also one made inside an op's call) or joins one of
    ``flow``'s splits; else where it stops: at an op that cannot carry it, or
    nowhere.

    With ``past``, an op that cannot carry the split does not stop it: the op is left whole and
    the split goes on along the other paths, so ``splits`` holds every op the split would reach
    with that op whole (the ops a lost column split keeps whole with it: the attention and
    output projection after a q projection whose rotary embedding has no rule).
    """
    trial = _Trial()
    view = _Overlay(flow, trial.tracked)
    first = readers.pos[id(start)]
    heap, queued, joins = [first], {first}, False
    while heap:
        i = heapq.heappop(heap)
        op = readers.ops[i]
        if op is start:
            choice = col
        elif id(op) in flow.splits:   # already split: the new split joins it
            joins = True
            continue
        else:
            choice = _choose(op, view, num)
            if choice is None and past:
                continue
            if choice is None:        # reads the split but cannot carry it
                return _Trial(stop=op, why=refusal(op, view.tracked, num), lost=not _normalizes(op),
                              marked=_marked(op, view.tracked))
        if op is not start and _ends_inside(op, *choice) and not inside_ends:
            if past:
                continue
            return _Trial(stop=op, why="it sums the split away inside its call (a loss over the classes)")
        trial.splits[id(op)] = (op, *choice)
        made: Dict[int, int] = {}
        if _carry(op, *choice, made):
            trial.reduced.append(op)
        elif op is not start and _ends_inside(op, *choice):
            joins = True
        trial.tracked.update(made)
        for t in made:
            for j in readers.of.get(t, ()):
                if j not in queued:
                    queued.add(j)
                    heapq.heappush(heap, j)
    if trial.reduced or joins or past:
        return trial
    return _Trial(stop=start, why="its split reaches no op that sums it away")


def _unsqueezed_param(t: IRTensor, makers: Dict[int, IRFwOperation]) -> bool:
    """Whether ``t`` is a parameter given dims of 1 by ``unsqueeze`` ops (``W[:, None]``)."""
    while t.kind is not TensorKind.PARAM:
        m = makers.get(id(t))
        if m is None or m.name != "unsqueeze" or len(m.inputs) != 1:
            return False
        t = m.inputs[0]
    return True


def _column(op: IRFwOperation, makers: Dict[int, IRFwOperation]) -> Optional[Tuple[int, int]]:
    """(idx, dim) of the output-feature split of a matmul-like op: the weight's dim of 'n'; for a
    matmul by experts' matrices from a parameter, their dim of experts."""
    for idx, group in enumerate(op.anno.inputs):
        for dim, d in enumerate(group):
            if d.head is not None and d.head.name == "n" and op.inputs[idx].ndim == 2:
                return idx, dim
    if op.name == "matmul" and op.inputs[1].ndim >= 3 and op.inputs[1].kind is not TensorKind.PARAM and \
            op.inputs[1].shape[0] == op.inputs[0].shape[0] > 1 and _unsqueezed_param(op.inputs[1], makers):
        # experts' matrices, one per row of dim 0, multiplying every token (Llama 4's MoE as
        # cube.trace.major gives it): split by experts, each rank its experts' weights whole, the
        # experts' sum over dim 0 the partial sums a row linear's would be
        head = op.anno.inputs[1][0].head
        if head is not None and not head.inside:
            return 1, 0
    if op.name in ("matmul", "mm") and op.inputs[0].ndim == 2 and op.inputs[0].kind is TensorKind.PARAM:
        # ``W @ x`` (Mamba's ``dt_proj.weight @ time_step.transpose(1, 2)``): the weight's rows ('m') are the
        # output features
        head = op.anno.inputs[0][0].head
        if head is not None and head.name == "m":
            return 0, 0
    return None


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
