"""The execution plan of each rank: its op pieces, the communication between
them, the pieces of parameters it holds and the gradients it must reduce.

Built once for all ranks, walking the logical ops in program order, so every
collective appears at the same point of every member's program and a value
moved once is reused by later readers on all members alike.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph
from cube.ir.layout import Box, PieceLayout, Term, box_shape, contains, full_box, piece_layout
from cube.ir.operator import IRDataOperation, IRFwOperation, IROperator
from cube.ir.ops import op_info
from cube.ir.tensor import IRTensor, TensorKind
from cube.passes.adapter import P2P_KINDS, RERUNNABLE_KINDS, LayoutError, Step, narrow_step, transitions
from cube.passes.exchange import Take, check, exchange, relative
from cube.passes.inside import Inside, plan_inside


@dataclass(eq=False)
class Call:
    """One statement of a rank's forward: an op piece, or one step moving a value."""

    inputs: List[IRTensor]
    outputs: List[IRTensor]
    op: Optional[IRFwOperation] = None      # an op piece, or None for a step
    step: Optional[Step] = None
    layout: Optional[PieceLayout] = None    # of the op piece
    subst: Dict[int, IRTensor] = field(default_factory=dict)   # logical tensor id -> local value
    term_ranks: Tuple[int, ...] = ()        # ranks holding the other partial sums of the output
    count_of: Optional[IRTensor] = None     # the batch tensor a mean loss's targets are a view of
    rerun: bool = True                      # a collective step recompute may run again in backward
    defer_wgrad: Optional[str] = None       # split backward: the cube.runtime.zb function leaving its weight grad to W
    inside: Optional[Inside] = None         # a piece communicating inside its call (cube.passes.inside)
    amax_ranks: Tuple[int, ...] = ()        # a float8 piece: ranks whose pieces share its scales (cube.passes.float8)


@dataclass
class RankPlan:
    """What one rank runs."""

    rank: int
    world: int
    data: IRDataOperation
    data_boxes: List[Box]
    calls: List[Call]
    attrs: List[Tuple[IRTensor, Box]]                 # this rank's pieces of params/buffers/consts
    reduce: List[Tuple[IRTensor, Tuple[int, ...]]]    # params whose gradient sums over ranks, in bucket order
    loss: IRTensor
    loss_sum: Tuple[int, ...] = ()   # forward returns a partial loss, summed over these ranks by train_step
    loss_from: Optional[int] = None  # scheduled plans: the rank that sends this rank the step's loss
    loss_to: Tuple[int, ...] = ()    # scheduled plans: the ranks this rank sends the step's loss to
    # ids of parameters (of ``reduce``) summed only after backward: their gradients become ready at
    # different points of backward on different members of the group (a tied weight read by other
    # ops on other ranks), so a sum started from backward would meet other collectives there
    reduce_after: frozenset = frozenset()


def _describe(op: IROperator) -> str:
    return f"op {op.name!r} ({op.where()})" if isinstance(op, IRFwOperation) else "the data operation"


