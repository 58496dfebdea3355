"""torch -> IR: export, op mapping, annotations."""
from cube.trace.builder import build_graph, op_name
from cube.trace.export import TraceError, export
from cube.trace.rules import REGISTRY

__all__ = ["build_graph", "export", "op_name", "TraceError", "REGISTRY"]
