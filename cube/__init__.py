"""cube: compile a single-device PyTorch training step into a distributed one.

Public API: ``compile``, ``load_model``, ``init``, ``register_op``, and the
``ir``, ``runtime`` and ``schedule`` subpackages a policy or training script uses.
"""
from cube import ir, runtime, schedule
from cube.compiler import CompiledStep, compile, load_model
from cube.runtime.device import init
from cube.trace.custom import register_op
from cube.trace.export import TraceError

from cube.version import __version__

__all__ = ["compile", "load_model", "init", "register_op", "CompiledStep", "TraceError", "ir",
           "runtime", "schedule", "__version__"]
