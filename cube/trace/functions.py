"""Custom ``torch.autograd.Function``s a model calls, run as written.

A model may compute part of its forward with a ``torch.autograd.Function`` of its own (Hugging
Face PhiMoE's router multiplier, RecurrentGemma's clipped square root, a straight-through estimator,
a gradient reversal). torch.export (non-strict) traces through ``Function.apply`` into the forward's
ATen ops, and a program differentiating those ops would not run the Function's own ``backward``:
where it computes something else than the forward's gradient, the gradients would not be the single
device's. So while a model is exported, :func:`watch` turns each such call into one op that runs the
Function, forward and backward, as written (``cube.runtime.functions``; its splits are the ones its
pieces keep, ``cube.trace.derived.derive_function``).

A call that cannot be one op (a class defined inside a function, keyword arguments, an argument other
than a tensor or a plain constant, a result other than one tensor) is traced through as before:
:func:`report` logs one warning per class naming it, the model line that applies it and the fix.
"""
from __future__ import annotations

import logging
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Dict, Iterator

import torch

from cube.runtime import functions as fn_ops

_PATCH_LOCK = threading.Lock()
# torch's and cube's own Functions trace as they are, and torchao's float8 matmuls (cube.passes.float8 knows them)
_OWN = frozenset({"torch", "cube", "torchao"})
_INSIDE = threading.local()   # set while a captured call runs the Function itself
_INSIDE.on = False
_REPORTED: set = set()   # classes warned about in this process (every rank and trace would say it again)


@contextmanager
def watch() -> Iterator[Dict[type, str]]:
    """Yields ``{Function class: where it was applied}``, filled while the block runs (in this
    thread only: the other ranks of an in-process world run on)."""
    seen: Dict[type, str] = {}
    me = threading.get_ident()
    base = torch.autograd.Function
    original = base.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        own = cls.__module__.split(".")[0] in _OWN
        if threading.get_ident() == me and not own and not getattr(_INSIDE, "on", False):
            captured = _captured(cls, args, kwargs)
            if captured is not None:
                return captured
            seen.setdefault(cls, _caller())
        return original.__get__(None, cls)(*args, **kwargs)
    with _PATCH_LOCK:
        base.apply = classmethod(apply)
    try:
        yield seen
    finally:
        with _PATCH_LOCK:
            base.apply = original


def _captured(cls: type, args: tuple, kwargs: dict):
    """The call as one op running the Function as written (``cube.runtime.functions``), or None where it
    cannot be one: keyword arguments, an argument neither a tensor nor a plain constant, a class not
    importable by its path (defined inside a function), or a result other than one tensor."""
    if kwargs or not any(isinstance(a, torch.Tensor) for a in args) or "<locals>" in cls.__qualname__:
        return None
    if not all(isinstance(a, torch.Tensor) or fn_ops.plain_constant(a) for a in args):
        return None
    try:
        if fn_ops.find(cls.__module__, cls.__qualname__) is not cls:
            return None
        constants = [fn_ops.TENSOR if isinstance(a, torch.Tensor) else a for a in args]
        _INSIDE.on = True   # the op's own calls of the Function (its fake run) are the Function's
        try:
            return fn_ops.op(cls.__module__, cls.__qualname__, constants)(
                [a for a in args if isinstance(a, torch.Tensor)])
        finally:
            _INSIDE.on = False
    except Exception:   # noqa: BLE001 - not one tensor out, or a class the op cannot run: traced through
        return None


def _caller() -> str:
    """``file:line: code`` of the innermost frame outside torch and cube (the model's line)."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/cube/" not in path and "contextlib" not in path:
            return f"{path.rsplit('/', 1)[-1]}:{frame.lineno}: {(frame.line or '').strip()}"
    return "an unknown line"


def report(seen: Dict[type, str]) -> None:
    """One warning per custom Function the forward applied (module docstring)."""
    for cls, where in seen.items():
        if cls in _REPORTED:
            continue
        _REPORTED.add(cls)
        logging.getLogger("cube").warning(
            "cube: torch.autograd.Function %s.%s (%s) is traced through its forward, since cube cannot run it as "
            "one op (a class defined inside a function, a call with keyword arguments or arguments other than "
            "tensors and plain constants, or a result other than one tensor): the compiled step differentiates "
            "that forward and does not run the Function's own backward. If its backward computes something else "
            "than the forward's gradient (an estimator), define the Function at module level and call it with "
            "tensors and constants (cube then runs it as written), or wrap the call in a function registered "
            "with cube.register_op.",
            cls.__module__, cls.__qualname__, where)
