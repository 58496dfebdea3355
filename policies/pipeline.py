"""PAS1F1B / PASGPipe / PAS1F1BInterleaved: pipeline parallel, stages balanced by cost.

The forward ops are cut into ``ngpus`` contiguous stages whose slowest stage
is as fast as it can be (``cube.schedule.balance``: a dynamic program over an
estimate of each op's forward and backward time from its FLOPs and bytes, plus
the activations sent between stages; between transformer layers when the model
has them). Each stage runs on its own device and a step takes ``CUBE_MICROS``
micro-batches (default 4) through the schedule. The batch tensors reach every
stage. Pass measured op costs with ``functools.partial(PAS1F1B, cost=...)``.

``PAS1F1BInterleaved`` (Megatron-LM's interleaved 1F1B) cuts ``ngpus x
CUBE_VIRTUAL`` stages (default 2 per device) and puts stage ``k`` on device
``k % ngpus``: each device runs several smaller stages, which shrinks the
pipeline's fill and drain; ``CUBE_MICROS`` must be a multiple of the device count.
"""
from typing import Callable, Optional

from cube import config, schedule
from cube.ir import IRDataOperation, IRFwOperation, IRGraph
from cube.ir.blocks import recompute_blocks
from cube.schedule.balance import stage_starts


def balanced_starts(graph: IRGraph, nstages: int, cost: Optional[Callable[[IRFwOperation], float]] = None) -> list:
    """The first op of each of ``nstages`` balanced stages (see ``cube.schedule.balance.stage_starts``)."""
    return stage_starts(graph, nstages, cost=cost)


def _pipeline(graph: IRGraph, resource, make, cost=None, nvirtual: int = 1) -> IRGraph:
    """``ngpus x nvirtual`` balanced stages, stage ``k`` on device ``k % ngpus``, then ``make``
    (``make(graph, nmicros)`` sets the schedule)."""
    n = resource.ngpus
    stages = graph.staging(balanced_starts(graph, n * nvirtual, cost))
    for node in graph.select(ntype=IRDataOperation):
        for dev, piece in enumerate(graph.replicate(node, times=n) if n > 1 else [node]):
            graph.assign(piece, dev)
    for k, stage in enumerate(stages):
        graph.assign(stage, k % n)
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    make(graph, config.micro_batches())
    return graph


def PAS1F1B(graph: IRGraph, resource, cost=None) -> IRGraph:
    """1F1B (PipeDream-flush) over every device; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_1f1b(g, m, resource.ngpus), cost)


def PASGPipe(graph: IRGraph, resource, cost=None) -> IRGraph:
    """GPipe over every device; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_gpipe(g, m, resource.ngpus), cost)


def PAS1F1BInterleaved(graph: IRGraph, resource, cost=None) -> IRGraph:
    """Interleaved 1F1B, ``CUBE_VIRTUAL`` stages per device; ``cost``: an op's measured time (optional)."""
    n, v = resource.ngpus, config.virtual_stages()
    return _pipeline(graph, resource, lambda g, m: schedule.sched_1f1b_interleaved(g, m, n, v), cost, v)
