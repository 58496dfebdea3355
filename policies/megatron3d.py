"""PASMegatron: data x tensor x pipeline parallel (Megatron-LM's 3D plan) with 1F1B.

The forward ops are cut into ``pp`` balanced stages (``cube.schedule.balance``,
between transformer layers). Each stage runs on ``dp x tp`` devices: data
parallel over ``dp`` groups and, inside each group, tensor parallel over ``tp``
devices as ``PASMegatronTP`` plans it (column/row linear pairs, attention by
heads, found from the graph's structure). Device ``k * dp * tp + i * tp + j``
holds stage ``k``, batch part ``i`` and tensor piece ``j`` (tensor parallel
innermost, pipeline outermost, as Megatron orders ranks). A step takes
``CUBE_MICROS`` micro-batches (default 4) through the 1F1B schedule. With
``CUBE_VIRTUAL=v`` (default 1) the ops are cut into ``pp x v`` stages instead,
stage ``k`` on the devices of pipeline rank ``k % pp``, run by interleaved 1F1B
(``CUBE_MICROS`` then a multiple of ``pp``).

Degrees: ``CUBE_TP`` (default 2) and ``CUBE_PP`` (default 2); ``dp = ngpus //
(tp * pp)``. With ``pp = 1`` it is ``PASHybrid`` with gradient accumulation over
the micro-batches.
"""
from typing import List

from cube import config, schedule
from cube.ir import IRDataOperation, IRGraph
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import batch_flow, megatron_flow, place
from cube.schedule.balance import stage_starts


def degrees(ngpus: int, tp: int = 0, pp: int = 0) -> tuple:
    """``(dp, tp, pp)`` for ``ngpus`` devices (``tp``/``pp`` from ``CUBE_TP``/``CUBE_PP`` when 0).

    Raises:
        ValueError: ``tp * pp`` does not divide ``ngpus``.
    """
    tp = tp or config.tensor_parallel_degree()
    pp = pp or config.pipeline_degree()
    if ngpus % (tp * pp):
        raise ValueError(f"PASMegatron: {ngpus} devices do not split into tensor parallel tp={tp} x pipeline "
                         f"pp={pp} groups ({tp * pp} devices each); set CUBE_TP and CUBE_PP so that their product "
                         f"divides the device count (the data parallel degree is devices / (tp * pp))")
    return ngpus // (tp * pp), tp, pp


def PASMegatron(graph: IRGraph, resource, tp: int = 0, pp: int = 0, nmicros: int = 0, cost=None,
                nvirtual: int = 0) -> IRGraph:
    """Plans ``graph`` on a ``pp x dp x tp`` grid of ``resource.ngpus`` devices with 1F1B.

    Args:
        tp, pp: tensor and pipeline degrees (0: ``CUBE_TP``, ``CUBE_PP``).
        nmicros: micro-batches per step (0: ``CUBE_MICROS``).
        nvirtual: stages per pipeline rank (0: ``CUBE_VIRTUAL``, default 1); more than one
            runs interleaved 1F1B.
        cost: an op's forward plus backward time, for balancing the stages
            (default: the FLOPs/bytes estimate of ``cube.schedule.balance``).
    """
    dp, tp, pp = degrees(resource.ngpus, tp, pp)
    nmicros = nmicros or config.micro_batches()
    nvirtual = nvirtual or config.virtual_stages(default=1)
    stages = graph.staging(stage_starts(graph, pp * nvirtual, cost=cost))
    data_flow = batch_flow(graph, dp)
    tensor_flow = megatron_flow(graph, tp)

    def grid(k: int, node, dsplit) -> None:   # stage k's dp x tp devices
        base = k * dp * tp
        groups: List[int] = [base + i * tp for i in range(dp)]
        for i, piece in enumerate(place(graph, node, dsplit, groups)):
            tsplit = None if isinstance(node, IRDataOperation) else tensor_flow.split_of(node)
            place(graph, piece, tsplit, [groups[i] + j for j in range(tp)])

    for node in graph.select(ntype=IRDataOperation):   # every stage reads the batch
        for k, piece in enumerate(graph.replicate(node, times=pp) if pp > 1 else [node]):
            grid(k, piece, (0, 0))
    for k, stage in enumerate(stages):
        for op in stage:
            grid(k % pp, op, data_flow.split_of(op))
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    if nvirtual > 1:
        schedule.sched_1f1b_interleaved(graph, nmicros, pp, nvirtual)
    else:
        schedule.sched_1f1b(graph, nmicros, pp)
    return graph
