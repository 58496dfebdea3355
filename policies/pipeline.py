"""PAS1F1B / PASGPipe: pipeline parallel, one stage per device, stages balanced by cost.

The forward ops are cut into ``ngpus`` contiguous stages whose slowest stage
is as fast as it can be (``cube.schedule.balance``: a dynamic program over an
estimate of each op's forward and backward time from its FLOPs and bytes, plus
the activations sent between stages; between transformer layers when the model
has them). Each stage runs on its own device and a step takes ``CUBE_MICROS``
micro-batches (default 4) through the schedule. The batch tensors reach every
stage. Pass measured op costs with ``functools.partial(PAS1F1B, cost=...)``.
"""
from typing import Callable, Optional

from cube import config, schedule
from cube.ir import IRDataOperation, IRFwOperation, IRGraph
from cube.ir.blocks import recompute_blocks
from cube.schedule.balance import stage_starts


def balanced_starts(graph: IRGraph, nstages: int, cost: Optional[Callable[[IRFwOperation], float]] = None) -> list:
    """The first op of each of ``nstages`` balanced stages (see ``cube.schedule.balance.stage_starts``)."""
    return stage_starts(graph, nstages, cost=cost)


def _pipeline(graph: IRGraph, resource, make, cost=None) -> IRGraph:
    n = resource.ngpus
    stages = graph.staging(balanced_starts(graph, n, cost))
    for node in graph.select(ntype=IRDataOperation):
        for dev, piece in enumerate(graph.replicate(node, times=n) if n > 1 else [node]):
            graph.assign(piece, dev)
    for dev, stage in enumerate(stages):
        graph.assign(stage, dev)
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    make(graph, config.micro_batches(), n)
    return graph


def PAS1F1B(graph: IRGraph, resource, cost=None) -> IRGraph:
    """1F1B (PipeDream-flush) over every device; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, schedule.sched_1f1b, cost)


def PASGPipe(graph: IRGraph, resource, cost=None) -> IRGraph:
    """GPipe over every device; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, schedule.sched_gpipe, cost)
