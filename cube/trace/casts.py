"""A model's casts to "its input's dtype" under a main-parameter precision (``"bf16"``, ``"fp16"``, ``"fp8"``).

cube traces the model in float32, so a cast the model writes to the dtype of one of its values
(Hugging Face's ``hidden_states.to(input_dtype)`` after an RMSNorm computed in float32,
``softmax(..., dtype=torch.float32).to(query.dtype)``, rotary's ``cos.to(x.dtype)``) is traced as
a cast to float32. The model run in the low precision (its bf16 copy, what Megatron-LM and
torchtitan users run) casts those values to bf16 instead.

``low_casts`` learns each cast's target from a second export of the forward with the trainable
floating parameters in the low precision (meta tensors: no memory, no compute; the buffers keep
their dtype, as under the recipe they stay float32), the same batch. The ops of the two programs are
matched in program order, each pair checked for the same op (and a cast, every ``to``/``_to_copy``/
``type_as`` node, for the same module and model line); a cast that gives float32 in the traced program and the low precision in
the second is marked, and ``cube.trace.builder`` builds it as a cast to the low precision.
Explicit upcasts (``.float()``, ``.to(torch.float32)``, softmax's ``dtype=torch.float32``) give
float32 in both programs and stay. A cast to the dtype its input already has
(``x.to(torch.float32)`` of a float32 x) is x itself to torch, so the float32 program reads the
cast wherever the model reads x (HF's ``residual = hidden_states`` before the norm's upcast): where
the twin program casts, its other readers read x again (``_unshare``), or the residual stream would
stay float32. A lifted constant's ``lift_fresh_copy`` (made on a real model only, not on its meta
stand-in) is left out of the match. When the programs differ otherwise, nothing is changed and a
note is logged: the casts stay float32, as the trace has them.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, List, Optional

import torch
import torch.fx

log = logging.getLogger("cube")

MARK = "cube_low_cast"   # the fx node meta key of a cast the builder makes go to the low precision
_CASTS = frozenset({"to", "_to_copy", "type_as"})
_DEVICE_ONLY = frozenset({"lift_fresh_copy"})


def _name(target) -> str:
    return getattr(getattr(target, "_schema", None), "name", "").split("::")[-1]


def _where(node: torch.fx.Node) -> tuple:
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    stack = node.meta.get("nn_module_stack") or {}
    return (node.target, trace[-1].strip() if trace else "", tuple(v[0] for v in stack.values()))


def _dtype(node: torch.fx.Node) -> Optional[torch.dtype]:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


@contextmanager
def _low_stand_in(model: torch.nn.Module, low: torch.dtype) -> Iterator[None]:
    """The model with meta stand-ins of its tensors, its trainable floating parameters in ``low``."""
    tensors = [(store, k, t) for m in model.modules() for store in (m._parameters, m._buffers)
               for k, t in store.items() if t is not None]
    made = {}
    for store, k, t in tensors:
        if id(t) not in made:
            low_one = isinstance(t, torch.nn.Parameter) and t.requires_grad and t.is_floating_point()
            meta = torch.empty_like(t, device="meta", dtype=low if low_one else t.dtype)
            made[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else meta
        store[k] = made[id(t)]
    try:
        yield
    finally:
        for store, k, t in tensors:
            store[k] = t


def low_casts(model: torch.nn.Module, sample: tuple, ep, low: torch.dtype, dynamic_batch: bool = False) -> int:
    """Marks (``MARK``) the casts of ``ep`` (the float32 export of ``model`` on ``sample``) that go to
    the low precision when the model's weights are ``low``, and makes the readers of a cast the float32
    program gave back as its input read that input (module docstring). Returns how many changes."""
    from cube.trace.export import export
    mine = _ops(ep)
    if not any(_name(n.target) in _CASTS for n in mine):   # nothing to mark or unshare: no second export
        return 0
    with _low_stand_in(model, low):
        try:
            other = export(model, sample, dynamic_batch=dynamic_batch)
        except Exception as e:   # the low-precision forward does not trace: the casts stay as traced
            log.info("precision: the forward in %s does not trace (%s); casts to its values' dtype stay float32",
                     low, str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return 0
    theirs = _ops(other)
    differ = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if not _same(a, b)), None)
    if len(mine) != len(theirs) or differ is not None:
        log.info("precision: the forward in %s runs other ops than in float32 (%d against %d ops, first "
                 "difference at op %d); casts to its values' dtype stay float32", low, len(theirs), len(mine),
                 differ if differ is not None else min(len(mine), len(theirs)))
        return 0
    twin = dict(zip(mine, theirs))
    count = 0
    for a, b in zip(mine, theirs):
        if _name(a.target) not in _CASTS:
            continue
        if _dtype(a) == torch.float32 and _dtype(b) == low:
            a.meta[MARK] = low
            count += 1
        elif _kept(a) and not _kept(b):
            count += _unshare(a, b, twin)
    return count


def _ops(ep) -> List[torch.fx.Node]:
    """The ops of an exported program (its sub-graphs' included), in program order, without the copies
    of lifted constants (made on a real model, not on its meta stand-in)."""
    found = []
    for gm in ep.graph_module.modules():
        if isinstance(gm, torch.fx.GraphModule):
            found += [n for n in gm.graph.nodes if n.op == "call_function" and _name(n.target) not in _DEVICE_ONLY]
    return found


def _same(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    if a.target != b.target:
        return False
    return _name(a.target) not in _CASTS or _where(a) == _where(b)


def _kept(node: torch.fx.Node) -> bool:
    """A cast to the dtype its input already has (``x.to(torch.float32)`` of a float32 x): torch gives
    back x itself, so the traced program reads this node wherever the model reads x."""
    src = node.args[0] if node.args else None
    return isinstance(src, torch.fx.Node) and _dtype(src) is not None and _dtype(src) == _dtype(node)


def _unshare(a: torch.fx.Node, b: torch.fx.Node, twin: dict) -> int:
    """``a`` gave back its input in float32 and ``b``, its twin, casts: a reader of ``a`` whose twin
    reads ``b``'s input (the model's ``residual = x`` before ``x.to(torch.float32)``) reads ``a``'s
    input instead, as the model does. Returns how many readers changed."""
    src, count = a.args[0], 0
    for user in list(a.users):
        other = twin.get(user)
        if other is None or b in other.all_input_nodes or b.args[0] not in other.all_input_nodes:
            continue
        user.replace_input_with(a, src)
        count += 1
    return count


def retarget(target, args: tuple, kwargs: dict, dtype: torch.dtype):
    """``args``, ``kwargs`` of the cast ``target`` with its dtype argument ``dtype``; None when it has none
    (``x.to(other)``: the dtype of another tensor)."""
    names = [a.name for a in target._schema.arguments]
    if "dtype" not in names:
        return None
    i = names.index("dtype")
    if i < len(args) and not target._schema.arguments[i].kwarg_only:
        return tuple(args[:i]) + (dtype,) + tuple(args[i + 1:]), dict(kwargs)
    if "dtype" in kwargs:
        return tuple(args), {**kwargs, "dtype": dtype}
    return None
