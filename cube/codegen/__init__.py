"""Execution plan -> per-rank Python source."""
from cube.codegen.emit import generate, generate_all

__all__ = ["generate", "generate_all"]
