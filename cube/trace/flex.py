"""``flex_attention`` (torch.nn.attention.flex_attention) as one op of the IR.

torch.export records ``flex_attention`` as a higher-order op whose score and mask functions are
subgraphs (GraphModules) and whose block mask is a tuple of tensors and ints. cube makes it one
op, ``cube_flex::flex_attention(Tensor[] xs, str spec)``:

- ``xs``: the query, key and value, then the block mask's key/value-side tensors that are given
  (``kv_num_blocks``, ``kv_indices``, ``full_kv_num_blocks``, ``full_kv_indices``), then the
  score function's and the mask function's captured tensors;
- ``spec``: JSON of everything else: sequence lengths and block sizes, scale, grouped-query
  attention, kernel options, which block-mask tensors are given, how many captured tensors
  each function takes, and the Python source of both functions (each GraphModule's code, so a
  generated program cached on disk carries them: no trace is needed to run it).

Its implementation rebuilds the ``BlockMask`` (``BlockMask.from_kv_blocks``, which recomputes
the query-side tensors) and calls ``flex_attention``; it returns the output and the
log-sum-exp. Its backward is the vector-Jacobian product of that call (recomputing the forward).
On a CPU torch refuses flex_attention with inputs that need a gradient; its dense implementation
(what it runs in eager mode on any device) trains there, so cube calls it with that check off.

The block mask is most often built in forward (``create_block_mask(causal, ...)``): export
records that as functorch ``vmap`` calls over the mask function, which are no ATen ops.
``fold_masks`` evaluates those calls (and what they read) once while tracing, where they depend
on no input of the model: the block mask becomes constants of the graph. A block mask built
from the batch (document masks over per-token positions, as torchtitan's) is refused with the
reason.

The partition rule (``cube.trace.rules.flex_attention``): the batch and the heads split as for
scaled dot-product attention, where neither function reads the batch or head index (an index
into a captured tensor would then mean another row on a piece) and the block mask has that dim
of size one or the queries'; queries and keys stay whole (a block mask is per block of queries).
"""
from __future__ import annotations

import functools
import json
import math
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

try:   # torch 2.9+: the log-sum-exp is asked for with an AuxRequest (return_lse before)
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:
    _AuxRequest = None

_NAMESPACE = "cube_flex"
_lib = None
_KV = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def is_flex(target) -> bool:
    """Whether an exported node's target is the ``flex_attention`` higher-order op."""
    hop = getattr(getattr(torch.ops, "higher_order", None), "flex_attention", None)
    return hop is not None and target is hop


# ----------------------------------------------------------------------------- torch's device check
_check_lock = threading.Lock()
_check_off = 0


@contextmanager
def device_check_off() -> Iterator[None]:
    """torch's ``flex_attention`` without its device check (which refuses CPU tensors that need a
    gradient, and meta tensors): tracing needs only shapes, and the dense implementation torch runs
    in eager mode computes and differentiates on any device."""
    global _check_off
    try:
        import torch.nn.attention.flex_attention as fa
    except ImportError:   # a torch without flex_attention: nothing to switch off
        yield
        return
    with _check_lock:
        if _check_off == 0:
            fa._cube_validate_device = fa._validate_device
            fa._validate_device = lambda *args, **kwargs: None
        _check_off += 1
    try:
        yield
    finally:
        with _check_lock:
            _check_off -= 1
            if _check_off == 0:
                fa._validate_device = fa._cube_validate_device


# ----------------------------------------------------------------------------- the op
def _library():
    global _lib
    if _lib is None:
        _lib = torch.library.Library(_NAMESPACE, "FRAGMENT")
        _lib.define("flex_attention(Tensor[] xs, str spec) -> (Tensor, Tensor)")
        qualname = f"{_NAMESPACE}::flex_attention"
        torch.library.impl(qualname, "CompositeExplicitAutograd", lib=_lib)(_impl)
        torch.library.register_fake(qualname, lib=_lib)(_fake)
        torch.library.register_autograd(qualname, _backward, setup_context=_setup_context, lib=_lib)
    return getattr(torch.ops, _NAMESPACE).flex_attention.default


def op():
    """The ``cube_flex::flex_attention`` op (defined on first use)."""
    return _library()


