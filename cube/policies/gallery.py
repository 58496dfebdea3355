"""The MagicCube gallery for the linears example: one idea per policy.

PASCol: every linear split by output features (column, ``n`` in its annotation
    ``a k+, n k+, n -> a n``) over all devices; the next linear all-gathers its
    input (and reduce-scatters the gradient back).
PASRow: every linear split by input features (row, ``k``); each linear's output
    is a partial sum, reduce-scattered into the next linear's row-split input.
Everything else runs whole on every device.
"""
from cube.ir import IRGraph
from cube.mesh import DeviceMesh
from cube.toolkit import Recompute, apply_recompute, place


def _linears(graph: IRGraph, letter: str, ngpus: int, recompute: Recompute) -> IRGraph:
    mesh = DeviceMesh(("tp", ngpus))
    for node in graph.nodes():
        place(graph, node, mesh, tp=letter if node.name == "linear" else None)
    apply_recompute(graph, recompute)
    return graph


def PASCol(graph: IRGraph, resource, recompute: Recompute = None) -> IRGraph:
    return _linears(graph, "n", resource.ngpus, recompute)


def PASRow(graph: IRGraph, resource, recompute: Recompute = None) -> IRGraph:
    return _linears(graph, "k", resource.ngpus, recompute)
