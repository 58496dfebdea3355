"""``cube.register_op``: user functions that stay one op in the IR."""
from __future__ import annotations

import functools
import re
from typing import Callable, List, Optional

import torch

from cube.ir.annotation import parse
from cube.trace.rules import REGISTRY

_NAMESPACE = "cube_user"
_lib = None


def _library():
    global _lib
    if _lib is None:
        _lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
    return _lib


def register_op(annotation: str, name: Optional[str] = None) -> Callable:
    """Registers ``fn`` as an op with a partition annotation.

    The function takes tensors (positionally) and returns one tensor. The model
    calls the returned wrapper; tracing keeps the call as one op named ``name``
    whose backward is the vector-Jacobian product of ``fn``.

    Example::

        @cube.register_op("b s h^, h^ o -> b s o", name="my_proj")
        def my_proj(x, w):
            return x @ w

    Raises:
        ValueError: a malformed annotation or name.
    """
    parse(annotation)

    def decorator(fn: Callable) -> Callable:
        op_name = name or fn.__name__
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", op_name):
            raise ValueError(f"cube.register_op: {op_name!r} is not a valid op name (letters, digits, _)")
        qualname = f"{_NAMESPACE}::{op_name}"

        def impl(xs: List[torch.Tensor]) -> torch.Tensor:
            out = fn(*xs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"registered op {op_name!r} must return one tensor, got {type(out).__name__}")
            return out.clone() if any(out is x for x in xs) else out

        if not hasattr(getattr(torch.ops, _NAMESPACE, None) or object(), op_name):
            _library().define(f"{op_name}(Tensor[] xs) -> Tensor")
        torch.library.impl(qualname, "CompositeExplicitAutograd", lib=_library())(impl)
        torch.library.register_fake(qualname, lib=_library())(lambda xs: fn(*xs).clone())

        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*inputs[0])

        def backward(ctx, grad):
            xs = ctx.saved_tensors
            with torch.enable_grad():
                _, vjp = torch.func.vjp(fn, *xs)
                grads = vjp(grad)
            return list(grads),

        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_library())
        REGISTRY.register(op_name, annotation)
        op = getattr(getattr(torch.ops, _NAMESPACE), op_name).default

        @functools.wraps(fn)
        def wrapper(*xs):
            return op(list(xs))

        wrapper.cube_op = op
        return wrapper

    return decorator