@functools.lru_cache(maxsize=None)
def _function(source: str):
    """The function a GraphModule's code defines (``def forward(self, ...)``), with ``self`` bound to None."""
    scope: Dict[str, Any] = {"torch": torch, "inf": math.inf, "nan": math.nan, "device": torch.device}
    exec(compile(source, "<cube flex_attention function>", "exec"), scope)   # noqa: S102 - cube's own code
    fn = scope["forward"]
    return functools.partial(fn, None)


def _attend(xs: Sequence[torch.Tensor], spec: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    q, k, v = xs[:3]
    i = 3
    kv = {}
    for name in _KV:
        if name in spec["given"]:
            kv[name] = xs[i]
            i += 1
        else:
            kv[name] = None
    score_bufs = list(xs[i:i + spec["score_buffers"]])
    mask_bufs = list(xs[i + spec["score_buffers"]:])
    score_fn = _function(spec["score"]) if spec["score"] else None
    mask_fn = _function(spec["mask"]) if spec["mask"] else None
    block_mask = None
    if kv["kv_num_blocks"] is not None:
        mask = (lambda b, h, qi, ki: mask_fn(b, h, qi, ki, *mask_bufs)) if mask_fn is not None else None
        block_mask = BlockMask.from_kv_blocks(kv["kv_num_blocks"], kv["kv_indices"], kv["full_kv_num_blocks"],
                                              kv["full_kv_indices"], tuple(spec["block_size"]), mask,
                                              tuple(spec["seq_lengths"]))
    score = (lambda s, b, h, qi, ki: score_fn(s, b, h, qi, ki, *score_bufs)) if score_fn is not None else None
    options = dict(score_mod=score, block_mask=block_mask, scale=spec["scale"], enable_gqa=spec["gqa"],
                   kernel_options=spec["kernel_options"] or None)
    # on a GPU the fused kernels: flex_attention compiled (eager runs the dense implementation)
    attend = _compiled() if q.is_cuda else flex_attention
    with device_check_off():
        if _AuxRequest is not None:
            out, aux = attend(q, k, v, **options, return_aux=_AuxRequest(lse=True))
            return out, aux.lse
        return attend(q, k, v, **options, return_lse=True)


@functools.lru_cache(maxsize=None)
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _impl(xs: List[torch.Tensor], spec: str) -> Tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out, lse = _attend(xs, json.loads(spec))
    return out.contiguous(), lse.contiguous()


def _fake(xs: List[torch.Tensor], spec: str):
    q, v = xs[0], xs[2]
    out = q.new_empty(tuple(q.shape[:-1]) + (v.shape[-1],))
    return out, q.new_empty(tuple(q.shape[:-1]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    xs, spec = inputs
    ctx.spec = spec
    ctx.save_for_backward(*xs)


def _backward(ctx, grad_out, grad_lse):
    xs = [x.detach().requires_grad_(x.is_floating_point()) for x in ctx.saved_tensors]
    with torch.enable_grad():
        out, lse = _attend(xs, json.loads(ctx.spec))
        outs, grads = [out], [grad_out]
        if grad_lse is not None:
            outs.append(lse)
            grads.append(grad_lse)
        wrt = [x for x in xs if x.requires_grad]
        got = iter(torch.autograd.grad(outs, wrt, grads, allow_unused=True))
    return [next(got) if x.requires_grad else None for x in xs], None


# ----------------------------------------------------------------------------- from the exported node
class FlexRefused(ValueError):
    """A ``flex_attention`` call cube cannot run as one op (the message says why)."""


def _code(gm) -> Optional[str]:
    if gm is None:
        return None
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        raise FlexRefused("its score or mask function reads a tensor of its own (a get_attr); pass tensors "
                          "it captures from forward instead")
    return gm.code


def _uses_index(gm, position: int) -> bool:
    """Whether the function's placeholder ``position`` (the batch or head index) is read."""
    if gm is None:
        return False
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return position < len(holders) and bool(holders[position].users)


def split(node, graph_module) -> Tuple[list, dict]:
    """The exported ``flex_attention`` node as ``(fx nodes or values of xs, spec)``; the spec also says
    whether either function reads the batch or the head index (``batch_read``, ``heads_read``).

    Raises:
        FlexRefused: a form cube does not run (the message says which).
    """
    args = list(node.args)
    q, k, v, score_gm, block, scale, kernel_options = args[:7]
    score_bufs = list(args[7]) if len(args) > 7 else []
    mask_bufs = list(args[8]) if len(args) > 8 else []

    def module(x):
        return getattr(graph_module, x.target) if isinstance(x, torch.fx.Node) and x.op == "get_attr" else None

    score_gm = module(score_gm)
    block = list(block)
    mask_gm = module(block[-1]) if block else None
    xs = [q, k, v]
    given = []
    for name, item in zip(_KV, block[2:6]):
        if item is not None:
            xs.append(item)
            given.append(name)
    xs += score_bufs + mask_bufs
    spec = {
        "seq_lengths": [int(block[0]), int(block[1])], "block_size": [int(block[-3]), int(block[-2])],
        "scale": float(scale) if scale is not None else None,
        "gqa": q.meta["val"].shape[-3] != k.meta["val"].shape[-3],
        # what the call was given; flex_attention fills in the OUTPUT_* options itself from what it returns
        "kernel_options": {k_: v_ for k_, v_ in (kernel_options or {}).items()
                           if isinstance(v_, (bool, int, float, str)) and not k_.startswith("OUTPUT_")},
        "given": given, "score_buffers": len(score_bufs),
        "score": _code(score_gm), "mask": _code(mask_gm),
    }
    # for the rule: score function (score, b, h, q_idx, kv_idx, *buffers); mask function (b, h, q_idx, kv_idx, ...)
    spec["batch_read"] = _uses_index(score_gm, 1) or _uses_index(mask_gm, 0)
    spec["heads_read"] = _uses_index(score_gm, 2) or _uses_index(mask_gm, 1)
    return xs, spec


# ----------------------------------------------------------------------------- block masks built in forward
def _functorch(node) -> bool:
    return getattr(node.target, "__module__", "") == "torch._functorch.predispatch"


def fold_masks(ep) -> Dict[torch.fx.Node, Any]:
    """Values of the nodes that build the block masks of the ``flex_attention`` calls in forward
    (``create_block_mask``: functorch's ``vmap`` calls over the mask function and what they read),
    evaluated once here, where they read no input of the model.

    Returns:
        fx node -> its value, for every node of those computations: what the block-mask tensors are
        made from, and functorch's calls that only set up ``vmap`` (they have no users).

    Raises:
        FlexRefused: a block mask is built from an input of the model (the batch, a parameter).
    """
    nodes = list(ep.graph.nodes)
    roots = [x for n in nodes if n.op == "call_function" and is_flex(n.target) and len(n.args) > 4
             for x in n.args[4] if isinstance(x, torch.fx.Node) and x.op != "get_attr"]
    inside = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in inside:
            inside.add(n)
            todo.extend(n.all_input_nodes)
    # functorch's calls that set vmap up (no users), and what they read
    todo = [n for n in nodes if n.op == "call_function" and _functorch(n) and not n.users]
    while todo:
        n = todo.pop()
        if n not in inside:
            inside.add(n)
            todo.extend(n.all_input_nodes)
    reads = sorted(n.name for n in inside if n.op == "placeholder")
    if reads:
        raise FlexRefused(f"its block mask is built from inputs of the model ({', '.join(reads)}): cube folds a "
                          f"block mask built in forward into constants only where it depends on no input (a "
                          f"causal or sliding-window mask of fixed lengths). Build the mask from sizes alone, or "
                          f"wrap the attention in a function registered with cube.register_op")
    values: Dict[torch.fx.Node, Any] = {}

    def value(a):
        if isinstance(a, torch.fx.Node):
            return values[a]
        if isinstance(a, (list, tuple)):
            return type(a)(value(x) for x in a)
        if isinstance(a, dict):
            return {k: value(x) for k, x in a.items()}
        if isinstance(a, torch.device):
            return torch.device("cpu")   # a model on meta: the mask's values are computed on the CPU
        return a

    for n in nodes:
        if n not in inside:
            continue
        if n.op == "get_attr":
            values[n] = getattr(ep.graph_module, n.target)
        elif n.op == "call_function":
            values[n] = n.target(*value(n.args), **value(dict(n.kwargs)))
        else:
            raise FlexRefused(f"its block mask reads {n.op} {n.name}")
    return values
