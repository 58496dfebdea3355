"""PASSingle: the whole model on every device, each running the full batch.

With one device this is plain single-device training. With more, every rank
runs the same full step, so results match and no communication is needed.
"""
from cube.ir import IRGraph
from cube.ir.blocks import recompute_blocks


def PASSingle(graph: IRGraph, resource) -> IRGraph:
    for node in graph.nodes():
        if resource.ngpus == 1:
            graph.assign(node, 0)
            continue
        for dev, piece in enumerate(graph.replicate(node, times=resource.ngpus)):
            graph.assign(piece, dev)
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    return graph
