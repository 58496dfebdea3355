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
of size one or the queries'. Self-attention also splits the sequence (context parallel,
``cube.runtime.flex``): a piece keeps its block of queries and gathers the keys and values; the
spec then says where its queries start (``q_start``), and the op reads the block mask's rows for
them (``local_rows``) and calls both functions with global query indices.
"""
from __future__ import annotations

import copy
import functools
import json
import math
import threading
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir import query_blocks

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
        _lib.define("block_mask(Tensor[] bufs, str spec) -> Tensor[]")
        torch.library.impl(f"{_NAMESPACE}::block_mask", "CompositeExplicitAutograd", lib=_lib)(_make_mask)
        torch.library.register_fake(f"{_NAMESPACE}::block_mask", lib=_lib)(_mask_fake)
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
    start = spec.get("q_start")   # a block of the queries (context parallel): where it starts
    lengths = tuple(spec["seq_lengths"])
    if start is not None:
        lengths = (q.shape[-2], lengths[1])
        if kv["kv_num_blocks"] is not None:
            kv = local_rows(kv, spec["block_size"][0], start, start + q.shape[-2])
    at = start or 0   # the functions see global query indices
    block_mask = None
    if kv["kv_num_blocks"] is not None:
        mask = (lambda b, h, qi, ki: mask_fn(b, h, qi + at, ki, *mask_bufs)) if mask_fn is not None else None
        block_mask = BlockMask.from_kv_blocks(kv["kv_num_blocks"], kv["kv_indices"], kv["full_kv_num_blocks"],
                                              kv["full_kv_indices"], tuple(spec["block_size"]), mask, lengths)
    score = (lambda s, b, h, qi, ki: score_fn(s, b, h, qi + at, ki, *score_bufs)) if score_fn is not None else None
    options = dict(score_mod=score, block_mask=block_mask, scale=spec["scale"], enable_gqa=spec["gqa"],
                   kernel_options=spec["kernel_options"] or None)
    # on a GPU the fused kernels: flex_attention compiled (eager runs the dense implementation), where
    # inductor has them (head dims of 16 and more)
    attend = _compiled() if q.is_cuda and min(q.shape[-1], v.shape[-1]) >= 16 else flex_attention
    with device_check_off():
        if _AuxRequest is not None:
            out, aux = attend(q, k, v, **options, return_aux=_AuxRequest(lse=True))
            return out, aux.lse
        return attend(q, k, v, **options, return_lse=True)


def local_rows(kv: Dict[str, Optional[torch.Tensor]], q_block: int, start: int, stop: int
               ) -> Dict[str, Optional[torch.Tensor]]:
    """The rows of a block mask's key/value-side tensors (``(B, H, query blocks[, key blocks])``) for the
    queries ``[start, stop)``: those of the query blocks they cover (``cube.ir.query_blocks``).

    Raises:
        CubeInternalError: the queries are not whole query blocks nor a part of one (a plan refuses such
            a split: ``cube.ir.partition``).
    """
    first, last = query_blocks.rows(q_block, start, stop)
    if first < 0:
        raise CubeInternalError(f"flex_attention: queries [{start}, {stop}) do not map onto whole rows of a block "
                                f"mask with query blocks of {q_block}")
    return {name: None if t is None else t[:, :, first:last].contiguous() for name, t in kv.items()}


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


def _plain(gm):
    """A copy of a score or mask function's graph in ATen ops alone. Dynamo records an index into a
    captured tensor (``doc_ids[b, q_idx]``) as ``flat_apply(spec, ModIndex, ..., x, *indices)``, which is
    ``aten.index(x, indices)`` (``ModIndex.forward``)."""
    if gm is None:
        return None
    gm = copy.deepcopy(gm)
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or getattr(n.target, "__name__", str(n.target)).split(".")[-1] != "flat_apply":
            continue
        what = n.args[2] if len(n.args) > 2 else None   # the qualified name of what it applies
        if not (isinstance(what, str) and what.split(".")[-1] == "ModIndex") or len(n.args) < 5:
            raise FlexRefused(f"its score or mask function calls {what!r} through dynamo's flat_apply")
        x, *idx = n.args[3:]
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(torch.ops.aten.index.Tensor, (x, list(idx)))
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    gm.graph.eliminate_dead_code()
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        raise FlexRefused("its score or mask function reads a tensor of its own (a get_attr); pass tensors "
                          "it captures from forward instead")
    gm.recompile()
    return gm


_LIKE = frozenset("new_ones new_zeros new_full new_empty zeros_like ones_like empty_like full_like".split())


def _index_rows(gm, position: int, first_buffer: int) -> Optional[List[int]]:
    """How the function reads its placeholder ``position`` (the batch or head index): ``[]`` not at all,
    the captured tensors (numbered from 0) it only picks rows of (``x[b, ...]``: the index first), or None
    (another use: on a piece the index would number other rows of what it reads)."""
    if gm is None:
        return []
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if position >= len(holders):
        return []
    rows = []
    for u in holders[position].users:
        if getattr(u.target, "__name__", "").split(".")[0] in _LIKE and u.args[0] is holders[position]:
            continue   # reads its dtype alone (and_masks starts from b.new_ones(()))
        if u.target is not torch.ops.aten.index.Tensor or not isinstance(u.args[1], (list, tuple)) or \
                not u.args[1] or u.args[1][0] is not holders[position] or holders[position] in u.args[1][1:] or \
                u.args[0] not in holders[first_buffer:]:
            return None
        rows.append(holders.index(u.args[0]) - first_buffer)
    return sorted(set(rows))


def split(node, graph_module) -> Tuple[list, dict]:
    """The exported ``flex_attention`` node as ``(fx nodes or values of xs, spec)``. The spec also says
    how the functions read the batch index: ``batch_rows``, the captured tensors they pick the batch's
    rows of (they then split with the batch), or None (the batch stays whole); ``heads_read``.

    Raises:
        FlexRefused: a form cube does not run (the message says which).
    """
    args = list(node.args)
    q, k, v, score_gm, block, scale, kernel_options = args[:7]
    score_bufs = list(args[7]) if len(args) > 7 else []
    mask_bufs = list(args[8]) if len(args) > 8 else []

    def module(x):
        return getattr(graph_module, x.target) if isinstance(x, torch.fx.Node) and x.op == "get_attr" else None

    score_gm = _plain(module(score_gm))
    block = list(block)
    mask_gm = _plain(module(block[-1])) if block else None
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
        "score": score_gm.code if score_gm is not None else None,
        "mask": mask_gm.code if mask_gm is not None else None,
    }
    # score function (score, b, h, q_idx, kv_idx, *buffers); mask function (b, h, q_idx, kv_idx, *buffers)
    score_rows, mask_rows = _index_rows(score_gm, 1, 5), _index_rows(mask_gm, 0, 4)
    spec["batch_rows"] = None if score_rows is None or mask_rows is None else \
        score_rows + [len(score_bufs) + i for i in mask_rows]
    spec["heads_read"] = _index_rows(score_gm, 2, 5) != [] or _index_rows(mask_gm, 1, 4) != []
    return xs, spec


# ----------------------------------------------------------------------------- block masks built in forward
def _size_of(node) -> bool:
    return node.op == "call_function" and "sym_size" in str(node.target)


def _functorch(node) -> bool:
    return getattr(node.target, "__module__", "") == "torch._functorch.predispatch"


def _mask_spec(node, graph_module) -> dict:
    """What the block-mask op needs to build a ``flex_attention`` node's block mask from its mask function's
    captured tensors, as ``create_block_mask`` does."""
    block = list(node.args[4])
    mask_gm = _plain(getattr(graph_module, block[-1].target))
    kv = block[2].meta["val"]
    rows = _index_rows(mask_gm, 0, 4) or []
    bufs = [b.meta["val"] for b in (node.args[8] if len(node.args) > 8 else ())]
    # a mask per sample whose rows the function picks: as many as those tensors have (a micro-batch's, a
    # piece's), so the spec says nothing of the batch size; else the traced number (1: one for all)
    per_row = bool(rows) and int(kv.shape[0]) > 1 and all(bufs[i].shape[0] == kv.shape[0] for i in rows)
    return {"seq_lengths": [int(block[0]), int(block[1])], "block_size": [int(block[-3]), int(block[-2])],
            "batch": "rows" if per_row else int(kv.shape[0]), "heads": int(kv.shape[1]), "mask": mask_gm.code,
            "rows": rows}


class Masks:
    """How the block masks of a program's ``flex_attention`` calls are made (``masks``).

    Attributes:
        folded: fx node -> its value, for the nodes of block masks that read no input of the model
            (evaluated once while tracing: constants of the graph).
        made: the block-mask tensors (``kv_num_blocks``, ...) of masks built from the mask function's
            captured tensors -> (the captured tensors' fx nodes, the block-mask op's spec).
        skipped: the other nodes of those computations (made again by the block-mask op).
    """

    def __init__(self):
        self.folded: Dict[torch.fx.Node, Any] = {}
        self.made: Dict[Tuple[torch.fx.Node, ...], Tuple[list, dict]] = {}
        self.skipped: set = set()


def masks(ep) -> Masks:
    """The block masks of the ``flex_attention`` calls of ``ep`` built in forward (``create_block_mask``:
    functorch's ``vmap`` calls over the mask function, and what they read).

    A mask that reads no input of the model is evaluated here (``Masks.folded``). A mask that reads
    inputs only through the tensors its mask function captures (torchtitan's document masks over
    per-token positions) is made again at run time by the block-mask op (``block_mask_op``) from those
    tensors, exactly as ``create_block_mask`` made it: on a piece of the batch, from the piece's rows.

    Raises:
        FlexRefused: a block mask reads an input of the model otherwise.
    """
    out = Masks()
    nodes = list(ep.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    setup = [n for n in nodes if n.op == "call_function" and _functorch(n) and not n.users]
    calls = [n for n in nodes if n.op == "call_function" and is_flex(n.target) and len(n.args) > 4]
    done = set()
    for call in calls:
        tensors = tuple(x for x in list(call.args[4])[2:-3] if isinstance(x, torch.fx.Node))
        if not tensors or tensors in done:
            continue
        done.add(tensors)
        bufs = [b for b in (call.args[8] if len(call.args) > 8 else ()) if isinstance(b, torch.fx.Node)]
        region, todo = set(), list(tensors)
        while todo:
            n = todo.pop()
            if n in region or n in bufs:
                continue
            region.add(n)
            if not _size_of(n):   # a tensor's size (the batch's, traced dynamic) reads none of its values
                todo.extend(n.all_input_nodes)
        lo, hi = min(order[n] for n in region), max(order[n] for n in region)
        todo = [n for n in setup if lo <= order[n] <= hi]   # vmap's set-up (and indices nothing reads)
        while todo:
            n = todo.pop()
            if n not in region and n not in bufs:
                region.add(n)
                todo.extend(n.all_input_nodes)
        reads = sorted(n.name for n in region if n.op == "placeholder")
        if reads:
            raise FlexRefused(f"its block mask reads inputs of the model ({', '.join(reads)}) other than through "
                              f"the tensors its mask function captures: cube makes a block mask built in forward "
                              f"from sizes alone (a constant) or from what the mask function reads (made again "
                              f"on each piece). Build it with create_block_mask from such a function, or wrap the "
                              f"attention in a function registered with cube.register_op")
        fed = set()
        for n in nodes:   # the region's nodes that depend on the captured tensors (or on a size of the batch)
            if n in region and (_size_of(n) or any(a in bufs or a in fed for a in n.all_input_nodes)):
                fed.add(n)
        if not fed:
            out.folded.update(_evaluate(ep, [n for n in nodes if n in region]))
            continue
        grown = True
        while grown:   # what the computation made and nothing reads (an expand vmap's batching left): its own
            dead = {u for n in region for u in n.users if u not in region and u.op == "call_function"
                    and not u.users and not is_flex(u.target)}
            region |= dead
            grown = bool(dead)
        region = {n for n in region if not _size_of(n)}   # sizes the builder reads as numbers anyway
        outside = [n for n in region for u in n.users if u not in region and not is_flex(u.target)
                   and getattr(u.target, "__name__", "") != "_assert_tensor_metadata"
                   and "_assert_tensor_metadata" not in str(u.target)]
        if outside:
            raise FlexRefused(f"a value of its block mask's computation ({outside[0].name}) is also read by other "
                              f"ops of the model; cube makes the block mask again as one op")
        out.made[tensors] = (bufs, _mask_spec(call, ep.graph_module))
        out.skipped |= region
    return out


def _evaluate(ep, region: List[torch.fx.Node]) -> Dict[torch.fx.Node, Any]:
    """The values of ``region``'s nodes (in program order), on the CPU."""
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

    for n in region:
        if n.op == "get_attr":
            values[n] = getattr(ep.graph_module, n.target)
        elif n.op == "call_function":
            values[n] = n.target(*value(n.args), **value(dict(n.kwargs)))
        else:
            raise FlexRefused(f"its block mask reads {n.op} {n.name}")
    return values


# ----------------------------------------------------------------------------- the block-mask op
def _make_mask(bufs: List[torch.Tensor], spec: str) -> List[torch.Tensor]:
    from torch.nn.attention.flex_attention import create_block_mask
    spec = json.loads(spec)
    mask_fn = _function(spec["mask"])
    batch = bufs[spec["rows"][0]].shape[0] if spec["batch"] == "rows" else spec["batch"]   # a piece's rows
    with device_check_off():
        bm = create_block_mask(lambda b, h, qi, ki: mask_fn(b, h, qi, ki, *bufs), batch if batch > 1 else None,
                               spec["heads"] if spec["heads"] > 1 else None, *spec["seq_lengths"],
                               device=bufs[0].device, BLOCK_SIZE=tuple(spec["block_size"]))
    return [bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices]


def _mask_fake(bufs: List[torch.Tensor], spec: str):
    spec = json.loads(spec)
    b = bufs[spec["rows"][0]].shape[0] if spec["batch"] == "rows" else spec["batch"]
    qb = -(-spec["seq_lengths"][0] // spec["block_size"][0])
    kb = -(-spec["seq_lengths"][1] // spec["block_size"][1])
    like = bufs[0]
    shapes = [(b, spec["heads"], qb), (b, spec["heads"], qb, kb)] * 2
    return [like.new_empty(s, dtype=torch.int32) for s in shapes]


def block_mask_op():
    """``cube_flex::block_mask(Tensor[] bufs, str spec) -> Tensor[]``: a block mask's key/value-side tensors
    made with ``create_block_mask`` from the mask function (in ``spec``) over its captured tensors."""
    _library()
    return getattr(torch.ops, _NAMESPACE).block_mask.default
