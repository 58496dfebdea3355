"""Balanced pipeline stages from simulated op costs (PipeDream-style).

For one data x tensor parallel layout of a stage, each logical forward op gets
a cost: its piece's forward and backward time on a rank, plus the blocking
collectives that feed it, both ways. ``balanced_starts`` hands these, and the
point-to-point time of what crosses each cut, to the dynamic program of
``cube.schedule.balance`` (which minimises the slowest stage, cutting between
transformer layers when the model has them).
"""
from __future__ import annotations

from typing import List

from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation
from cube.passes.rank_plans import RankPlan
from cube.schedule.balance import stage_starts
from cube.sim.costs import needs_grad
from cube.sim.instructions import COLLECTIVES


def logical_ops(graph: IRGraph) -> List[IRFwOperation]:
    """The logical forward ops of ``graph`` in program order (one per traced op, pieces folded)."""
    return list(dict.fromkeys(op.root for op in graph.select(ntype=IRFwOperation)))


def op_costs(graph: IRGraph, plan: RankPlan, costs, comm) -> List[float]:
    """Seconds per logical forward op of ``graph`` (``logical_ops`` order) on ``plan``'s rank:
    forward + backward of its piece and of the collectives before it."""
    index = {id(op): k for k, op in enumerate(logical_ops(graph))}
    out = [0.0] * len(index)
    pending = 0.0
    for call in plan.calls:
        if call.op is None:
            s = call.step
            if s.kind in COLLECTIVES or s.kind == "identity_all_reduce":
                t = call.outputs[0]
                nbytes = t.numel() * t.dtype.itemsize * (len(s.ranks) if s.kind == "reduce_scatter" else 1)
                pending += comm.cost("all_reduce" if s.kind == "identity_all_reduce" else s.kind, nbytes,
                                     tuple(s.ranks))
            continue
        k = index.get(id(call.op.root))
        if k is None:
            continue
        c = costs.op_cost(call)
        out[k] += c.fw + (c.bw if needs_grad(call) else 0.0) + pending
        pending = 0.0
    return out


def balanced_starts(graph: IRGraph, nstages: int, per_op: List[float], comm) -> List[int]:
    """Indices (into ``logical_ops`` of the unpartitioned ``graph``) of the first op of each of
    ``nstages`` stages balanced for ``per_op`` seconds; crossing values cost a send each way."""
    ops = logical_ops(graph)
    if len(per_op) != len(ops):
        raise ValueError(f"{len(per_op)} op costs for {len(ops)} ops; measure them on the same model and batch")
    index = {id(op): k for k, op in enumerate(ops)}

    def send(t) -> float:
        one = comm.cost("p2p", t.numel() * t.dtype.itemsize, 2)
        return 2 * one if t.requires_grad else one
    starts = stage_starts(graph, nstages, cost=lambda op: per_op[index[id(op)]], comm=send)
    return [index[id(op)] for op in starts]
