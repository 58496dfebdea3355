"""The per-rank program: everything a rank runs in one step, decided once.

``build_program(graph, world)`` is the last pass. It plans every rank
(``cube.passes.rank_plans``), orders its pipeline actions, splits a rank holding
several stages into one segment per stage (``cube.passes.stages``), moves
transfers to the edges of recompute groups and finds the recompute runs
(``cube.passes.recompute``), and decides what the generated code only prints:
where values are freed, which all-reduce sums in place, where ZeRO-3 waits for
a gathered parameter, which mean losses count their targets on the whole batch,
and which process groups exist. Code generation (``cube.codegen``), the
simulator (``cube.sim``) and the plan report read this one ``Program``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

from cube.ir.graph import IRGraph
from cube.ir.layout import full_box
from cube.ir.ops import op_info
from cube.ir.tensor import IRTensor, TensorKind
from cube.passes.adapter import P2P_KINDS
from cube.passes.check import check_stage
from cube.passes.float8 import mark_amax_ranks
from cube.passes.precision import device_type
from cube.passes.rank_plans import Call, RankPlan, build_plans
from cube.passes.recompute import Run, check_recompute, find_runs, gather_transfers
from cube.passes.stages import held_stages, op_stages, stage_calls, stages_of



@dataclass(eq=False)
class Count:
    """A mean loss whose targets are counted on the whole batch before the rank keeps its part.

    Attributes:
        call: the loss piece (``call.count_of`` is the batch tensor its targets view).
        value: the scalar holding the count, passed to the piece.
        weight: the class-weight parameter, or None.
        ignore_index: targets with this value are not counted.
        given: counted on the global batch before a pipeline step's micro-batches run and passed to
            each micro-batch's forward (``RankProgram.target_counts``), not counted in the method.
    """

    call: Call
    value: IRTensor
    weight: Optional[IRTensor]
    ignore_index: int
    given: bool = False


@dataclass
class Segment:
    """One straight-line method of a rank: its forward, or one pipeline stage of it.

    Attributes:
        stage: the stage (None: the rank's only forward).
        calls: its calls in the order they run.
        runs: the recompute runs among them (``calls[run.start:run.stop]``).
        counts: the mean losses counted on the whole batch (before ``runtime.piece``).
        last_use: call index -> values read for the last time there (parameters included).
        frees: call index -> values the generated code deletes after it.
        in_place: indices of all-reduces that sum into their input.
        zero_waits: call index -> ZeRO-3 sharded parameters waited for before it.
        returns_loss: whether the method returns the loss (else None: it is made on another stage).
    """

    stage: Optional[int]
    calls: List[Call]
    runs: List[Run] = field(default_factory=list)
    counts: List[Count] = field(default_factory=list)
    last_use: Dict[int, List[IRTensor]] = field(default_factory=dict)
    frees: Dict[int, List[IRTensor]] = field(default_factory=dict)
    in_place: FrozenSet[int] = frozenset()
    zero_waits: Dict[int, List[IRTensor]] = field(default_factory=dict)
    returns_loss: bool = True


@dataclass
class RankProgram:
    """What one rank runs in a step.

    Attributes:
        plan: its op pieces, communication, parameter pieces and gradient sums.
        segments: its forward (one segment) or its stages in order.
        actions: its pipeline actions (``"F0"``, ``"B1"``, ``"F0.s2"`` on a rank holding several
            stages), or None without a schedule.
        splits_batch: whether it keeps only a part of the global batch.
        uses_p2p: whether any value moves point to point (backward then runs from the sends too).
        zero3: whether it holds ZeRO-3 sharded parameters (gathered in forward).
        target_counts: on a pipeline step cutting the global batch (``graph.micro``), the mean losses
            over valid targets whose pieces this rank runs: ``(count, value)``, the value counted on
            the global batch in the step and passed to every micro-batch's forward after the batch.
        interleave: how a step cuts the global batch into micro-batches: it is cut into
            ``interleave`` equal parts along dim 0 and micro-batch ``i`` is the ``i``-th slice of
            every part, in order (the least common multiple of the data parallel degrees of the
            ranks reading it, so each rank's rows of all micro-batches are its contiguous part of
            the global batch, what ``cube.runtime.data.part()`` tells a per-rank loader).
    """

    plan: RankPlan
    segments: List[Segment]
    actions: Optional[List[str]] = None
    splits_batch: bool = False
    uses_p2p: bool = False
    zero3: bool = False
    target_counts: List[Tuple[object, IRTensor]] = field(default_factory=list)
    interleave: int = 1

    @property
    def rank(self) -> int:
        return self.plan.rank

    @property
    def staged(self) -> bool:
        """Whether the rank holds several pipeline stages (one method each)."""
        return self.segments[0].stage is not None


@dataclass
class Program:
    """Every rank's program of a placed graph.

    Attributes:
        graph: the placed graph.
        world: the number of ranks.
        ranks: rank -> its program (those asked for; every rank is planned).
        groups: every process group any rank uses, in the order all ranks create them.
    """

    graph: IRGraph
    world: int
    ranks: Dict[int, RankProgram]
    groups: List[Tuple[int, ...]]

    def __getitem__(self, rank: int) -> RankProgram:
        return self.ranks[rank]

    @property
    def plans(self) -> Dict[int, RankPlan]:
        return {r: p.plan for r, p in self.ranks.items()}

    @property
    def actions(self) -> Optional[Dict[int, List[str]]]:
        """Each rank's pipeline actions, or None without a schedule."""
        if self.graph.schedule is None:
            return None
        return {r: p.actions for r, p in self.ranks.items()}


def build_program(graph: IRGraph, world: int, ranks: Optional[Sequence[int]] = None) -> Program:
    """Plans every rank of a placed graph and lays out the programs of ``ranks`` (default all).

    Raises:
        ValueError: the placement cannot run (see ``cube.passes.rank_plans.build_plans``), the stages do
            not fit the schedule (``cube.passes.stages.held_stages``), or recompute marks differ
            between pieces of one op.
    """
    check_recompute(graph)
    plans = build_plans(graph, world)
    mark_amax_ranks(graph, plans, cuda=device_type() == "cuda")
    check_stage(graph, "plan")
    groups = all_groups(plans)
    actions = schedule_actions(graph, plans) if graph.schedule is not None else {}
    if graph.schedule is not None and graph.schedule.splits_backward:
        first = {k for k, stage in op_stages(graph).items() if stage == 0}
        for plan in plans.values():
            defer_weight_grads(plan, first)
    ranks = range(world) if ranks is None else ranks
    interleave = micro_interleave(graph, plans)
    program = Program(graph, world, {r: _rank_program(graph, plans[r], actions.get(r), interleave) for r in ranks},
                      groups)
    check_stage(graph, "program")
    return program


def all_groups(plans: Dict[int, RankPlan]) -> List[Tuple[int, ...]]:
    """Every process group any rank uses, sorted so all ranks create them in the same order."""
    groups = set()
    for plan in plans.values():
        for call in plan.calls:
            if call.step is not None and len(call.step.ranks) > 1:
                groups.add(tuple(sorted(call.step.ranks)))
            if len(call.term_ranks) > 1:
                groups.add(tuple(sorted(call.term_ranks)))
            if len(call.amax_ranks) > 1:
                groups.add(call.amax_ranks)
            if call.inside is not None:
                groups.update(tuple(sorted(g)) for g in call.inside.groups)
        for _, ranks in plan.reduce:
            groups.add(tuple(sorted(ranks)))
        if len(plan.loss_sum) > 1:
            groups.add(tuple(sorted(plan.loss_sum)))
    return sorted(groups, key=lambda g: (len(g), g))


def schedule_actions(graph: IRGraph, plans: Dict[int, RankPlan]) -> Dict[int, List[str]]:
    """Each device's actions in the schedule: those of its pipeline rank, naming the stage
    (``F0.s2``) when a pipeline rank holds several.

    Raises:
        ValueError: the stages do not fit the schedule (see ``cube.passes.stages.held_stages``).
    """
    sched = graph.schedule
    virtual = sched.nstages > sched.nranks
    return {r: [a.label(virtual) for a in sched.ranks[sched.rank_of(stages[0])]]
            for r, stages in held_stages(graph, plans).items()}


# op -> (index of its activation input, of its weight input, the cube.runtime.zb function deferring the latter's
# gradient)
DEFERRABLE = {"linear": (0, 1, "linear"), "mm": (0, 1, "matmul"), "matmul": (0, 1, "matmul"),
              "addmm": (1, 2, "addmm")}


def defer_weight_grads(plan: RankPlan, skip: FrozenSet[int] = frozenset()) -> None:
    """Marks the calls whose weight gradient a split backward (zero-bubble schedules) defers from B
    to W: products (``DEFERRABLE``) reading a parameter of this rank as it is, a matrix for all
    but ``linear`` (not a value made from one, such as ZeRO-3's gathered weight, whose gradient must
    flow back through what made it during B), except the ops ``skip`` holds (logical op ids: the
    first stage's, whose input gradients nobody waits for, so splitting would only cost)."""
    params = {id(t) for t, _ in plan.attrs if t.kind is TensorKind.PARAM and t.requires_grad}
    made = {id(o): c for c in plan.calls if c.op is not None for o in c.op.outputs}
    for call in plan.calls:
        op = call.op
        if op is None or op.name not in DEFERRABLE or id(op.root) in skip:
            continue
        _, k, fn = DEFERRABLE[op.name]
        if len(op.inputs) > k:
            w = op.inputs[k]
            t = made.get(id(w))
            if op.name == "linear" and t is not None and t.op.name == "t" and len(t.op.inputs) == 1 and \
                    t.subst.get(id(t.op.inputs[0]), t.op.inputs[0]) is t.op.inputs[0]:
                w = t.op.inputs[0]   # linear(x, p.t(), b): the parameter's gradient (runtime.zb.linear)
            if id(w) in params and call.subst.get(id(w), w) is w and (op.name == "linear" or w.ndim == 2):
                call.defer_wgrad = f"runtime.zb.{fn}"


def micro_interleave(graph: IRGraph, plans: Dict[int, RankPlan]) -> int:
    """How a pipeline step cuts the global batch (``RankProgram.interleave``): the least common
    multiple of the parts each rank's forward keeps of dim 0 of a micro-batch's tensors (1 without
    ``graph.micro``). The same on every rank, as every rank plans every rank."""
    if getattr(graph, "micro", None) is None:
        return 1
    out = 1
    for plan in plans.values():
        for t, box in zip(plan.data.outputs, plan.data_boxes):
            if t.ndim == 0:
                continue
            start, stop = box[0]
            if (start, stop) != (0, t.shape[0]) and stop > start and t.shape[0] % (stop - start) == 0:
                out = math.lcm(out, t.shape[0] // (stop - start))
    return out


def _rank_program(graph: IRGraph, plan: RankPlan, actions: Optional[List[str]], interleave: int = 1
                  ) -> RankProgram:
    held = stages_of(actions)
    parts = stage_calls(graph, plan, held) if held else {None: plan.calls}
    attrs = {id(t) for t, _ in plan.attrs}
    splits_batch = any(b != full_box(t.shape) for t, b in zip(plan.data.outputs, plan.data_boxes))
    zero3 = getattr(graph, "zero", 0) == 3 and bool(plan.reduce)
    sharded = {id(t) for t, ranks in plan.reduce if len(ranks) > 1} if zero3 else set()
    given = _target_counts(graph, plan, attrs)
    segments = [_segment(stage, calls, plan, attrs, splits_batch, sharded, given) for stage, calls in parts.items()]
    uses_p2p = any(c.step is not None and c.step.kind in P2P_KINDS for c in plan.calls)
    return RankProgram(plan, segments, actions, splits_batch, uses_p2p, zero3, list(given.values()), interleave)


def _target_counts(graph: IRGraph, plan: RankPlan, attrs: set) -> Dict[int, Tuple[object, IRTensor]]:
    """Count index -> ``(TargetCount, value)`` for the mean losses over valid targets of a micro-batch
    graph whose pieces this rank runs (their denominators are counted on the global batch).

    Raises:
        ValueError: the class weights are not whole on this rank (cube cannot count with them).
    """
    micro = getattr(graph, "micro", None)
    out: Dict[int, Tuple[object, IRTensor]] = {}
    if micro is None:
        return out
    whole = {id(t) for t, b in plan.attrs if b == full_box(t.shape)}
    for call in plan.calls:
        share = getattr(call.op.root, "micro_share", None) if call.op is not None else None
        if share is None or share[0] not in ("targets", "value") or share[1] in out:
            continue
        count = micro.counts[share[1]]
        if count.weight is not None and id(count.weight) not in whole:
            raise ValueError(f"pipeline plan: rank {plan.rank} runs a piece of {call.op.name!r} "
                             f"({call.op.where()}) but not the whole of its class weights, which it needs to "
                             f"count the valid targets of the global batch; keep the weights whole on the ranks "
                             f"of the loss, or plan the pipeline with nmicros=1")
        value = IRTensor((), count.dtype, False, TensorKind.ACTIVATION,
                         f"valid_targets{share[1]}" if count.kind == "targets" else f"batch_count{share[1]}")
        out[share[1]] = (count, value)
    return out


def _segment(stage: Optional[int], calls: List[Call], plan: RankPlan, attrs: set, splits_batch: bool,
             sharded: set, given: Optional[dict] = None) -> Segment:
    """One method's calls, laid out (see ``Segment``)."""
    counts = []
    for call in calls:   # a micro-batch's mean loss over valid targets: counted on the global batch
        share = getattr(call.op.root, "micro_share", None) if call.op is not None else None
        if share is not None and share[0] in ("targets", "value"):
            count, value = given[share[1]]
            counts.append(Count(call, value, count.weight, count.ignore_index, given=True))
    shared = {id(c.call) for c in counts}
    if splits_batch:
        counts += [c for c in _counts(calls, attrs) if id(c.call) not in shared]
    calls = gather_transfers(calls)   # sends/recvs out of recompute runs
    runs = find_runs(calls, plan.loss, lambda t: id(t) in attrs, {id(c.call): c.value for c in counts})
    if stage is not None:   # a recompute group may have runs in several stages
        for r in runs:
            r.name += f"_s{stage}"
    last_use = last_uses(calls, plan.loss)
    run_at = {i: r for r in runs for i in range(r.start, r.stop)}
    frees, in_place = {}, set()
    for i, dying in last_use.items():
        dead = [t for t in dying if id(t) not in attrs]
        run = run_at.get(i)
        if run is not None:   # a run's inputs are freed after its call, in forward
            dead = [t for t in dead if not any(t is x for x in run.inputs)]
        if dead:
            frees[i] = dead
        if run is None and _sums_in_place(calls, i, dying):
            in_place.add(i)
    waits, waited = {}, set()
    for i, call in enumerate(calls):
        new = [t for t in call.inputs if id(t) in sharded and id(t) not in waited] if sharded else []
        if new:
            waited.update(id(t) for t in new)
            waits[i] = new
    returns_loss = plan.loss_from is None and (stage is None or any(t is plan.loss for c in calls
                                                                   for t in c.outputs))
    return Segment(stage, calls, runs, counts, last_use, frees, frozenset(in_place), waits, returns_loss)


def _counts(calls: List[Call], attrs: set) -> List[Count]:
    """The mean losses among ``calls`` whose targets are counted on the whole batch: those whose
    class weights (if any) are parameters; a weight computed in forward makes the pieces sum
    the count instead."""
    out = []
    for call in calls:
        if call.count_of is None:
            continue
        op = call.op
        names = [a.name for a in op.target._schema.arguments]
        weight = op.args[2] if len(op.args) > 2 else op.kwargs.get("weight")
        if weight is not None and id(weight) not in attrs:
            continue
        k = names.index("ignore_index")
        ignore = op.args[k] if len(op.args) > k else op.kwargs.get("ignore_index", -100)
        value = IRTensor((), op.inputs[0].dtype, False, TensorKind.ACTIVATION, "valid_targets")
        out.append(Count(call, value, weight, ignore))
    return out


def _sums_in_place(calls: List[Call], i: int, dying) -> bool:
    """Whether the all-reduce ``calls[i]`` of a partial sum may sum into it: an op that does not
    keep its output for backward made it, no call between read it, and none reads it afterwards."""
    call = calls[i]
    if call.step is None or call.step.kind != "all_reduce":
        return False
    x = call.inputs[0]
    if not any(t is x for t in dying):
        return False
    for c in reversed(calls[:i]):
        if c.op is not None and any(o is x for o in c.op.outputs):
            return not op_info(c.op.name).saves_output   # else autograd keeps what we would overwrite
        if any(t is x for t in c.inputs):
            return False
    return False


def last_uses(calls: List[Call], keep: IRTensor) -> Dict[int, List[IRTensor]]:
    """Maps call index -> the values whose last use is that call (``keep`` never dies)."""
    last: Dict[int, Tuple[int, IRTensor]] = {}
    for i, call in enumerate(calls):
        for t in call.inputs:
            last[id(t)] = (i, t)
        for t in call.outputs:  # outputs never read are freed where they are made
            last.setdefault(id(t), (i, t))
    out: Dict[int, List[IRTensor]] = {}
    for i, t in last.values():
        if t is keep:
            continue
        out.setdefault(i, []).append(t)
    return out
