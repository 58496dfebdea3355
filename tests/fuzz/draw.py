"""Drawing random plans over the public policy API, reproducibly from (model, seed).

The drawing is in two parts. :func:`skeleton` needs no graph: the world size,
the schedule, the micro-batches and the device group of each pipeline rank
(groups of different sizes, devices in random order). :func:`fill` completes
it from the traced graph: stage cuts at any forward op, a base plan per group
(data parallel, Megatron tensor parallel or replicated), the data operation's
pieces, a few ops placed at random (any legal split from the op's annotation,
a random device order, for plans without a schedule also another group or
group size) and random recompute groups. Both draw from ``random.Random`` seeded
by the model and the seed, so a plan is a pure function of (model, seed).
"""
from __future__ import annotations

import copy
import random
from typing import List, Optional, Tuple

from cube.ir import IRDataOperation, IRFwOperation
from cube.ir.blocks import rerun_hazard
from tests.fuzz.plan import Factor, Place, Plan

SCHEDULES = (None, None, None, "1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev")


def rng_for(model: str, seed: int, part: str) -> random.Random:
    return random.Random(f"{model}/{seed}/{part}")


def skeleton(model: str, seed: int) -> Plan:
    """World size, schedule, micro-batches and pipeline groups of the plan (model, seed)."""
    rng = rng_for(model, seed, "skeleton")
    ndev = rng.choice([1, 2, 2, 3, 4, 4])
    schedule = rng.choice(SCHEDULES)
    devices = list(range(ndev))
    rng.shuffle(devices)
    if schedule is None:
        return Plan(ndev=ndev, groups=(tuple(devices),))
    nranks = rng.randint(1, min(ndev, 3))
    if schedule == "interleaved":
        nmicros = rng.choice([m for m in range(nranks, 5) if m % nranks == 0])
    elif schedule == "dualpipev":   # at least as many micro-batches as its 2 x nranks stages
        nmicros = rng.randint(2 * nranks, 2 * nranks + 2)
    else:
        nmicros = rng.randint(1, 4)
    bounds = sorted(rng.sample(range(1, ndev), nranks - 1)) if nranks > 1 else []
    edges = [0] + bounds + [ndev]
    groups = tuple(tuple(devices[edges[k]:edges[k + 1]]) for k in range(nranks))
    return Plan(ndev=ndev, schedule=schedule, nmicros=nmicros, groups=groups)


def fill(plan: Plan, graph, model: str, seed: int) -> Plan:
    """Completes a :func:`skeleton` from ``graph`` (not changed); returns ``plan``."""
    rng = rng_for(model, seed, "fill")
    fw = graph.select(ntype=IRFwOperation)
    ngroups = len(plan.groups)
    nstages = ngroups * (2 if plan.schedule in ("interleaved", "zbv", "dualpipev") else 1)
    if plan.schedule:
        plan.cuts = tuple([0] + sorted(rng.sample(range(1, len(fw)), nstages - 1)))
    plan.base = tuple(rng.choice(["dp", "dp", "tp", "rep"]) if len(g) > 1 else "rep" for g in plan.groups)
    data = graph.select(ntype=IRDataOperation)[0]
    batch = data.outputs[0].shape[0]
    pieces = []
    for k, group in enumerate(plan.groups):
        order = _shuffled(rng, group)
        n = len(group)
        split = n > 1 and batch % n == 0 and (plan.base[k] == "dp") != (rng.random() < 0.2)
        pieces.append(Place(order, ((0, 0, n),) if split else ((None, None, n),) if n > 1 else ()))
    plan.data = tuple(pieces)
    for _ in range(rng.choice([0, 1, 1, 2, 3, 5])):
        i = rng.randrange(len(fw))
        plan.ops[i] = _random_place(rng, fw[i], _group_for(rng, plan, i))
    plan.recompute = _recompute_ranges(rng, fw)
    return plan


def _shuffled(rng: random.Random, group) -> Tuple[int, ...]:
    out = list(group)
    rng.shuffle(out)
    return tuple(out)


