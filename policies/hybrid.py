"""PASHybrid: data parallel across groups of devices, Megatron tensor parallel inside each.

Devices form a ``dp x tp`` grid: device ``i * tp + j`` holds batch part ``i``
and tensor-parallel piece ``j``. ``tp`` defaults to 2 (set ``CUBE_TP`` to
change it); ``dp = ngpus // tp``.
"""
from cube import config
from cube.ir import IRDataOperation, IRGraph
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import batch_flow, megatron_flow, place


def PASHybrid(graph: IRGraph, resource, tp: int = 0) -> IRGraph:
    tp = tp or config.tensor_parallel_degree()
    if resource.ngpus % tp:
        raise ValueError(f"PASHybrid: {resource.ngpus} devices do not form a grid with tp={tp}; "
                         f"use a device count divisible by tp")
    dp = resource.ngpus // tp
    data_flow = batch_flow(graph, dp)
    tensor_flow = megatron_flow(graph, tp)
    for node in graph.nodes():
        dsplit = (0, 0) if isinstance(node, IRDataOperation) else data_flow.split_of(node)
        for i, piece in enumerate(place(graph, node, dsplit, [i * tp for i in range(dp)])):
            place(graph, piece, tensor_flow.split_of(node), [i * tp + j for j in range(tp)])
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    return graph