def build_plans(graph: IRGraph, world: int) -> Dict[int, RankPlan]:
    """Plans every rank of a partitioned, placed graph.

    Raises:
        ValueError: the placement cannot run (two pieces of one op on a rank, a
            value read where it is not made, layouts no primitive connects).
    """
    # pieces of each logical op, by rank
    logical: List[IROperator] = []
    pieces: Dict[int, Dict[int, IROperator]] = {}
    for op in graph.ops:
        lop = op.root
        if id(lop) not in pieces:
            logical.append(lop)
            pieces[id(lop)] = {}
        for r in op.device or ():
            if r in pieces[id(lop)]:
                raise ValueError(f"{_describe(lop)} has two pieces on device {r}; put each piece of an op "
                                 f"on a different device (or partition it into fewer pieces)")
            pieces[id(lop)][r] = op
    shared: dict = {}   # replicas share a layout; pieces of an op share its full boxes
    layouts = {id(p): piece_layout(p, shared) for by in pieces.values() for p in by.values()}

    data_lop = next(op for op in logical if isinstance(op, IRDataOperation))
    data_pieces = pieces[id(data_lop)]
    for r in range(world):
        if r not in data_pieces:
            raise ValueError(f"device {r} holds no piece of the data operation; replicate or partition it "
                             f"over all {world} devices")

    # where each value is made: tensor id -> rank -> (box, term)
    made: Dict[int, Dict[int, Tuple[Box, Term]]] = {}
    makers: Dict[int, IROperator] = {}
    # attribute pieces: the bounding box of what the rank's consumers read
    attr_ids = {id(t): t for t in graph.attrs}
    alloc: Dict[int, Dict[int, Box]] = {}
    for lop in logical:
        for r, p in pieces[id(lop)].items():
            lay = layouts[id(p)]
            for k, (t, b) in enumerate(zip(p.inputs, lay.inputs)):
                if id(t) in attr_ids and k not in lay.unread:
                    old = alloc.setdefault(id(t), {}).get(r)
                    alloc[id(t)][r] = b if old is None else tuple(
                        (min(x[0], y[0]), max(x[1], y[1])) for x, y in zip(old, b))
    for tid, by in alloc.items():
        made[tid] = {r: (b, ()) for r, b in by.items()}
    for t in graph.attrs:   # read by no op: kept whole on every rank, so no state is lost
        if id(t) not in alloc:
            alloc[id(t)] = {r: full_box(t.shape) for r in range(world)}

    # walk the logical ops in order; plan all ranks together
    calls: Dict[int, List[Call]] = {r: [] for r in range(world)}
    local: Dict[int, Dict[tuple, IRTensor]] = {r: {} for r in range(world)}   # (tensor id, steps) -> value
    received: Dict[int, Dict[tuple, IRTensor]] = {r: {} for r in range(world)}  # (tensor id, source) -> value
    raw: List[Tuple[IROperator, int, IRTensor, Dict[int, List[Step]]]] = []
    tags: Dict[tuple, int] = {}   # (tensor id, source, destination) -> tag of the transfer
    # (op id, input) -> each reader's takes (None: the op reads the same value through an earlier input)
    exchanges: Dict[Tuple[int, int], Optional[Dict[int, List[Take]]]] = {}
    grad_ops = _ops_passing_gradients(logical, graph.loss)
    live_recvs: set = set()   # (tensor id, source, destination) of receives some reader needs the gradient of
    for lop in logical:
        by = pieces[id(lop)]
        if isinstance(lop, IRDataOperation):
            for r, p in by.items():
                for t, b in zip(p.outputs, layouts[id(p)].outputs):
                    made.setdefault(id(t), {})[r] = (b, ())
                    makers[id(t)] = lop
            continue
        for k, t in enumerate(lop.inputs):
            # a read whose gradient never comes (the op's outputs reach no loss: a shape-only read)
            # moves no gradient: a point-to-point sender would wait for it forever
            grad = t.requires_grad and id(lop) in grad_ops
            readers = {r: p for r, p in by.items() if k not in layouts[id(p)].unread}
            need = {r: layouts[id(p)].inputs[k] for r, p in readers.items()}
            contrib = {r: layouts[id(p)].in_terms[k] if grad else () for r, p in readers.items()}
            try:
                src, moves = _sources(t, made, need, tags)
                steps = transitions(src, need, contrib, what=f"{t!r}")
                for r, recv in moves.items():
                    steps[r].insert(0, recv)
                    if grad:
                        live_recvs.add((id(t),) + recv.ranks)
            except LayoutError as e:
                if t.kind not in (TensorKind.ACTIVATION, TensorKind.DATA):
                    raise ValueError(f"{_describe(lop)} reads {t!r} in a layout cube cannot produce from "
                                     f"its pieces: {e}. Partition its readers alike.") from None
                steps = {r: [] for r in need}
                twin = next((j for j in range(k) if lop.inputs[j] is t), None)
                if twin is not None and (id(lop), twin) in exchanges:   # mul(x, x): one value serves both
                    exchanges[(id(lop), k)] = None
                else:
                    exchanges[(id(lop), k)] = _exchange(t, made, need, contrib, grad, lop, k, makers, tags)
            raw.append((lop, k, t, steps))
        for r, p in by.items():
            for t, b, term in zip(p.outputs, layouts[id(p)].outputs, layouts[id(p)].out_terms):
                made.setdefault(id(t), {})[r] = (b, term)
                makers[id(t)] = lop

    _sum_earlier(raw, makers, pieces, layouts)
    _sum_at_parameters(raw, makers, pieces, layouts)
    after: set = set()
    reduce = _defer_param_reductions(graph, raw, world, alloc, after)
    # bucket order, the same on every member of a group: the parameters whose first reader (in the
    # program order all ranks share) comes last are ready first; a rank-local order would differ
    # between members that read a tied weight at different points, and sum unlike tensors
    first_read: Dict[int, int] = {}
    op_index = {id(lop): i for i, lop in enumerate(logical)}
    for lop, _, t, _ in raw:
        first_read.setdefault(id(t), op_index[id(lop)])
    for entries in reduce.values():
        entries.sort(key=lambda e: -first_read.get(id(e[0]), -1))

    # emit: per logical op, its inputs' steps then the piece
    raw_by_op: Dict[int, List[Tuple[int, IRTensor, Dict[int, List[Step]]]]] = {}
    for lop, k, t, steps in raw:
        raw_by_op.setdefault(id(lop), []).append((k, t, steps))
    for lop in logical:
        if isinstance(lop, IRDataOperation):
            continue
        by = pieces[id(lop)]
        subst: Dict[int, Dict[int, IRTensor]] = {r: {} for r in by}
        before = {r: len(c) for r, c in calls.items()}
        for k, t, steps in raw_by_op.get(id(lop), []):
            if (id(lop), k) in exchanges:
                if exchanges[(id(lop), k)] is not None:
                    # a recompute run re-runs its calls: receives stay separate, moved to its edge
                    fuse = all(getattr(p, "recompute", None) is None for p in by.values())
                    _emit_exchange(t, exchanges[(id(lop), k)], made[id(t)], calls, subst, fuse)
                continue
            base: Dict[int, IRTensor] = {}
            for r in steps:    # values from other device groups: sent once, received once
                if steps[r] and steps[r][0].kind == "recv":
                    recv = steps[r].pop(0)
                    q = recv.ranks[0]
                    if (id(t), q) not in received[r]:
                        if t.requires_grad and (id(t),) + recv.ranks not in live_recvs:
                            recv = replace(recv, grad="none")   # no reader on r returns its gradient
                        out = _moved(t, recv.box, f"from{q}")
                        calls[q].append(Call([t], [], step=Step("send", recv.ranks, box=recv.box, tag=recv.tag,
                                                                grad=recv.grad)))
                        calls[r].append(Call([], [out], step=recv))
                        received[r][(id(t), q)] = out
                    base[r] = received[r][(id(t), q)]
            keys = {r: (id(base.get(r, t)), tuple(s.signature() for s in steps[r])) for r in steps}
            hits = {r: keys[r] in local[r] for r in steps}
            for r in steps:
                key = keys[r]
                members = {m for s in steps[r] for m in s.ranks}
                if hits[r] and all(hits.get(m, False) for m in members):
                    subst[r][id(t)] = local[r][key]
                    continue
                value = base.get(r, t)
                for s in steps[r]:
                    out = _moved(t, s.box, _SHORT[s.kind])
                    calls[r].append(Call([value], [out], step=s))
                    value = out
                local[r][key] = value
                subst[r][id(t)] = value
        fed = [c for r in calls for c in calls[r][before[r]:]]
        if any(c.step.kind in ("recv", "gather") for c in fed):
            # some rank receives an input of this op point to point, which cuts a recompute run there:
            # no member may re-run this op's collectives in backward (cube.passes.recompute)
            for c in fed:
                c.rerun = False
        term_groups: dict = {}
        for r, p in by.items():
            lay = layouts[id(p)]
            term_ranks = _term_ranks(p, r, by, layouts, term_groups)
            count_of = _batch_origin(p.inputs[1], makers) if term_ranks and op_info(p.name).counts_targets else None
            reads = [subst[r].get(id(t), t) for k, t in enumerate(p.inputs) if k not in lay.unread]
            calls[r].append(Call(reads, list(p.outputs), op=p, layout=lay, subst=subst[r], term_ranks=term_ranks,
                                 count_of=count_of, inside=plan_inside(p, by, r, lay)))

    # the loss: the full value on every rank
    loss = graph.loss
    holders = made.get(id(loss), {})
    try:
        loss_steps = transitions(holders, {r: () for r in holders}, {r: () for r in holders}, what="the loss")
    except LayoutError as e:
        raise ValueError(f"the loss cannot be made whole on the devices that make it: {e}") from None
    crossing = len(holders) < world     # made on some devices (a last stage): sent to the others
    finals: Dict[int, IRTensor] = {}
    loss_sums: Dict[int, Tuple[int, ...]] = {}
    for r in sorted(holders):
        value = loss
        if not crossing and graph.schedule is None and len(loss_steps[r]) == 1 \
                and loss_steps[r][0].kind == "all_reduce":
            # the sum's backward is the identity: backward starts from this rank's part
            # while the parts are summed for the returned value (a schedule sums in forward)
            loss_sums[r] = loss_steps[r].pop().ranks
        for s in loss_steps[r]:
            out = IRTensor((), loss.dtype, loss.requires_grad, TensorKind.ACTIVATION, "loss")
            calls[r].append(Call([value], [out], step=s))
            value = out
        finals[r] = value
    senders = sorted(holders)
    scheduled = graph.schedule is not None
    loss_from: Dict[int, int] = {}
    for r in range(world):
        if r in holders:
            continue
        q = senders[r % len(senders)]
        loss_from[r] = q
        if scheduled:   # the runtime sends the mean over micro-batches once, after the schedule
            finals[r] = IRTensor((), loss.dtype, False, TensorKind.ACTIVATION, "loss")
            continue
        tag = tags.setdefault((id(loss), q, r), len(tags) + 1)
        calls[q].append(Call([finals[q]], [], step=Step("send", (q, r), box=(), grad="none", tag=tag)))
        finals[r] = IRTensor((), loss.dtype, False, TensorKind.ACTIVATION, "loss")
        calls[r].append(Call([], [finals[r]], step=Step("recv", (q, r), box=(), grad="none", tag=tag)))
    _keep_collectives_of_cut_runs(calls)
    plans = {}
    for r in range(world):
        data_piece = data_pieces[r]
        attrs = [(t, alloc[id(t)][r]) for t in graph.attrs if r in alloc.get(id(t), {})]
        plans[r] = RankPlan(r, world, data_piece, list(layouts[id(data_piece)].outputs), calls[r], attrs,
                            reduce.get(r, []), finals[r], loss_sums.get(r, ()),
                            loss_from.get(r) if scheduled else None,
                            tuple(q for q, src in loss_from.items() if src == r) if scheduled else (),
                            frozenset(id(t) for t, _ in reduce.get(r, []) if id(t) in after))
    return plans


