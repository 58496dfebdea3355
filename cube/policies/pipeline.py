"""PAS1F1B / PASGPipe / PAS1F1BInterleaved / PASZBH1 / PASZBV / PASDualPipeV: pipeline parallel, stages balanced by cost.

The forward ops are cut into ``ngpus`` contiguous stages whose slowest stage
is as fast as it can be (``cube.schedule.balance``: a dynamic program over an
estimate of each op's forward and backward time from its FLOPs and bytes, plus
the activations sent between stages; between transformer layers when the model
has them). Each stage runs on its own device and a step takes ``nmicros``
micro-batches (``CUBE_MICROS``, default 4) through the schedule. The batch
tensors reach every stage. Pass measured op costs with ``cost=...``.

``PAS1F1BInterleaved`` (Megatron-LM's interleaved 1F1B) cuts ``ngpus x
nvirtual`` stages (``CUBE_VIRTUAL``, default 2 per device) and puts stage ``k``
on device ``k % ngpus``: each device runs several smaller stages, which shrinks
the pipeline's fill and drain; ``nmicros`` must be a multiple of the device count.

``PASZBH1`` and ``PASZBV`` are the zero-bubble schedules (Qi et al., ICLR 2024),
whose backward leaves the linear layers' weight gradients for later: ZB-H1 over
``ngpus`` stages (1F1B's memory, a third of its bubble), ZB-V over ``2 x ngpus``
stages, stage ``k`` and ``2 ngpus - 1 - k`` on device ``k`` (nearly no bubble).
``PASDualPipeV`` (DeepSeek-V3's DualPipe in a V) places stages as ZB-V does and
runs the forward of one micro-batch beside the backward of another
(``cube.schedule.sched_dualpipev``; ``nmicros >= 2 x ngpus``).
"""
from typing import Callable, Optional

from cube import config, schedule
from cube.ir import IRFwOperation, IRGraph
from cube.mesh import DeviceMesh
from cube.schedule.balance import stage_starts
from cube.toolkit import Recompute, apply_recompute, place_data, place_stages

Cost = Optional[Callable[[IRFwOperation], float]]


def balanced_starts(graph: IRGraph, nstages: int, cost: Cost = None) -> list:
    """The first op of each of ``nstages`` balanced stages (see ``cube.schedule.balance.stage_starts``)."""
    return stage_starts(graph, nstages, cost=cost)


def _pipeline(graph: IRGraph, resource, make, cost: Cost, nmicros: Optional[int], recompute: Recompute,
              nvirtual: int = 1, v_shape: bool = False) -> IRGraph:
    """``ngpus x nvirtual`` balanced stages, stage ``k`` on device ``k % ngpus`` (``v_shape``: on
    device ``min(k, 2 ngpus - 1 - k)``), then ``make(graph, nmicros)`` sets the schedule."""
    meshes = DeviceMesh(("pp", resource.ngpus)).slices("pp")
    n = len(meshes) * nvirtual
    stages = graph.staging(balanced_starts(graph, n, cost))
    place_data(graph, meshes)   # every stage reads the batch
    place_stages(graph, stages, [meshes[r] for r in schedule.v_placement(n)] if v_shape else meshes)
    apply_recompute(graph, recompute)
    make(graph, nmicros or config.micro_batches())
    return graph


def PAS1F1B(graph: IRGraph, resource, cost: Cost = None, nmicros: Optional[int] = None,
            recompute: Recompute = None) -> IRGraph:
    """1F1B (PipeDream-flush) over every device; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_1f1b(g, m, resource.ngpus), cost, nmicros,
                     recompute)


def PASGPipe(graph: IRGraph, resource, cost: Cost = None, nmicros: Optional[int] = None,
             recompute: Recompute = None) -> IRGraph:
    """GPipe over every device; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_gpipe(g, m, resource.ngpus), cost, nmicros,
                     recompute)


def PAS1F1BInterleaved(graph: IRGraph, resource, cost: Cost = None, nmicros: Optional[int] = None,
                       nvirtual: Optional[int] = None, recompute: Recompute = None) -> IRGraph:
    """Interleaved 1F1B, ``nvirtual`` stages per device (default ``CUBE_VIRTUAL``); ``cost``: an op's
    measured time (optional)."""
    n, v = resource.ngpus, nvirtual or config.virtual_stages()
    return _pipeline(graph, resource, lambda g, m: schedule.sched_1f1b_interleaved(g, m, n, v), cost, nmicros,
                     recompute, v)


def PASZBH1(graph: IRGraph, resource, cost: Cost = None, nmicros: Optional[int] = None,
            recompute: Recompute = None) -> IRGraph:
    """ZB-H1 over every device (``cube.schedule.sched_zb_h1``); ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_zb_h1(g, m, resource.ngpus), cost, nmicros,
                     recompute)


def PASZBV(graph: IRGraph, resource, cost: Cost = None, nmicros: Optional[int] = None,
           recompute: Recompute = None) -> IRGraph:
    """ZB-V: ``2 x ngpus`` balanced stages in a V (``cube.schedule.sched_zbv``); ``cost``: an op's
    measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_zbv(g, m, 2 * resource.ngpus), cost, nmicros,
                     recompute, nvirtual=2, v_shape=True)


def PASDualPipeV(graph: IRGraph, resource, cost: Cost = None, nmicros: Optional[int] = None,
                 recompute: Recompute = None) -> IRGraph:
    """DualPipeV: ``2 x ngpus`` balanced stages in ZB-V's V (``cube.schedule.sched_dualpipev``); ``nmicros``
    (default ``CUBE_MICROS``) at least ``2 x ngpus``; ``cost``: an op's measured time (optional)."""
    return _pipeline(graph, resource, lambda g, m: schedule.sched_dualpipev(g, m, 2 * resource.ngpus), cost,
                     nmicros, recompute, nvirtual=2, v_shape=True)
