"""PASHybrid: data parallel across groups of devices, Megatron tensor parallel inside each.

Devices form a ``dp x tp`` mesh (tensor parallel innermost: devices ``0..tp-1``
hold batch part 0). ``tp`` defaults to ``CUBE_TP`` (2); ``dp = ngpus // tp``.
"""
from typing import Optional

from cube import config
from cube.ir import IRGraph
from cube.toolkit import Recompute, apply_recompute, data_parallel, grid, place_all, tensor_parallel


def PASHybrid(graph: IRGraph, resource, tp: Optional[int] = None, recompute: Recompute = None) -> IRGraph:
    """Data parallel over ``dp`` groups, tensor parallel over ``tp`` devices in each.

    Args:
        tp: tensor-parallel degree (default ``CUBE_TP``, 2).
        recompute: blocks to recompute (``cube.toolkit.apply_recompute``; default ``CUBE_RECOMPUTE``).
    """
    mesh = grid(resource.ngpus, tp=tp or config.tensor_parallel_degree(), policy="PASHybrid")
    place_all(graph, mesh, dp=data_parallel(graph, mesh["dp"]), tp=tensor_parallel(graph, mesh["tp"]))
    apply_recompute(graph, recompute)
    return graph
