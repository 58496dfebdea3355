"""Expert policies: plain functions ``PAS(graph, resource, **options) -> graph``.

The table of shipped names lives in ``cube.policy`` (``cube.policy.SHIPPED``), so cube
resolves ``"PASData"`` without importing this package.
"""
from cube.policy import SHIPPED, resolve

__all__ = ["SHIPPED", "resolve"]
