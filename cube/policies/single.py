"""PASSingle: the whole model on every device, each running the full batch.

With one device this is plain single-device training. With more, every rank
runs the same full step, so results match and no communication is needed.
"""
from cube.ir import IRGraph
from cube.toolkit import Recompute, apply_recompute, whole


def PASSingle(graph: IRGraph, resource, recompute: Recompute = None) -> IRGraph:
    """Every op whole on every device.

    Args:
        recompute: blocks to recompute (``cube.toolkit.apply_recompute``; default ``CUBE_RECOMPUTE``).
    """
    whole(graph, resource)
    apply_recompute(graph, recompute)
    return graph
