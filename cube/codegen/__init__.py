"""Execution plan -> per-rank Python source."""
from cube.codegen.emit import generate

__all__ = ["generate"]
