"""PASPipeDream: a pipeline whose stages are replicated unevenly (PipeDream's ``stage_to_num_ranks``).

Stage ``k`` runs data parallel over ``stage_to_num_ranks[k]`` devices, the
stages on consecutive devices (``{0: 1, 1: 2}``: stage 0 on device 0, stage 1
on devices 1 and 2, each taking half of every micro-batch). Stages are cut
balanced by op cost (as ``PAS1F1B``); values crossing stages of different
sizes move point to point, each sender sending each receiver only the rows it
reads, and gradients come back to the rows they belong to. 1F1B over
``nmicros`` micro-batches (``CUBE_MICROS``, default 4); each micro-batch's batch
size must divide by every stage's replica count.

Pass the mapping as an option, ``stage_to_num_ranks={0: 1, 1: 2}`` or ``(1, 2)``
(replicas per stage, in stage order), or ``CUBE_STAGE_RANKS=1,2``.
"""
from typing import Dict, List, Optional, Sequence, Union

from cube import config, schedule
from cube.ir import IRDataOperation, IRGraph
from cube.mesh import consecutive
from cube.schedule.balance import stage_starts
from cube.toolkit import Recompute, apply_recompute, data_parallel, place_all, place_data

Ranks = Union[Dict[int, int], Sequence[int], None]


def stage_sizes(stage_to_num_ranks: Ranks, ngpus: int) -> List[int]:
    """Devices per stage, in stage order (``CUBE_STAGE_RANKS`` when None).

    Raises:
        ValueError: not stages ``0..k-1`` with positive counts, or not ``ngpus`` devices in all.
    """
    ranks = stage_to_num_ranks or config.stage_ranks()
    counts = dict(ranks) if isinstance(ranks, dict) else dict(enumerate(ranks))
    if sorted(counts) != list(range(len(counts))) or any(int(n) < 1 for n in counts.values()):
        raise ValueError(f"PASPipeDream: stage_to_num_ranks must map stages 0..k-1 to positive counts, got {counts}")
    sizes = [int(counts[k]) for k in range(len(counts))]
    if sum(sizes) != ngpus:
        raise ValueError(f"PASPipeDream: stage_to_num_ranks {counts} uses {sum(sizes)} devices but the plan has "
                         f"{ngpus}; launch {sum(sizes)} ranks or change the mapping")
    return sizes


def PASPipeDream(graph: IRGraph, resource, stage_to_num_ranks: Ranks = None, schedule_name: str = "1f1b",
                 nmicros: Optional[int] = None, recompute: Recompute = False) -> IRGraph:
    """1F1B (or ``schedule_name="gpipe"``) over stages replicated ``stage_to_num_ranks[k]`` times each
    (module docstring); ``recompute``: blocks to recompute (default none)."""
    if schedule_name not in ("1f1b", "gpipe"):
        raise ValueError(f"PASPipeDream: schedule_name must be '1f1b' or 'gpipe', got {schedule_name!r}")
    meshes = consecutive(stage_sizes(stage_to_num_ranks, resource.ngpus))
    stages = graph.staging(stage_starts(graph, len(meshes))) if len(meshes) > 1 else [graph.nodes()]
    place_data(graph, meshes)   # every stage reads the batch
    for mesh, stage in zip(meshes, stages):
        ops = [op for op in stage if not isinstance(op, IRDataOperation)]
        place_all(graph, mesh, ops, dp=data_parallel(graph, mesh["dp"], fuse=False))   # ops listed before
    apply_recompute(graph, recompute)
    if len(meshes) > 1:
        getattr(schedule, f"sched_{schedule_name}")(graph, nmicros or config.micro_batches(), len(meshes))
    return graph
