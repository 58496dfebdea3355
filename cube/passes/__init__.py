"""IR -> IR passes and the graph checker."""
from cube.passes.check import check_graph

__all__ = ["check_graph"]
