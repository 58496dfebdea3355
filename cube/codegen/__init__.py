"""Per-rank programs (``cube.passes.program``) -> per-rank Python source."""
from cube.codegen.emit import emit_all

__all__ = ["emit_all"]
