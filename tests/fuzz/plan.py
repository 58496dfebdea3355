"""A fuzzed plan as plain data, and the policy that applies it to a graph.

A :class:`Plan` names forward ops by their position among the graph's forward
ops, so it is independent of object identity: the same plan applies to every
rank's graph of a compile, prints as text, and can be written out literally in
a regression test. ``policy(plan)`` turns it into a policy function.

Placement of one op (:class:`Place`): ``devices`` in piece order and
``factors``, applied outer first: ``(idx, dim, num)`` splits every current
piece ``num`` ways along input ``idx``'s dim ``dim`` (``graph.partition``),
``(None, None, num)`` makes ``num`` replicas (``graph.replicate``). The product
of the ``num``s is ``len(devices)``; piece ``k`` (in the order the nested calls
return them) runs on ``devices[k]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from cube.ir import IRDataOperation, IRFwOperation

Factor = Tuple[Optional[int], Optional[int], int]


V_SCHEDULES = ("zbv", "dualpipev")   # two stages per pipeline group, stage k on group min(k, 2n - 1 - k)

@dataclass(frozen=True)
class Place:
    """Where one op runs: ``devices`` in piece order, ``factors`` outer first (see the module doc)."""

    devices: Tuple[int, ...]
    factors: Tuple[Factor, ...] = ()

    def text(self) -> str:
        parts = [f"split idx={i} dim={d} x{n}" if i is not None else f"replicate x{n}" for i, d, n in self.factors]
        return (", then ".join(parts) or "whole") + f" over {list(self.devices)}"


@dataclass
class Plan:
    """One fuzzed plan.

    Attributes:
        ndev: world size.
        schedule: None (one batch per step, no schedule), "1f1b", "gpipe", "interleaved", "zb-h1", "zbv" or
            "dualpipev" (the last two: two stages per group in a V).
        nmicros: micro-batches per step (1 without a schedule).
        groups: devices of each pipeline rank (one group, all devices, without a schedule).
        cuts: forward-op positions where stages start (the first is 0); stage ``k``
            runs on ``groups[k % len(groups)]``.
        base: per pipeline rank, how its ops are placed unless ``ops`` says otherwise:
            "dp" (the batch split over the group), "tp" (Megatron column/row pairs),
            "rep" (replicated on the group).
        data: the data operation's pieces: per entry, a :class:`Place` (the data op is
            replicated once per entry, then each replica placed by its entry).
        ops: forward-op position -> its :class:`Place` (overrides ``base``).
        recompute: forward-op position ranges ``(start, stop)``, one recompute group each.
    """

    ndev: int
    schedule: Optional[str] = None
    nmicros: int = 1
    groups: Tuple[Tuple[int, ...], ...] = ()
    cuts: Tuple[int, ...] = (0,)
    base: Tuple[str, ...] = ("rep",)
    data: Tuple[Place, ...] = ()
    ops: Dict[int, Place] = field(default_factory=dict)
    recompute: Tuple[Tuple[int, int], ...] = ()

    @property
    def nstages(self) -> int:
        return len(self.cuts)

    def stage_of(self, pos: int) -> int:
        return max(k for k, c in enumerate(self.cuts) if c <= pos)

    def group_of(self, pos: int) -> int:
        """The pipeline group running forward op ``pos``: its stage's, round robin, or in a V (ZB-V, DualPipeV)."""
        k = self.stage_of(pos)
        if self.schedule in V_SCHEDULES:
            return min(k, self.nstages - 1 - k)
        return k % len(self.groups)

    def describe(self, fw: Optional[Sequence[IRFwOperation]] = None) -> str:
        """The plan as readable text; ``fw`` (the graph's forward ops) adds op names and modules."""
        def op(i: int) -> str:
            if fw is None or i >= len(fw):
                return f"op {i}"
            return f"op {i} {fw[i].name!r}@{fw[i].module_path or '<top>'}"
        sched = (f"schedule {self.schedule} x{self.nmicros} micro-batches" if self.schedule
                 else "no schedule")
        lines = [f"{self.ndev} devices, {sched}"]
        if self.schedule:
            lines.append(f"stage cuts at ops {list(self.cuts)} ({self.nstages} stages) on pipeline groups "
                         f"{[list(g) for g in self.groups]}; base per group {list(self.base)}")
        else:
            lines.append(f"base {self.base[0]} on {list(self.groups[0])}")
        lines.append("data op: " + "; ".join(p.text() for p in self.data))
        for i in sorted(self.ops):
            lines.append(f"{op(i)}: {self.ops[i].text()}")
        for a, b in self.recompute:
            lines.append(f"recompute ops {a}..{b - 1}")
        return "\n".join(lines)

    def literal(self) -> str:
        """Python source that rebuilds this plan (for a regression test)."""
        ops = ", ".join(f"{k}: {v!r}" for k, v in sorted(self.ops.items()))
        return (f"Plan(ndev={self.ndev}, schedule={self.schedule!r}, nmicros={self.nmicros}, "
                f"groups={self.groups!r}, cuts={self.cuts!r}, base={self.base!r}, data={self.data!r}, "
                f"ops={{{ops}}}, recompute={self.recompute!r})")