def _moved(t: IRTensor, box: Box, suffix: str) -> IRTensor:
    """The local value a communication step makes from ``t``: ``box`` of it, named after it."""
    return IRTensor(box_shape(box), t.dtype, t.requires_grad, TensorKind.ACTIVATION,
                    f"{t.name.replace('.', '_') if t.name else t.hint}_{suffix}", part_of=t.logical)


_SHORT = {"all_reduce": "sum", "reduce_scatter": "rs", "all_gather": "ag", "all_to_all": "a2a",
          "chunk": "chunk", "narrow": "part", "identity_all_reduce": "f", "detach": "nograd"}


def _sources(t: IRTensor, made, need: Dict[int, Box], tags: Dict[tuple, int]):
    """Where each reader of ``t`` gets it when collectives can move it: its own piece, or a whole
    piece received from one rank of another device group that sends to no one else and reads
    nothing itself (so the gradient it gets back is its piece's, counted once).

    Returns ``(src, moves)``: ``src[r] = (box, term)`` of the piece rank ``r``
    starts from, and ``moves[r]``, the ``recv`` step of a rank that starts from
    a piece another rank sends (a tag taken for a pairing then refused is never used: harmless).

    Raises:
        LayoutError: no such pairing exists (a point-to-point exchange moves the value instead).
    """
    where = made.get(id(t), {})
    src = {r: where[r] for r in need if r in where}
    moves: Dict[int, Step] = {}
    senders = set()
    for r in sorted(need):
        if r in src:
            continue
        cands = sorted(q for q, (box, term) in where.items()
                       if not term and contains(box, need[r]) and q not in need and q not in senders)
        if not cands:
            raise LayoutError(f"no rank of {sorted(where)} can send rank {r} a whole piece of {t!r} alone")
        q = cands[0]
        senders.add(q)
        moves[r] = Step("recv", (q, r), box=where[q][0], tag=tags.setdefault((id(t), q, r), len(tags) + 1))
        src[r] = (where[q][0], ())
    if t.requires_grad and t.kind is not TensorKind.PARAM:
        idle = sorted(q for q in where if q not in need and q not in senders)
        if idle:   # replicas there would miss their gradient
            raise LayoutError(f"{t!r} is made on ranks {idle} that neither read nor send it")
    return src, moves