def _group_for(rng: random.Random, plan: Plan, i: int) -> Tuple[int, ...]:
    """The devices op ``i`` may run on: its stage's group, any group without a schedule."""
    if plan.schedule:
        return _shuffled(rng, plan.groups[plan.group_of(i)])
    if rng.random() < 0.5:
        return _shuffled(rng, range(plan.ndev))
    size = rng.randint(1, plan.ndev)
    return tuple(rng.sample(range(plan.ndev), size))


def _splits(op, num: int) -> List[Tuple[int, int]]:
    """The legal (idx, dim) pairs of ``op`` that split it evenly ``num`` ways."""
    if op.anno is None:
        return []
    algo = op.algorithms("dim")
    return [(i, d) for i, d in algo.legal() if algo.satisfy(i, d, num)]


def _random_place(rng: random.Random, op, group: Tuple[int, ...]) -> Place:
    """A random legal placement of ``op`` on ``group``: replicas, one split, or two nested ones."""
    n = len(group)
    if n == 1:
        return Place(group)
    if n == 4 and rng.random() < 0.4:
        outer = _one_factor(rng, op, 2)
        inner = _one_factor(rng, op, 2)
        if outer[0] is not None and inner[0] is not None and not _nested_ok(op, outer, inner):
            inner = (None, None, 2)
        return Place(group, (outer, inner))
    return Place(group, (_one_factor(rng, op, n),))


def _one_factor(rng: random.Random, op, num: int) -> Factor:
    legal = _splits(op, num)
    if not legal or rng.random() < 0.2:
        return (None, None, num)
    idx, dim = rng.choice(legal)
    return (idx, dim, num)


def _nested_ok(op, outer: Factor, inner: Factor) -> bool:
    """Whether splitting the pieces of ``outer`` again by ``inner`` stays even."""
    algo = op.algorithms("dim")
    a, b = algo.ident(outer[0], outer[1]).name, algo.ident(inner[0], inner[1]).name
    return algo.satisfy(outer[0], outer[1], outer[2] * inner[2]) if a == b else True


def _recompute_ranges(rng: random.Random, fw) -> Tuple[Tuple[int, int], ...]:
    """Up to two disjoint runs of forward ops with no op that must not run twice."""
    if rng.random() < 0.6:
        return ()
    out: List[Tuple[int, int]] = []
    used = set()
    for _ in range(rng.randint(1, 2)):
        a = rng.randrange(len(fw))
        b = min(len(fw), a + rng.randint(1, 12))
        span = set(range(a, b))
        if span & used or any(rerun_hazard(fw[j]) for j in span):
            continue
        used |= span
        out.append((a, b))
    return tuple(sorted(out))


class FuzzPolicy:
    """The policy of plan (model, seed): draws the plan from the first graph it sees.

    Every rank's compile calls it on an equal graph and gets the same plan; the
    drawn :class:`Plan` and its description stay on the object.
    """

    def __init__(self, model: str, seed: int, plan: Optional[Plan] = None):
        self.model, self.seed = model, seed
        self.plan = plan if plan is not None else skeleton(model, seed)
        self.filled = plan is not None
        self.text = ""
        self.__qualname__ = "FuzzPolicy"

    def __call__(self, graph, resource):
        from tests.fuzz.plan import apply
        fw = graph.select(ntype=IRFwOperation)
        if not self.filled and self.plan.schedule and self.plan.nmicros > 1 and graph.micro is None:
            # the global batch's graph: cube reads only nmicros from this placement, then traces one
            # micro-batch and calls the policy again; the plan is drawn from that graph (the shapes
            # the plans of a seed were always drawn from), so a draft placement does here
            draft = fill(copy.deepcopy(self.plan), graph, self.model, self.seed)
            apply(draft, graph)
            return graph
        if not self.filled:
            fill(self.plan, graph, self.model, self.seed)
            self.filled = True
        if not self.text:
            self.text = self.plan.describe(fw)
        if resource.ngpus != self.plan.ndev:
            raise AssertionError(f"plan error: plan for {self.plan.ndev} devices run on {resource.ngpus}")
        apply(self.plan, graph)
        return graph