def place(graph, node, where: Place) -> None:
    """Applies one :class:`Place` to ``node`` (partition/replicate, then assign)."""
    pieces = [node]
    for idx, dim, num in where.factors:
        nxt = []
        for p in pieces:
            if idx is None:
                nxt += graph.replicate(p, times=num)
            else:
                algo = None if isinstance(p, IRDataOperation) else p.algorithms("dim")
                nxt += graph.partition(p, algo, idx=idx, dim=dim, num=num)
        pieces = nxt
    if len(pieces) != len(where.devices):
        raise AssertionError(f"plan error: {len(pieces)} pieces for devices {where.devices}")
    for dev, p in zip(where.devices, pieces):
        graph.assign(p, dev)


def base_place(graph, base: str, group: Tuple[int, ...], flows: dict, node) -> Place:
    """The :class:`Place` of ``node`` under a group's base plan ("dp", "tp" or "rep")."""
    n = len(group)
    if n == 1 or base == "rep":
        return Place(group, ((None, None, n),) if n > 1 else ())
    key = (base, n)
    if key not in flows:
        from cube.ir.follow import batch_flow
        from cube.ir.megatron import megatron_flow
        flows[key] = batch_flow(graph, n) if base == "dp" else megatron_flow(graph, n)
    split = flows[key].split_of(node)
    return Place(group, ((None, None, n),) if split is None else ((split[0], split[1], n),))


def apply(plan: Plan, graph) -> None:
    """Applies ``plan`` to ``graph`` in place (what the policy does)."""
    from cube import schedule as sched
    fw = graph.select(ntype=IRFwOperation)
    flows: dict = {}
    for k, group in enumerate(plan.groups):   # follow the splits before any op is cut
        base_place(graph, plan.base[k], group, flows, fw[0])
    for a, b in plan.recompute:
        graph.recompute(fw[a:b])
    data = graph.select(ntype=IRDataOperation)
    if len(data) != 1:
        raise AssertionError(f"plan error: expected one data operation, got {len(data)}")
    copies = graph.replicate(data[0], times=len(plan.data)) if len(plan.data) > 1 else data
    for node, where in zip(copies, plan.data):
        place(graph, node, where)
    if plan.schedule:
        graph.staging([fw[c] for c in plan.cuts])
    ngroups = len(plan.groups)
    for i, node in enumerate(fw):
        k = plan.group_of(i)
        where = plan.ops.get(i) or base_place(graph, plan.base[k], plan.groups[k], flows, node)
        place(graph, node, where)
    if plan.schedule == "1f1b":
        sched.sched_1f1b(graph, plan.nmicros, plan.nstages)
    elif plan.schedule == "gpipe":
        sched.sched_gpipe(graph, plan.nmicros, plan.nstages)
    elif plan.schedule == "interleaved":
        sched.sched_1f1b_interleaved(graph, plan.nmicros, ngroups, plan.nstages // ngroups)
    elif plan.schedule == "zb-h1":
        sched.sched_zb_h1(graph, plan.nmicros, plan.nstages)
    elif plan.schedule == "zbv":
        sched.sched_zbv(graph, plan.nmicros, plan.nstages)
    elif plan.schedule == "dualpipev":
        sched.sched_dualpipev(graph, plan.nmicros, plan.nstages)
    elif plan.schedule is not None:
        raise AssertionError(f"plan error: unknown schedule {plan.schedule!r}")



def parse(source: str) -> Plan:
    """The plan that ``Plan.literal()`` wrote as ``source``."""
    return eval(source, {"__builtins__": {}}, {"Plan": Plan, "Place": Place})   # our own literal only