def _exchange(t: IRTensor, made, need: Dict[int, Box], contrib: Dict[int, Term], grad: bool, lop: IROperator,
              k: int, makers, tags: Dict[tuple, int]) -> Dict[int, List[Take]]:
    """Each reader's takes of ``t`` by point-to-point exchange (:mod:`cube.passes.exchange`);
    ``grad``: whether the readers return a gradient.

    Raises:
        ValueError: some reader's box is not covered by the pieces of ``t``.
    """
    where = made.get(id(t), {})

    def tag(q: int, r: int, region: Box) -> int:
        return tags.setdefault((id(t), q, r, region, id(lop), k), len(tags) + 1)   # an op may read t twice
    try:
        takes = exchange(where, need, contrib, grad, tag, what=repr(t))
        check(where, need, contrib, grad, takes, what=repr(t))
        return takes
    except LayoutError as e:
        maker = makers.get(id(t))
        made_by = f", made by {_describe(maker)}," if maker is not None else ""
        raise ValueError(f"{_describe(lop)} reads {t!r}{made_by} but its pieces do not hold all it reads: {e}. "
                         f"Place every piece (and every partial sum) of the producer on some device.") from None


def _emit_exchange(t: IRTensor, takes: Dict[int, List[Take]], where, calls: Dict[int, List[Call]],
                   subst: Dict[int, Dict[int, IRTensor]], fuse: bool = True) -> None:
    """The calls of a point-to-point exchange: every send first (they never block), then on each
    reader its receives and local slices, the gradient links to unchosen replicas, and the
    assembly of its box (regions placed, partial-sum terms added).

    With ``fuse``, a reader whose regions tile its box (one term) and come from other ranks
    too makes one ``gather`` call instead: every receive posted at once, into the result."""
    name = t.name.replace('.', '_') if t.name else t.hint
    for r, mine in takes.items():
        for k in mine:
            if k.src != r:
                calls[k.src].append(Call([t], [], step=Step("send", (k.src, r), box=k.region, tag=k.tag,
                                                            grad=k.grad, part=k.part)))
            for q, tag, part in k.also:
                calls[q].append(Call([t], [], step=Step("send", (q, r), box=k.region, tag=tag, grad="only",
                                                        part=part)))
    for r, mine in takes.items():
        need = _union(k.region for k in mine)
        if fuse and len(mine) > 1 and any(k.src != r for k in mine) \
                and sum(math.prod(box_shape(k.region)) for k in mine) == math.prod(box_shape(need)):
            out = _moved(t, need, "x")
            regions = tuple((k.src, k.tag if k.src != r else 0, k.part, relative(k.region, need), k.grad != "none",
                             tuple((q, tag) for q, tag, _ in k.also)) for k in mine)
            local = [t] if any(k.src == r for k in mine) else []
            calls[r].append(Call(local, [out], step=Step("gather", (r,), box=need, takes=regions)))
            subst[r][id(t)] = out
            continue
        values = []
        for k in mine:
            if k.src == r:
                box = where[r][0]
                if k.region == box and k.grad != "none":   # the whole piece, gradient included: itself
                    value = t
                else:
                    value = IRTensor(box_shape(k.region), t.dtype, t.requires_grad,
                                     TensorKind.ACTIVATION, f"{name}_part", part_of=t.logical)
                    calls[r].append(Call([t], [value], step=Step("region", (r,), box=k.region, part=k.part,
                                                                 grad=k.grad)))
            else:
                value = IRTensor(box_shape(k.region), t.dtype, t.requires_grad, TensorKind.ACTIVATION,
                                 f"{name}_from{k.src}", part_of=t.logical)
                calls[r].append(Call([], [value], step=Step("recv", (k.src, r), box=k.region, tag=k.tag,
                                                            grad=k.grad)))
            for q, tag, _ in k.also:
                linked = _moved(t, k.region, f"to{q}")
                calls[r].append(Call([value], [linked], step=Step("grad_to", (q, r), box=k.region, tag=tag)))
                value = linked
            values.append((value, k.region))
        if len(values) == 1 and values[0][1] == need:
            subst[r][id(t)] = values[0][0]
            continue
        out = _moved(t, need, "x")
        calls[r].append(Call([v for v, _ in values], [out],
                             step=Step("assemble", (r,), box=need, parts=tuple(relative(b, need) for _, b in values))))
        subst[r][id(t)] = out


