"""cube: compile a single-device PyTorch training step into a distributed one.

Public API: ``compile``, ``load_model``, ``init``, ``register_op``, the checkpoint
functions ``save_checkpoint``/``merge_checkpoint``/``load_checkpoint``, and the
``ir``, ``runtime`` and ``schedule`` subpackages a policy or training script uses.
A model built on the meta device compiles as it is and gets its values from
``load_model(init=..., weights=...)`` (``cube.runtime.materialize``);
``cube.runtime.data.part()`` tells a rank which part of the global batch it reads;
``Metrics`` measures and reports each training step (time, tokens/s, MFU, peak memory).
"""
from cube import ir, runtime, schedule
import cube.runtime.data  # noqa: F401  (cube.runtime.data: a rank's part of the batch)
from cube.compiler import CompiledStep, Plan, Traced, compile, explain, load_model, plan, trace_model
from cube.errors import CheckpointError, CubeInternalError, NonFiniteError
from cube.mesh import DeviceMesh
from cube.models import CausalLM
from cube.runtime.checkpoint import load_checkpoint, merge_checkpoint, save_checkpoint, wait_checkpoint
from cube.runtime.checkpoint_write import latest_checkpoint
from cube.runtime.device import init
from cube.runtime.finite import check_finite, find_nonfinite
from cube.runtime.metrics import Metrics
from cube.runtime.norm import clip_grad_norm_
from cube.runtime.zero import build_optimizer
from cube.trace.custom import register_op
from cube.trace.export import TraceError

from cube.version import __version__

from cube import compat

compat.install()   # `import policies` (the old name of cube.policies) where no other module has that name

__all__ = ["compile", "plan", "trace_model", "Plan", "Traced", "load_model", "init", "register_op", "save_checkpoint", "merge_checkpoint", "CausalLM",
           "wait_checkpoint", "latest_checkpoint", "CheckpointError", "check_finite", "find_nonfinite",
           "NonFiniteError",
           "load_checkpoint", "build_optimizer", "clip_grad_norm_", "Metrics", "explain", "CompiledStep",
           "TraceError", "CubeInternalError", "DeviceMesh", "ir", "runtime", "schedule", "__version__"]
