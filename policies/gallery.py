"""The MagicCube gallery for the linears example: one idea per policy.

PASCol: every linear split by output features (column) over all devices; the
    next linear all-gathers its input (and reduce-scatters the gradient back).
PASRow: every linear split by input features (row); each linear's output is a
    partial sum, reduce-scattered into the next linear's row-split input.
Everything else runs whole on every device.
"""
from cube.ir import IRGraph
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import place

COLUMN = (1, 0)   # linear input 1 (the weight, out x in), dim 0: output features
ROW = (1, 1)      # the weight's dim 1: input features, a reduction (partial sums)


def _linears(graph: IRGraph, split, ngpus: int) -> IRGraph:
    devices = list(range(ngpus))
    for node in graph.nodes():
        place(graph, node, split if node.name == "linear" else None, devices)
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    return graph


def PASCol(graph: IRGraph, resource) -> IRGraph:
    return _linears(graph, COLUMN, resource.ngpus)


def PASRow(graph: IRGraph, resource) -> IRGraph:
    return _linears(graph, ROW, resource.ngpus)
