"""The graph checker: cube's invariants, run after tracing and after the policy."""
from __future__ import annotations

from cube.ir.graph import IRGraph
from cube.ir.operator import IRDataOperation, IRFwOperation


def check_graph(graph: IRGraph, placed: bool = False) -> None:
    """Asserts the graph is well formed.

    Every value is defined before use (by the data operation, an attribute or an
    earlier op), there is one data operation, the loss is produced, and when
    ``placed`` every op has a device. These are cube's own invariants (the
    policy's mistakes are reported earlier as ValueError/TypeError).
    """
    defined = {id(t) for t in graph.attrs}
    datas = [op for op in graph.ops if isinstance(op, IRDataOperation)]
    assert datas, "graph has no data operation"
    for op in graph.ops:
        for t in op.inputs:
            assert id(t) in defined, f"{op!r} reads {t!r} before it is defined"
        defined.update(id(t) for t in op.outputs)
        if placed:
            assert op.device is not None, f"{op!r} has no device"
        if isinstance(op, IRFwOperation):
            assert op.target is not None, f"{op!r} has no target"
    assert id(graph.loss) in defined, f"the loss {graph.loss!r} is never produced"