def _keep_collectives_of_cut_runs(calls: Dict[int, List[Call]]) -> None:
    """No collective of a recompute group is re-run in backward, on any rank, once a point-to-point
    transfer sits inside the group's stretch on some rank.

    Such a transfer cuts the rank's stretch into several runs (cube.passes.recompute), each
    re-run at its own point of backward, while a member without it re-runs one run: the
    collectives re-run in backward would come in another order on each member. Kept (not re-run),
    they run once, in forward, in the order every member shares.
    """
    cut: set = set()
    for rank_calls in calls.values():
        group = [None] * len(rank_calls)
        nxt = None
        for i in range(len(rank_calls) - 1, -1, -1):   # the group of the next op piece
            if rank_calls[i].op is not None:
                nxt = rank_calls[i].op.recompute
            group[i] = nxt
        prev = None
        for i, c in enumerate(rank_calls):
            if c.op is not None:
                prev = c.op.recompute
            elif c.step.kind in P2P_KINDS and prev is not None and prev == group[i]:
                cut.add(prev)
    if not cut:
        return
    for rank_calls in calls.values():
        nxt = None
        for c in reversed(rank_calls):
            if c.op is not None:
                nxt = c.op.recompute
            elif nxt in cut and c.step.kind in RERUNNABLE_KINDS:
                c.rerun = False


def _ops_passing_gradients(logical: List[IROperator], loss: IRTensor) -> set:
    """Ids of the forward ops whose backward runs: some output that needs a gradient reaches the
    loss through ops that pass gradients. The others (an op read only for its output's shape)
    return no gradient to what they read."""
    live = {id(loss)}
    out = set()
    for lop in reversed(logical):
        if isinstance(lop, IRDataOperation):
            continue
        if any(o.requires_grad and id(o) in live for o in lop.outputs):
            out.add(id(lop))
            live.update(id(t) for t in lop.inputs if t.requires_grad)
    return out


def _union(boxes) -> Box:
    boxes = list(boxes)
    return tuple((min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0])))




def _batch_origin(t: IRTensor, makers) -> Optional[IRTensor]:
    """The batch tensor ``t`` holds the elements of (through ops keeping them, ``OpInfo.same_elements``),
    if any."""
    while True:
        maker = makers.get(id(t))
        if isinstance(maker, IRDataOperation):
            return t
        if not isinstance(maker, IRFwOperation) or not op_info(maker.name).same_elements or len(maker.inputs) != 1:
            return None
        t = maker.inputs[0]


def _term_ranks(p: IROperator, r: int, by: Dict[int, IROperator], layouts, memo: Optional[dict] = None
                ) -> Tuple[int, ...]:
    """The ranks holding the partial sums that add up with rank ``r``'s output 0 (empty if full).

    ``memo`` (one dict per logical op) keeps the tiles of each output box, so the
    pieces of an op find their groups in one pass over the ranks, not one each.
    """
    lay = layouts[id(p)]
    if not lay.outputs or not lay.out_terms[0]:
        return ()
    mine = lay.outputs[0]
    memo = {} if memo is None else memo
    if mine not in memo:
        tiles: Dict[tuple, List[int]] = {}
        for q in sorted(q for q, o in by.items() if layouts[id(o)].outputs[0] == mine):
            tiles.setdefault(layouts[id(by[q])].out_terms[0], []).append(q)
        memo[mine] = (tiles, {})
    tiles, groups = memo[mine]
    k = tiles[lay.out_terms[0]].index(r)
    if k not in groups:
        groups[k] = tuple(v[k] for v in tiles.values())
    return groups[k]


