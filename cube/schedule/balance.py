"""Balanced pipeline stages: contiguous runs of ops whose slowest stage is as fast as it can be.

PipeDream's partitioning, for one stage per device: the forward ops, in
program order, are cut into ``nstages`` contiguous stages so that the largest
stage cost is the smallest possible. A stage costs the forward and backward
time of its ops plus the time to move the values that cross each of its two
boundaries (activations forward, their gradients back). With 1F1B every stage
runs one forward and one backward per micro-batch, so the slowest stage sets
the step time: ``(m + p - 1) x`` its time for ``m`` micro-batches on ``p`` stages.

:func:`split` is the dynamic program on plain numbers; :func:`stage_starts`
applies it to a graph with a per-op cost (the FLOPs/bytes estimate of
:class:`CostModel` by default, or any callable, e.g. profiled times) and cuts
between repeated blocks (transformer layers) when the model has them, and
inside a block where no more crosses than at its start (after a residual
add, between attention and MLP): whole layers are too coarse to balance a
stage holding the LM head and loss against one holding only layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

import numpy as np

from cube.ir.blocks import block_of
from cube.ir.operator import IRFwOperation
from cube.ir.ops import flops, op_info
from cube.ir.tensor import IRTensor, TensorKind

if TYPE_CHECKING:
    from cube.ir.graph import IRGraph


def split(costs: Sequence[float], nstages: int, cut_costs: Optional[Sequence[float]] = None,
          cuts: Optional[Sequence[int]] = None) -> List[int]:
    """Cuts ``costs`` (one per op, in order) into ``nstages`` contiguous stages.

    The stage of ops ``i..j-1`` costs ``sum(costs[i:j]) + cut_costs[i] + cut_costs[j]``
    (``cut_costs[k]``: moving what crosses the boundary before op ``k``; the ends
    of the model cost nothing). The result minimizes the largest stage cost;
    among the splits that reach it, the one with the smallest sum of squared
    stage costs (every stage as even as the bottleneck allows).

    Args:
        costs: non-negative cost of each op.
        nstages: number of stages (each gets at least one op).
        cut_costs: ``len(costs) + 1`` non-negative boundary costs (default: all 0).
        cuts: the positions ``k`` (``0 < k < len(costs)``) where a stage may
            start (default: every position).

    Returns:
        The index of the first op of each stage; the first is 0.

    Raises:
        ValueError: a negative cost, a cut out of range, or more stages than
            the allowed cuts make.
    """
    n = len(costs)
    if not isinstance(nstages, int) or isinstance(nstages, bool) or nstages < 1:
        raise ValueError(f"nstages must be a positive int, got {nstages!r}")
    if any(c < 0 or math.isnan(c) for c in costs):
        raise ValueError(f"op costs must be non-negative numbers, got {list(costs)}")
    edge = [0.0] * (n + 1) if cut_costs is None else [float(c) for c in cut_costs]
    if len(edge) != n + 1 or any(c < 0 or math.isnan(c) for c in edge):
        raise ValueError(f"cut_costs must hold {n + 1} non-negative numbers (one per boundary, ends "
                         f"included), got {list(cut_costs)}")
    edge[0] = edge[n] = 0.0
    allowed = sorted(set(range(1, n) if cuts is None else cuts))
    bad = [k for k in allowed if not 0 < k < n]
    if bad:
        raise ValueError(f"cuts {bad} out of range: a stage may start at positions 1..{n - 1} of {n} ops")
    pos = [0] + allowed + [n]
    m = len(pos) - 1   # segments between allowed cuts
    if n == 0 or nstages > m:
        raise ValueError(f"{nstages} stages but only {max(m, 0) if n else 0} places to cut {n} ops into: "
                         f"use at most {m if n else 0} pipeline stages (or allow more cut positions)")
    at = np.asarray(list(accumulate(costs, initial=0.0)), dtype=np.float64)[pos]   # prefix sums at the cuts
    cut = np.asarray([edge[k] for k in pos], dtype=np.float64)
    # pass 1: best[s][z], the smallest bottleneck of s stages over segments [0, z)
    best = np.full((nstages + 1, m + 1), np.inf)
    best[0, 0] = 0.0
    for s in range(1, nstages + 1):
        for z in range(s, m - (nstages - s) + 1):
            a = slice(s - 1, z)   # the last stage is segments [a, z)
            stage = at[z] - at[a] + cut[a] + cut[z]
            best[s, z] = np.maximum(best[s - 1, a], stage).min()
    limit = best[nstages, m] * (1 + 1e-12)
    # pass 2: within that bottleneck, the smallest sum of squared stage costs
    sq = np.full((nstages + 1, m + 1), np.inf)
    arg = np.zeros((nstages + 1, m + 1), dtype=np.int64)
    sq[0, 0] = 0.0
    for s in range(1, nstages + 1):
        for z in range(s, m - (nstages - s) + 1):
            a = slice(s - 1, z)
            stage = at[z] - at[a] + cut[a] + cut[z]
            total = np.where(stage <= limit, sq[s - 1, a] + stage * stage, np.inf)
            k = int(total.argmin())
            sq[s, z], arg[s, z] = total[k], s - 1 + k
    starts, z = [], m
    for s in range(nstages, 0, -1):
        z = int(arg[s, z])
        starts.append(pos[z])
    return starts[::-1]


def stage_costs(costs: Sequence[float], starts: Sequence[int],
                cut_costs: Optional[Sequence[float]] = None) -> List[float]:
    """The cost of each stage of a split (as :func:`split` counts it)."""
    n = len(costs)
    edge = [0.0] * (n + 1) if cut_costs is None else list(cut_costs)
    bounds = list(starts) + [n]
    return [sum(costs[bounds[k]:bounds[k + 1]]) + (edge[bounds[k]] if bounds[k] else 0.0)
            + (edge[bounds[k + 1]] if bounds[k + 1] < n else 0.0) for k in range(len(starts))]


# ------------------------------------------------------------------ op costs
def _bytes(t: IRTensor) -> int:
    return t.numel() * _itemsize(t)


def _itemsize(t: IRTensor) -> int:
    try:
        return t.dtype.itemsize
    except AttributeError:   # a dtype without itemsize (older torch): assume 4 bytes
        return 4


def op_flops(op: IRFwOperation) -> int:
    """Floating point operations of ``op``'s forward, from shapes (``cube.ir.ops.flops``; 0 for ops
    that only move data)."""
    return flops(op.name, [tuple(t.shape) for t in op.inputs], [tuple(t.shape) for t in op.outputs])


def op_bytes(op: IRFwOperation) -> int:
    """Bytes ``op``'s forward reads and writes (0 for views, which move nothing)."""
    if op_info(op.name).alias:
        return 0
    return sum(_bytes(t) for t in op.inputs) + sum(_bytes(t) for t in op.outputs)


