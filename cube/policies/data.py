"""PASData: data parallel for any model.

Every op that carries the batch is split along it, one piece per device; ops
that do not (position tables, masks, ops whose batch may not be split) run
whole on every device. cube inserts the communication: partial sums of the
loss are all-reduced, and the gradients of the parameters every device holds
are summed in buckets while backward runs.
"""
from cube.ir import IRGraph
from cube.mesh import DeviceMesh
from cube.toolkit import Recompute, apply_recompute, data_parallel, place_all


def PASData(graph: IRGraph, resource, recompute: Recompute = None) -> IRGraph:
    """Data parallel over every device (module docstring).

    Args:
        recompute: blocks to recompute (``cube.toolkit.apply_recompute``; default ``CUBE_RECOMPUTE``).
    """
    mesh = DeviceMesh(("dp", resource.ngpus))
    place_all(graph, mesh, dp=data_parallel(graph, mesh["dp"]))
    apply_recompute(graph, recompute)
    return graph
