"""PASPipeDream: a pipeline whose stages are replicated unevenly (PipeDream's ``stage_to_num_ranks``).

Stage ``k`` runs data parallel over ``stage_to_num_ranks[k]`` devices, the
stages on consecutive devices (``{0: 1, 1: 2}``: stage 0 on device 0, stage 1
on devices 1 and 2, each taking half of every micro-batch). Stages are cut
balanced by op cost (as ``PAS1F1B``); values crossing stages of different
sizes move point to point, each sender sending each receiver only the rows it
reads, and gradients come back to the rows they belong to. 1F1B over
``CUBE_MICROS`` micro-batches (default 4); each micro-batch's batch size must
divide by every stage's replica count.

Pass the mapping with ``functools.partial(PASPipeDream, stage_to_num_ranks={0: 1, 1: 2})``,
or ``CUBE_STAGE_RANKS=1,2`` (replicas per stage, in stage order).
"""
from typing import Dict, Optional

from cube import config, schedule
from cube.ir import IRDataOperation, IRGraph
from cube.ir.follow import batch_flow, place
from cube.schedule.balance import stage_starts


def PASPipeDream(graph: IRGraph, resource, stage_to_num_ranks: Optional[Dict[int, int]] = None,
                 schedule_name: str = "1f1b") -> IRGraph:
    """1F1B (or ``schedule_name="gpipe"``) over stages replicated ``stage_to_num_ranks[k]`` times each
    (module docstring)."""
    if schedule_name not in ("1f1b", "gpipe"):
        raise ValueError(f"PASPipeDream: schedule_name must be '1f1b' or 'gpipe', got {schedule_name!r}")
    counts = dict(stage_to_num_ranks or enumerate(config.stage_ranks()))
    if sorted(counts) != list(range(len(counts))) or any(int(n) < 1 for n in counts.values()):
        raise ValueError(f"PASPipeDream: stage_to_num_ranks must map stages 0..k-1 to positive counts, got {counts}")
    sizes = [int(counts[k]) for k in range(len(counts))]
    if sum(sizes) != resource.ngpus:
        raise ValueError(f"PASPipeDream: stage_to_num_ranks {counts} uses {sum(sizes)} devices but the plan has "
                         f"{resource.ngpus}; launch {sum(sizes)} ranks or change the mapping")
    groups, first = [], 0
    for n in sizes:
        groups.append(list(range(first, first + n)))
        first += n
    stages = graph.staging(stage_starts(graph, len(groups))) if len(groups) > 1 else [graph.nodes()]
    data = graph.select(ntype=IRDataOperation)[0]
    for devices, piece in zip(groups, graph.replicate(data, times=len(groups)) if len(groups) > 1 else [data]):
        place(graph, piece, (0, 0) if len(devices) > 1 else None, devices)
    for devices, stage in zip(groups, stages):
        flow = batch_flow(graph, len(devices))
        for op in stage:
            if not isinstance(op, IRDataOperation):
                place(graph, op, flow.split_of(op) if len(devices) > 1 else None, devices)
    if len(groups) > 1:
        getattr(schedule, f"sched_{schedule_name}")(graph, config.micro_batches(), len(groups))
    return graph
