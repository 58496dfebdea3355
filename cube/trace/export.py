"""torch -> fx: ``torch.export`` (non-strict) of the model on one batch."""
from __future__ import annotations

import inspect
import os
import traceback

import torch

from cube.trace.repeat import export_repeated


class TraceError(ValueError):
    """The model could not be traced; the message says where and why."""


def _model_location(model: torch.nn.Module) -> str:
    cls = type(model)
    try:
        file = inspect.getsourcefile(cls.forward)
        _, line = inspect.getsourcelines(cls.forward)
        return f"{cls.__qualname__}.forward at {file}:{line}"
    except (OSError, TypeError):
        return f"{cls.__qualname__}.forward"


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and cube: where the model failed."""
    torch_dir = os.path.dirname(torch.__file__)
    cube_dir = os.path.dirname(os.path.dirname(__file__))
    found = ""
    for fr in traceback.extract_tb(exc.__traceback__):
        if fr.filename.startswith(torch_dir) or fr.filename.startswith(cube_dir):
            continue
        found = f"{fr.filename}:{fr.lineno} in {fr.name}: {fr.line}"
    return found


def export(model: torch.nn.Module, args: tuple) -> "torch.export.ExportedProgram":
    """Exports ``model(*args)`` to ATen training IR (a long stack of identical blocks is
    exported once and repeated: ``cube.trace.repeat``).

    Raises:
        TraceError: export failed; the message holds the model's location, the
            line of the model it failed on and the exporter's own message.
    """
    def whole():
        return torch.export.export(model, tuple(args), strict=False)
    try:
        return export_repeated(model, whole) or whole()
    except Exception as e:  # any failure of export becomes one clear error
        where = _user_frame(e)
        first = str(e).strip().splitlines()
        msg = "\n".join(first[:12])
        raise TraceError(
            f"cube could not trace {_model_location(model)} with torch.export (non-strict).\n"
            + (f"It failed at {where}\n" if where else "")
            + f"{type(e).__name__}: {msg}\n"
            "Fix: make forward traceable for the sample batch (no data-dependent Python control "
            "flow on tensor values, no unsupported ops), or wrap the offending part in a function "
            "registered with cube.register_op.") from e