@dataclass
class CostModel:
    """A rough time model of one device (seconds), the default cost of :func:`stage_starts`.

    An op's forward takes ``max(flops / flop_rate, bytes / memory_rate) + overhead``
    (a roofline plus a launch cost); its backward twice that when it needs a
    gradient. Crossing a stage boundary takes ``bytes / link_rate + latency``,
    twice when a gradient comes back. Only the ratios matter for balancing;
    pass measured costs (a profiler, a simulator) to :func:`stage_starts` for
    better ones.
    """

    flop_rate: float = 1e11     # flop/s
    memory_rate: float = 2e10   # bytes/s
    link_rate: float = 5e9      # bytes/s between stages
    overhead: float = 2e-6      # s per op
    latency: float = 2e-5       # s per message

    def op(self, op: IRFwOperation) -> float:
        """Forward plus backward time of ``op``."""
        fw = max(op_flops(op) / self.flop_rate, op_bytes(op) / self.memory_rate) + self.overhead
        return 3 * fw if any(t.requires_grad for t in op.outputs) else fw

    def send(self, t: IRTensor) -> float:
        """Time to move ``t`` across a stage boundary (and its gradient back)."""
        one = _bytes(t) / self.link_rate + self.latency
        return 2 * one if t.requires_grad else one


# ------------------------------------------------------------------ graphs
def forward_ops(graph: "IRGraph") -> List[IRFwOperation]:
    """The forward ops, one per op of the traced model (the first piece of a partitioned one)."""
    seen, out = set(), []
    for op in graph.select(ntype=IRFwOperation):
        key = id(op.root)
        if key not in seen:
            seen.add(key)
            out.append(op)
    return out