def _only_sum(steps: Dict[int, List[Step]]) -> Optional[Tuple[int, ...]]:
    """The group of ``steps`` when every rank's is one gradient sum (``identity_all_reduce``) over it."""
    groups = {s[0].ranks if len(s) == 1 and s[0].kind == "identity_all_reduce" else None for s in steps.values()}
    group = groups.pop() if len(groups) == 1 else None
    return group if group is not None and set(group) == set(steps) else None


def _sum_earlier(raw, makers, pieces, layouts) -> None:
    """Moves gradient sums back through whole, replicated ops to one sum of what they read.

    A whole tensor that split pieces read (a ``(B, N)`` slice of Mamba's ``C`` per token, read by a
    matmul split along the channels) has its gradient summed over the pieces' ranks where it is read:
    one all-reduce in backward per reader, ``T`` of them for a scan over ``T`` tokens. When every
    reader of a value ``t`` sums its gradient over one group and ``t`` is made by a replicated op on
    exactly that group from one value ``u`` that needs a gradient (``select``, ``unsqueeze``, a
    transpose), the partial gradients flow back through that op (a backward is linear in the
    output's gradient) and are summed once at ``u``; readers of ``u`` with the same sum then share
    that one collective. A sum moves only where it does not grow: ``u`` holds no more elements than
    the values moved to it together (the ``T`` per-token slices of ``C``, not the last token of a big
    tensor).
    """
    readers: Dict[int, List] = {}
    for entry in raw:
        readers.setdefault(id(entry[2]), []).append(entry)
    changed = True
    while changed:
        changed = False
        # per value u: the entries (makers' reads of u) a sum could move to, and the sums it would replace
        moves: Dict[int, Tuple[IRTensor, Tuple[int, ...], List, List, int]] = {}
        for tid, entries in readers.items():
            t = entries[0][2]
            group = _only_sum({r: s for e in entries for r, s in e[3].items()}) if \
                t.kind is TensorKind.ACTIVATION and t.requires_grad else None
            if group is None or any(_only_sum(e[3]) != group for e in entries):
                continue
            maker = makers.get(tid)
            if not isinstance(maker, IRFwOperation) or len(maker.outputs) != 1 or \
                    set(pieces[id(maker)]) != set(group):
                continue
            if any(p.splits or any(layouts[id(p)].out_terms) or any(layouts[id(p)].in_terms)
                   for p in pieces[id(maker)].values()):
                continue
            grads = [(k, u) for k, u in enumerate(maker.inputs) if u.requires_grad]
            if len(grads) != 1 or grads[0][1].kind is not TensorKind.ACTIVATION:
                continue
            k, u = grads[0]
            mine = [e for e in readers.get(id(u), []) if e[0] is maker and e[1] == k]
            if len(mine) != 1 or set(mine[0][3]) != set(group) or \
                    any(not _can_sum_after(mine[0][3][r], group, u) for r in group):
                continue
            at = moves.setdefault(id(u), (u, group, [], [], 0))
            if at[1] != group:
                continue
            at[2].append(mine[0])
            at[3].extend(entries)
            moves[id(u)] = (u, group, at[2], at[3], at[4] + t.numel())
        for u, group, targets, sources, numel in moves.values():
            summed = [e for e in readers.get(id(u), []) if _only_sum(e[3]) == group]
            if u.numel() > numel + (u.numel() if summed else 0):
                continue
            for e in sources:
                for r in e[3]:
                    e[3][r] = []
            for e in targets:
                for r in group:
                    e[3][r] = _sum_after(e[3][r], group, u)
            changed = True


def _can_sum_after(steps: List[Step], group: Tuple[int, ...], u: IRTensor) -> bool:
    """Whether a gradient sum over ``group`` can end ``steps`` (a read of ``u``): they leave ``u`` whole
    (none, or collectives making it whole: the all-reduce of a row linear's partial sums) and hold no
    sum of their own (``_sum_earlier``)."""
    whole = full_box(u.shape)
    return not steps or (steps[-1].box == whole and all(s.kind in ("all_reduce", "all_gather") for s in steps)
                         and not any(s.kind == "all_gather" and s.grad == "V" for s in steps))


def _sum_after(steps: List[Step], group: Tuple[int, ...], u: IRTensor) -> List[Step]:
    """``steps`` then a gradient sum over ``group``; an all-gather over ``group`` that ends them sums
    its gradient itself (its backward reduce-scatters, as ``cube.passes.adapter.transitions`` makes it)."""
    last = steps[-1] if steps else None
    if last is not None and last.kind == "all_gather" and set(last.ranks) == set(group):
        return steps[:-1] + [replace(last, grad="V")]
    return steps + [Step("identity_all_reduce", tuple(sorted(group)), box=full_box(u.shape))]


