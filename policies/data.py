"""PASData: data parallel for any model.

Every op that carries the batch is split along it, one piece per device; ops
that do not (position tables, masks, ops whose batch may not be split) run
whole on every device. cube inserts the communication: partial sums of the
loss are all-reduced, and the gradients of the parameters every device holds
are summed in buckets while backward runs.
"""
from cube.ir import IRDataOperation, IRGraph
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import batch_flow, place


def PASData(graph: IRGraph, resource) -> IRGraph:
    devices = list(range(resource.ngpus))
    flow = batch_flow(graph, resource.ngpus)
    for node in graph.nodes():
        split = (0, 0) if isinstance(node, IRDataOperation) else flow.split_of(node)
        place(graph, node, split, devices)
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    return graph