def block_cuts(ops: Sequence[IRFwOperation]) -> List[int]:
    """Positions ``k`` where ``ops[k - 1]`` and ``ops[k]`` are not in the same repeated block.

    Stages then hold whole transformer layers (and the ops around them); a
    model without blocks may be cut anywhere.
    """
    where = [block_of(op.module_path) for op in ops]
    return [k for k in range(1, len(ops)) if where[k] is None or where[k] != where[k - 1]]


def residual_cuts(ops: Sequence[IRFwOperation], cross: Sequence[Sequence[IRTensor]]) -> List[int]:
    """Positions ``k`` inside a repeated block where the activations crossing take no more bytes
    than those crossing at the block's start (``cross``: :func:`crossing`).

    In a transformer layer ``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` that is the point
    after the first residual add: only ``x`` crosses it, as at the layer's boundaries. A stage
    cut there costs what a cut between layers costs and halves the balancing step."""
    boundaries = set(block_cuts(ops))
    size = [sum(_bytes(t) for t in ts) for ts in cross]
    out, start = [], 0
    for k in range(1, len(ops)):
        if k in boundaries:
            start = k
        elif 0 < size[k] <= size[start]:
            out.append(k)
    return out


def crossing(ops: Sequence[IRFwOperation]) -> List[List[IRTensor]]:
    """For each boundary ``k`` (before ``ops[k]``; ``len(ops) + 1`` of them), the activations
    made before it and read after it (batch tensors and parameters reach every stage)."""
    made: Dict[int, int] = {}
    last: Dict[int, int] = {}
    tensors: Dict[int, IRTensor] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            if id(t) in made:
                last[id(t)] = i
        for t in op.outputs:
            if t.kind == TensorKind.ACTIVATION and id(t) not in made:
                made[id(t)], tensors[id(t)] = i, t
    out: List[List[IRTensor]] = [[] for _ in range(len(ops) + 1)]
    for key, end in last.items():
        for k in range(made[key] + 1, end + 1):
            out[k].append(tensors[key])
    return out


def stage_starts(graph: "IRGraph", nstages: int, cost: Optional[Callable[[IRFwOperation], float]] = None,
                 comm: Optional[Callable[[IRTensor], float]] = None,
                 cuts: Optional[Sequence[int]] = None) -> List[IRFwOperation]:
    """The first op of each of ``nstages`` balanced stages, for ``graph.staging``.

    Call it before partitioning ops (pieces count as their op).

    Args:
        cost: an op's forward plus backward time (default :meth:`CostModel.op`);
            profiled times can be passed here, e.g. ``lambda op: measured[op.module_path]``.
        comm: the time to move one activation across a boundary, both ways
            (default :meth:`CostModel.send`).
        cuts: positions in :func:`forward_ops` where a stage may start
            (default :func:`block_cuts` and :func:`residual_cuts`: between
            transformer layers and at the residual stream inside them, when
            the model has blocks to make ``nstages`` stages of, else anywhere).

    Raises:
        ValueError: more stages than places to cut.
    """
    ops = forward_ops(graph)
    model = CostModel()
    cost = cost or model.op
    comm = comm or model.send
    cross = crossing(ops)
    if cuts is None:
        cuts = sorted(set(block_cuts(ops)) | set(residual_cuts(ops, cross)))
        if len(cuts) + 1 < nstages:
            cuts = range(1, len(ops))
    edge = [sum(comm(t) for t in ts) for ts in cross]
    try:
        starts = split([float(cost(op)) for op in ops], nstages, edge, cuts)
    except ValueError as e:
        raise ValueError(f"balancing {len(ops)} ops of {graph.name} into {nstages} pipeline stages: {e}") from None
    return [ops[i] for i in starts]