def _sum_at_parameters(raw, makers, pieces, layouts) -> None:
    """Moves a gradient sum from an activation back to the parameters it is made from.

    When a value whose readers' gradients must be summed (identity forward,
    all-reduce backward) is made only from parameters by whole, replicated ops
    that nothing else reads (a position embedding read by a batch-split add),
    the partial gradients can flow back through those ops, which are linear in
    their output gradient, and be summed at the parameters, in the reducer's
    buckets, instead of by one more all-reduce inside backward.
    """
    readers: Dict[int, List] = {}
    for entry in raw:
        readers.setdefault(id(entry[2]), []).append(entry)

    def params_of(t, seen) -> Optional[List]:
        if t.kind is TensorKind.PARAM:
            entries = readers.get(id(t), [])
            return entries if len(entries) == 1 else None
        maker = makers.get(id(t))
        if maker is None or not isinstance(maker, IRFwOperation) or len(maker.outputs) != 1 or id(maker) in seen:
            return None
        if len(readers.get(id(t), [])) != 1:
            return None
        for p in pieces[id(maker)].values():
            lay = layouts[id(p)]
            if p.splits or any(lay.out_terms) or any(lay.in_terms):
                return None
        found = []
        for u in maker.inputs:
            if not u.requires_grad:
                continue
            sub = params_of(u, seen | {id(maker)})
            if sub is None:
                return None
            found += sub
        return found

    for lop, k, t, steps in raw:
        if t.kind is TensorKind.PARAM or not t.requires_grad or not steps:
            continue
        if not all(s and s[-1].kind == "identity_all_reduce" and len(s) == 1 for s in steps.values()):
            continue
        entries = params_of(t, frozenset())
        if not entries:
            continue
        for _, _, _, psteps in entries:
            if set(psteps) != set(steps) or any(psteps[r] for r in psteps):
                break
        else:
            for _, _, _, psteps in entries:
                for r in psteps:
                    psteps[r].append(steps[r][-1])
            for r in steps:
                steps[r].pop()


def _defer_param_reductions(graph: IRGraph, raw, world: int, alloc: Dict[int, Dict[int, Box]],
                            after: set) -> Dict[int, List[Tuple[IRTensor, Tuple[int, ...]]]]:
    """Moves the gradient sums of parameters out of the forward into the bucketed reducer.

    A parameter whose readers on every rank all sum their gradient over the
    same ranks is reduced once, after (and overlapped with) backward, instead
    of by one all-reduce per reader. Otherwise each reader keeps its own.

    A parameter read by ops on disjoint device groups (an embedding tied to the
    LM head of a later stage) is summed over all of them: each group holds its
    readers' share of the gradient.

    Raises:
        ValueError: a parameter read on overlapping but different device groups.
    """
    params = [t for t in graph.attrs if t.kind is TensorKind.PARAM and t.requires_grad]
    entries: Dict[int, List[Tuple[IROperator, Dict[int, List[Step]]]]] = {}
    for lop, k, t, steps in raw:
        if t.kind is TensorKind.PARAM:
            entries.setdefault(id(t), []).append((lop, steps))
    out: Dict[int, List[Tuple[IRTensor, Tuple[int, ...]]]] = {}
    for t in params:
        mine = entries.get(id(t), [])
        sets = {id(lop): frozenset(steps) for lop, steps in mine}
        groups: Dict[int, set] = {}
        for _, steps in mine:
            for r, s in steps.items():
                g = s[-1].ranks if s and s[-1].kind == "identity_all_reduce" else ()
                groups.setdefault(r, set()).add(g)
        if len(set(sets.values())) > 1:
            _tied_across_groups(t, mine, sets, groups, out, alloc[id(t)])
            after.add(id(t))   # read by different ops on different members: summed after backward
            continue
        if any(len(g) != 1 for g in groups.values()):
            continue
        for _, steps in mine:
            for r, s in steps.items():
                if s and s[-1].kind == "identity_all_reduce":
                    s.pop()
        checked = set()   # members of a group share its entry: check each group once, not once per member
        for r, g in groups.items():
            (ranks,) = g
            if ranks not in checked:
                if not all(groups.get(q) == g for q in ranks):
                    raise CubeInternalError(f"asymmetric gradient groups of {t!r}: {groups}")
                checked.add(ranks)
            if ranks:
                out.setdefault(r, []).append((t, ranks))
    return out


def _matched_subgroups(distinct, groups) -> Optional[Dict[int, Tuple[int, ...]]]:
    """Each rank's sum group when every device group splits into sub-groups that sum alike
    (data parallel replicas of a tensor parallel stage, 3D parallelism): the k-th
    sub-group of each group (by lowest rank) sums with the k-th of the others.
    None when the groups do not split that way."""
    parts = []
    for s in distinct:
        subs = set()
        for r in s:
            if len(groups.get(r, ())) != 1:
                return None
            (g,) = groups[r]
            g = frozenset(g or (r,))
            if r not in g or not g <= s:
                return None
            subs.add(g)
        if sum(len(g) for g in subs) != len(s):   # sub-groups overlap
            return None
        parts.append(sorted(subs, key=min))
    if len({len(p) for p in parts}) != 1:
        return None
    return {r: tuple(sorted(frozenset().union(*(p[k] for p in parts)))) for p in parts
            for k, g in enumerate(p) for r in g}


