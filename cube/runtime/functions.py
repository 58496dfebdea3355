"""A model's own ``torch.autograd.Function`` as one op: its forward and its backward run as written.

torch.export (non-strict) traces through ``Function.apply`` into the forward's ATen ops, and a
program differentiating those ops would not run the Function's ``backward``: wherever that backward
is not the forward's gradient (a straight-through estimator, a clipped derivative as RecurrentGemma's
``SqrtBoundDerivative``, a gradient reversal), the gradients would be others than the single device's.
``cube.trace.functions`` replaces such a call, while the model is traced, by an op of namespace
``cube_fn`` defined here: its forward calls ``Function.apply`` on the tensors (and the call's constant
arguments), its backward calls the Function's backward through autograd on the same inputs.

An op is named by the Function's import path and the call's constants (:func:`op`), so a program
loaded from the code cache defines it again without tracing the model.
"""
from __future__ import annotations

import hashlib
import importlib
import re
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

NAMESPACE = "cube_fn"
_LOCK = threading.Lock()
_LIB = None
_DEFINED: Dict[str, Tuple[str, str, Tuple[Any, ...]]] = {}   # op name -> (module, qualname, constants)
_OPS: Dict[Tuple[str, str, Tuple[Any, ...]], Any] = {}        # (module, qualname, constants) -> its op

# a constant argument is one of these (or a tuple or list of them); ``TENSOR`` marks a tensor's place
TENSOR = "<tensor>"
_CONSTANTS = (int, float, bool, str, type(None))


def plain_constant(v: Any) -> bool:
    """Whether ``v`` can stand in a call's constants (printed in generated code, hashed in a name)."""
    if isinstance(v, (list, tuple)):
        return all(plain_constant(x) for x in v)
    return isinstance(v, _CONSTANTS)


def name_of(module: str, qualname: str, constants: Sequence[Any]) -> str:
    """The op's name: the Function's class name and a hash of its path and the call's constants."""
    key = repr((module, qualname, tuple(constants))).encode()
    base = re.sub(r"\W", "_", qualname.rsplit(".", 1)[-1])
    return f"fn_{base}_{hashlib.sha1(key).hexdigest()[:10]}"


def find(module: str, qualname: str) -> type:
    """The Function class at ``module:qualname``."""
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _library():
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _LIB


def _merge(constants: Sequence[Any], xs: Sequence[torch.Tensor]) -> List[Any]:
    it = iter(xs)
    return [next(it) if c == TENSOR else c for c in constants]


def _frozen(v: Any) -> Any:
    return tuple(_frozen(x) for x in v) if isinstance(v, (list, tuple)) else v


def op(module: str, qualname: str, constants: Sequence[Any]) -> "torch._ops.OpOverload":
    """The op running ``module:qualname``'s Function on tensors placed as ``constants`` says (``TENSOR``
    at a tensor's place, the call's other arguments as they were), defined once per process. Generated
    code calls this on every forward: after the first call it is one dictionary lookup."""
    key = (module, qualname, _frozen(constants))
    found = _OPS.get(key)
    if found is not None:
        return found
    name = name_of(*key)
    with _LOCK:
        if name not in _DEFINED:
            _define(name, find(module, qualname), key[2])
            _DEFINED[name] = key
    found = _OPS[key] = getattr(getattr(torch.ops, NAMESPACE), name).default
    return found


def input_grads(fn, xs: Sequence[torch.Tensor], grad: torch.Tensor) -> List[Optional[torch.Tensor]]:
    """The gradients of ``fn(xs)`` (one tensor) for each of ``xs`` at the output gradient ``grad``: None for
    an input that is not floating point or complex, or that the output does not depend on."""
    leaves = [x.detach().requires_grad_(x.dtype.is_floating_point or x.dtype.is_complex) for x in xs]
    wanted = [x for x in leaves if x.requires_grad]
    with torch.enable_grad():
        out = fn(leaves)
        got = torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted and out.requires_grad \
            else [None] * len(wanted)
    found = dict(zip(map(id, wanted), got))
    return [found.get(id(x)) for x in leaves]


def described(name: str) -> Tuple[str, str, Tuple[Any, ...]]:
    """``(module, qualname, constants)`` of a defined op (what generated code names it by)."""
    return _DEFINED[name]


def _define(name: str, cls: type, constants: Tuple[Any, ...]) -> None:
    def apply(xs: Sequence[torch.Tensor]) -> torch.Tensor:
        return cls.apply(*_merge(constants, xs))

    def impl(xs: List[torch.Tensor]) -> torch.Tensor:
        out = apply(xs)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{cls.__module__}.{cls.__qualname__} returned {type(out).__name__}, not one tensor")
        # an op's output may not alias its inputs (a gradient reversal returns x.view_as(x))
        return out.clone() if out._is_view() or any(out is x for x in xs) else out

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[0])

    def backward(ctx, grad):
        return input_grads(apply, ctx.saved_tensors, grad),

    _library().define(f"{name}(Tensor[] xs) -> Tensor")
    torch.library.impl(f"{NAMESPACE}::{name}", "CompositeExplicitAutograd", lib=_library())(impl)
    torch.library.register_fake(f"{NAMESPACE}::{name}", lib=_library())(lambda xs: impl(xs))
    torch.library.register_autograd(f"{NAMESPACE}::{name}", backward, setup_context=setup_context, lib=_library())
