"""Megatron-LM's tensor parallel plan found from the graph's structure (``megatron_flow``).

A linear (or a matmul by a parameter) whose input is whole is split by its output features when
they reach, through ops that carry the split (activations, head reshapes, attention), an op that
sums them away (a row linear, a reduction): Megatron's column/row pairs and attention heads.
Each linear's trial follows its split only through the ops that read what it splits, with the
same choices ``cube.ir.follow.follow`` makes, so the search is linear in the graph's size.
"""
from __future__ import annotations

import heapq
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from cube.ir.follow import Flow, Loss, carry, choose, ends_inside, refusal
from cube.ir.graph import IRGraph
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind


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
    """A flow seen through a trial's additions (what ``choose`` reads)."""

    def __init__(self, flow: Flow, tracked: Dict[int, int]):
        self.tracked = ChainMap(tracked, flow.tracked)


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
            choice = choose(op, view, num)
            if choice is None and past:
                continue
            if choice is None:        # reads the split but cannot carry it
                return _Trial(stop=op, why=refusal(op, view.tracked, num), lost=not _normalizes(op),
                              marked=_marked(op, view.tracked))
        if op is not start and ends_inside(op, *choice) and not inside_ends:
            if past:
                continue
            return _Trial(stop=op, why="it sums the split away inside its call (a loss over the classes)")
        trial.splits[id(op)] = (op, *choice)
        made: Dict[int, int] = {}
        if carry(op, *choice, made):
            trial.reduced.append(op)
        elif op is not start and ends_inside(op, *choice):
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