def _tied_across_groups(t: IRTensor, mine, sets, groups, out, held: Dict[int, Box]) -> None:
    """Sums a parameter's gradient over the disjoint device groups of its readers.

    Readers whose pieces sum their gradients over their whole group (data
    parallel, or one device) hold shares of one sum over all the groups. Readers
    that run whole on each of their devices (replicas, e.g. inside a tensor
    parallel stage) hold complete copies: the k-th device of each group sums
    with the k-th of the others. Any other mix (whole and split readings, groups
    that overlap) is summed over all the readers' devices with one copy of each
    reader piece's gradient kept (``_one_copy_each``).
    """
    distinct = list(dict.fromkeys(sets.values()))
    union = frozenset().union(*distinct)
    # each reader's pieces sum over all of its devices: every rank holds a share of one sum, so the
    # device groups may even overlap (a tied weight read on 2 devices by one op and 4 by another)
    shares = all(len(steps) == 1 or all(s and s[-1].kind == "identity_all_reduce" and s[-1].ranks == tuple(sorted(steps))
                                        for s in steps.values()) for _, steps in mine)
    whole = all(all(groups[r] == {()} for r in steps) for _, steps in mine)
    ranks_of = None
    if shares:
        ranks_of = {r: tuple(sorted(union)) for r in union}
    elif sum(len(s) for s in distinct) != len(union):   # overlapping groups: only one sum over all fits
        ranks_of = None
    elif whole and len({len(s) for s in distinct}) == 1:
        ordered = [sorted(s) for s in distinct]
        ranks_of = {r: tuple(sorted(o[k] for o in ordered)) for o in ordered for k, r in enumerate(o)}
    elif _matched_subgroups(distinct, groups) is not None:   # data parallel inside tensor parallel groups
        ranks_of = _matched_subgroups(distinct, groups)
    # a sum is only well formed over devices holding the same piece (tensor parallel readers hold
    # different ones): else one sum over all the readers' devices, each reader's gradient once
    if ranks_of is not None and any(len({held[q] for q in ranks}) != 1 for ranks in ranks_of.values()):
        ranks_of = None
    if ranks_of is None:
        if not _one_copy_each(mine, held):
            raise ValueError(f"parameter {t.name!r} is read on device groups {[sorted(s) for s in distinct]} by "
                             f"ops that mix whole and split readings of it, and its devices hold different "
                             f"pieces of it through collectives; split its readers alike in every group")
        ranks_of = {r: tuple(sorted(union)) for r in union}
    for _, steps in mine:
        for s in steps.values():
            if s and s[-1].kind == "identity_all_reduce":
                s.pop()
    for r in union:
        out.setdefault(r, []).append((t, ranks_of[r]))


def _one_copy_each(mine, held: Dict[int, Box]) -> bool:
    """Makes a sum over all the readers' devices count each reader's gradient once, when it can.

    Every piece of an op receives the complete gradient of its output, so a
    reader piece's parameter gradient is complete where the piece runs whole,
    and a share of one sum over its ``identity_all_reduce`` group otherwise.
    Pieces reading the same box in one such unit (a group, or a lone device)
    are copies across units: the unit of the lowest rank keeps its gradient,
    the others read the parameter through a ``detach`` step (``runtime.drop_grad``:
    the values made from it still need gradients, so every rank runs the same
    backward, but the copy is not added to the parameter's). The reducer then
    sums every device's gradient over all of them: each piece's once.

    One sum over all the devices needs them to hold the same piece of the
    parameter: a device holding less (a reader split along the weight's dims
    on some group) is given the bounding box of all (``held`` is updated; its
    readers narrow it locally, their gradient zero elsewhere). Only when the
    readers take their boxes by local ``narrow`` alone (a ``chunk``'s backward
    would gather, copying the gradient inside its group). Returns False,
    changing nothing, otherwise.
    """
    for _, steps in mine:
        for r, s in steps.items():
            body = s[:-1] if s and s[-1].kind == "identity_all_reduce" else s
            if any(x.kind != "narrow" for x in body):
                return False
    whole = _union(held.values())
    for r, box in list(held.items()):
        if box == whole:
            continue
        for _, steps in mine:
            if r in steps:
                steps[r][:0] = _narrows(r, whole, box)
        held[r] = whole
    for _, steps in mine:
        units: Dict[tuple, List[Tuple[int, ...]]] = {}
        for r, s in steps.items():
            group = s[-1].ranks if s and s[-1].kind == "identity_all_reduce" else (r,)
            box = s[-1].box if s else held[r]
            found = units.setdefault(box, [])
            if group not in found:
                found.append(group)
        for groups in units.values():
            keep = min(groups, key=min)
            for group in groups:
                if group == keep:
                    continue
                for r in group:
                    s = steps[r]
                    if s and s[-1].kind == "identity_all_reduce":
                        s.pop()
                    s.append(Step("detach", (r,), box=s[-1].box if s else held[r]))
    return True


def _narrows(r: int, box: Box, target: Box) -> List[Step]:
    """Local ``narrow`` steps from ``box`` to ``target`` (inside it), one per dim that differs."""
    out = []
    for d in range(len(box)):
        if box[d] != target[d]:
            nxt = tuple(target[i] if i == d else box[i] for i in range(len(box)))
            out.append(narrow_step(r, box, nxt, d))
            box = nxt
    return out
