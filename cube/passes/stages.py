"""Pipeline stages of each rank: which stages a device runs, and a rank's calls split by stage.

With one stage per device a rank's forward is its whole list of calls. A rank
holding several stages (virtual stages, as in interleaved 1F1B: pipeline rank
``r`` of ``n`` holds stages ``r, r + n, ...``) runs each stage as a method of
its own, once per micro-batch, in the order the schedule says; each stage's
backward runs from that stage's roots only.

A call belongs to the stage of its op; a communication step to the stage of
the op it feeds (the next op), except a send, which belongs to the stage that
made the value it sends (the send goes out as soon as the value exists), and
steps after the last op (the loss's), which stay with what they read.

A value made in one stage of a rank and read in a later stage of the same rank
is handed over with ``runtime.p2p.stash`` at the end of the first stage and
``runtime.p2p.unstash`` at the start of the later one, under the same variable
name: autograd is cut there as at a send, so the later stage's backward stops
at the value and the earlier stage's backward takes its gradient from there,
and no backward runs through a graph twice.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from cube.ir.graph import IRGraph
from cube.passes.adapter import Step
from cube.passes.rank_plans import Call, RankPlan
from cube.runtime.pipeline import parse_action


def held_stages(graph: IRGraph, plans: Dict[int, RankPlan]) -> Dict[int, Tuple[int, ...]]:
    """The stages each device runs under the graph's schedule: its pipeline rank's.

    Raises:
        ValueError: no stages, a stage count other than the schedule's, or a
            device whose ops are not those of exactly the stages of one
            pipeline rank (stage ``k`` runs on pipeline rank ``schedule.rank_of(k)``).
    """
    sched = graph.schedule
    if not graph.stages:
        raise ValueError(f"the policy set a {sched.name} schedule but no stages: call graph.staging([...]) "
                         f"and assign each stage to its devices before cube.schedule.{sched.name}")
    if len(graph.stages) != sched.nstages:
        raise ValueError(f"the {sched.name} schedule has {sched.nstages} stages but graph.staging made "
                         f"{len(graph.stages)}; pass nstages={len(graph.stages)}")
    stage_of = op_stages(graph)
    out = {}
    for r, plan in plans.items():
        mine = sorted({stage_of.get(id(c.op.root)) for c in plan.calls if c.op is not None} - {None})
        want = sched.stages_of(sched.rank_of(mine[0])) if mine else []
        if not mine or mine != want:
            raise ValueError(_misplaced(r, mine, want, sched))
        out[r] = tuple(mine)
    return out


def _misplaced(r: int, mine: List[int], want: List[int], sched) -> str:
    """The error for device ``r`` running the ops of stages ``mine`` (its pipeline rank's: ``want``)."""
    if sched.nstages == sched.nranks or not mine:
        return (f"device {r} runs ops of stages {mine}; with a schedule each device runs the ops of exactly one "
                f"stage: assign every op of a stage to that stage's devices")
    n = sched.nranks
    if sched.placement is None:
        return (f"device {r} runs ops of stages {mine}, but the {sched.name} schedule runs stages {want} together "
                f"on one pipeline rank (stage k on pipeline rank k % {n}): put each stage k on the devices of "
                f"stage k % {n}")
    ranks = ", ".join(f"{k}->{sched.rank_of(k)}" for k in range(sched.nstages))
    return (f"device {r} runs ops of stages {mine}, but the {sched.name} schedule runs stages {want} together "
            f"on one pipeline rank (stage -> pipeline rank: {ranks}): put the stages of one pipeline rank on "
            f"the same devices")


def op_stages(graph: IRGraph) -> Dict[int, int]:
    """Logical op id -> the stage it belongs to."""
    return {id(op.root): k for k, st in enumerate(graph.stages) for op in st}


def stages_of(actions: Optional[Sequence[str]]) -> List[int]:
    """The stages a rank's actions name (``F0.s2``); empty when they name none (one stage)."""
    return sorted({s for _, _, s in map(parse_action, actions or ()) if s is not None})


def stage_calls(graph: IRGraph, plan: RankPlan, stages: Sequence[int]) -> Dict[int, List[Call]]:
    """This rank's calls by stage (``stages``: those it holds, in order), each in program order,
    with a stash and an unstash for each value one of its stages hands to a later one."""
    parts = _split(plan.calls, op_stages(graph), stages)
    tags = [c.step.tag for c in plan.calls if c.step is not None]
    _hand_over(parts, plan.rank, max(tags, default=0) + 1)
    return parts


def _split(calls: List[Call], stage_of: Dict[int, int], stages: Sequence[int]) -> Dict[int, List[Call]]:
    """``calls`` by stage, each in program order (which stage a step belongs to: module docstring)."""
    feeds: List[Optional[int]] = [None] * len(calls)   # the stage of the next op call
    after: Optional[int] = None
    for i in range(len(calls) - 1, -1, -1):
        if calls[i].op is not None:
            after = stage_of.get(id(calls[i].op.root), after)
        feeds[i] = after
    parts: Dict[int, List[Call]] = {k: [] for k in stages}
    made: Dict[int, int] = {}   # value id -> the stage of the call making it
    last = stages[0]            # the stage of the last op call so far
    for i, call in enumerate(calls):
        if call.op is not None:
            k = last = stage_of.get(id(call.op.root), last)
        elif call.step.kind != "send" and feeds[i] is not None:
            k = feeds[i]
        else:
            k = made.get(id(call.inputs[0]), last)
        parts[k].append(call)
        for t in call.outputs:
            made.setdefault(id(t), k)
    return parts


def _hand_over(parts: Dict[int, List[Call]], rank: int, tag: int) -> None:
    """Adds a stash at the end of a stage and an unstash at the start of a later stage for each
    value the later one reads from the earlier (tags from ``tag`` on)."""
    made: Dict[int, int] = {}
    for k, calls in parts.items():
        takes: List[Call] = []
        handed = set()
        for call in calls:
            for t in call.inputs:
                src = made.get(id(t), k)
                if src != k and id(t) not in handed:
                    handed.add(id(t))
                    grad = "" if t.requires_grad else "none"
                    parts[src].append(Call([t], [], step=Step("stash", (rank,), grad=grad, tag=tag)))
                    takes.append(Call([], [t], step=Step("unstash", (rank,), grad=grad, tag=tag)))
                    tag += 1
            for t in call.outputs:
                made.setdefault(id(t), k)
        calls[:0] = takes
