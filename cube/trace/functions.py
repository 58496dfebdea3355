"""Custom ``torch.autograd.Function``s a model calls: torch.export traces their forward only.

A model may compute part of its forward with a ``torch.autograd.Function`` of its own (Hugging
Face PhiMoE's router multiplier, a straight-through estimator, a gradient reversal). torch.export
(non-strict) traces through ``Function.apply`` into the forward's ATen ops, and cube's program
differentiates those ops: the Function's own ``backward`` is not run. Where it computes the
forward's gradient, nothing changes; where it computes something else (an estimator), the
compiled step's gradients are not the single device's.

:func:`watch` records, while a model is exported, every Function class outside torch itself that
the forward applies, with the model line that applies it; :func:`report` logs one warning per class
naming it and the fix (a function registered with ``cube.register_op`` runs as written, its
backward included).
"""
from __future__ import annotations

import logging
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Dict, Iterator

import torch

_PATCH_LOCK = threading.Lock()
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
        if threading.get_ident() == me and cls not in seen and not cls.__module__.startswith("torch"):
            seen[cls] = _caller()
        return original.__get__(None, cls)(*args, **kwargs)
    with _PATCH_LOCK:
        base.apply = classmethod(apply)
    try:
        yield seen
    finally:
        with _PATCH_LOCK:
            base.apply = original


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
            "cube: torch.autograd.Function %s.%s (%s) is traced through its forward; the compiled step "
            "differentiates that forward and does not run the Function's own backward. If its backward "
            "computes something else than the forward's gradient (an estimator), wrap the call in a function "
            "registered with cube.register_op, which runs as written, backward included (write the Function "
            "with a setup_context staticmethod: the registered op's backward is functorch's vjp).",
            cls.__module__, cls.__qualname__, where)
