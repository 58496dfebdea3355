"""Merged heads given back their dims: batched matmuls on ``(B*H, ...)`` run on ``(B, H, ...)``.

Attention written for ``torch.bmm`` merges the batch and the heads into one dim. BLOOM's eager
attention (XGLM's and DeBERTa-v2's alike) reads::

    q, k, v = (t.reshape(B * H, S, D) for t in (q, k, v))                # from (B, H, S, D)
    scores = alibi.baddbmm(q, k.transpose(-1, -2), beta=1.0, alpha=1 / math.sqrt(D))
    probs = softmax(scores.view(B, H, S, S) + mask, dim=-1)
    out = torch.bmm(probs.view(B * H, S, S), v).view(B, H, S, D)

with ``alibi`` of shape ``(B * H, 1, S)`` made by ``alibi.repeat(B, 1, 1)`` of an ``(H, 1, S)``
tensor. The heads are the inner factor of ``B * H``: a block of heads is no contiguous block of
that dim, so a tensor parallel split of the heads stops at the merge, and so does a context
parallel split of the sequence, which no rule carries through ``bmm``'s merged dim.

This pass, run once on the traced graph before any policy, runs such ops on the unmerged dims:
a *chain* is the ops reading or making values of ``N = prod(lead)`` rows merged from
``(*lead, ...)`` (``lead`` two dims or more), from the views merging them to the views restoring
``(*lead, ...)``. Each op runs on ``(*lead, ...)`` instead:

- ``bmm(a, b)`` becomes ``matmul(a, b)``, and ``baddbmm(c, a, b, beta=, alpha=)`` becomes
  ``add(c * beta, matmul(a, b), alpha=alpha)`` (``c`` alone for ``beta == 1``, left out for
  ``beta == 0`` as ``baddbmm`` ignores it then);
- ``transpose``, ``permute``, ``softmax``/``log_softmax``, ``gather`` (of an index with the rows:
  DeBERTa-v2's relative positions) and views keeping the rows take their dims moved by the dims
  added in front (dim 0, the rows, is never an argument);
- ops with the elementwise rule (casts, scaling, masks) and dropouts run as they are, their
  operands from outside broadcasting over the rows (fewer dims, or a first dim of 1); a dropout
  that draws (XGLM's and BLOOM's on the attention probabilities, as shipped) draws its mask on the
  contiguous ``(*lead, ...)`` tensor in the same memory order as on ``(N, ...)``: the same numbers
  at the same elements, which ``exact_rng`` reproduces (``cube.passes.rng._layouts`` takes the
  exported program's ``(N, ...)`` input as this shape's);
- a merged value made by ``repeat(x, (r, 1, ...))`` of ``x`` of shape ``(prod(lead[j:]), ...)``
  with ``r = prod(lead[:j])`` (BLOOM's alibi, DeBERTa-v2's relative position projections), and
  casts of it, is ``x`` viewed as ``(1, ..., 1, *lead[j:], ...)``, broadcast over ``lead[:j]``: the
  repeat goes; one made by ``expand(x, (N, ...))`` of ``x`` with a dim 0 of 1 (a gather's index)
  is ``expand(x, (*lead, ...))``;
- the merging views become views of the inner dims only (or disappear), and the restoring
  views disappear (or view the inner dims only).

The values are the model's: a row-major view makes row ``r`` of ``(N, ...)`` the elements at the
index of ``lead`` that ``r`` numbers, ``matmul`` of N-D tensors is ``bmm`` over the leading dims,
and each other op of the chain computes a row of its outputs from the same row of its inputs.
Row ``b * H + h`` of a repeat of ``x`` is ``x[h]``, which is what the broadcast reads, and
every row of an expand of ``x`` is ``x[0]``. Only the
scaling of ``baddbmm`` is computed as separate ops (float round-off). The pass is exact or does
nothing; a chain is rewritten only when every op reading one of its values is in it or is a view
restoring ``(*lead, ...)`` (one per value, one at least), every op making a merged value it reads
is in it (a merge, a repeat, or a chain op), and no op of it writes a tensor or draws random
numbers, but a dropout. The rules then
split the N-D ops by batch, heads and sequence like any eager attention written with ``matmul``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph, makers as graph_makers, readers as graph_readers
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.trace import inplace
from cube.trace.rows import make_op, map_leaves   # the rewritten ops, made as rows.py makes them
from cube.trace.rules import Registry

aten = torch.ops.aten

_MERGES = {"view", "_unsafe_view", "reshape", "flatten"}
_RESTORES = {"view", "_unsafe_view", "reshape", "unflatten"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_DROPOUTS = {"dropout", "native_dropout"}
_BATCHED = {"bmm", "baddbmm", "transpose", "permute"} | _SOFTMAX | _DROPOUTS


@dataclass
class _Chain:
    """The ops of one chain (module docstring), by op id; ``restores`` by the id of the value restored,
    ``sources`` (a repeat and the casts after it) by the id of the merged value they make."""
    n: int
    merges: Dict[int, IRFwOperation] = field(default_factory=dict)
    ops: Dict[int, IRFwOperation] = field(default_factory=dict)
    restores: Dict[int, IRFwOperation] = field(default_factory=dict)
    sources: Dict[int, Tuple[IRFwOperation, List[IRFwOperation]]] = field(default_factory=dict)
    lead: Tuple[int, ...] = ()


def unmerge_heads(graph: IRGraph, registry: Registry) -> IRGraph:
    """The graph with every chain of batched ops on merged leading dims (module docstring) run on
    the unmerged dims.

    Returns:
        ``graph`` itself when nothing is rewritten, else a new graph of the same model.
    """
    for _ in range(len(graph.ops)):   # a view restoring one chain may merge for another: found again
        readers, makers = graph_readers(graph.ops), graph_makers(graph.ops)
        order = {id(op): i for i, op in enumerate(graph.ops)}
        chains, used = [], set()
        for op in graph.ops:
            if isinstance(op, IRFwOperation) and id(op) not in used and _merge_leads(op):
                chain = _find(op, readers, makers, graph.loss)
                mine = {id(o) for part in (chain.merges, chain.ops) for o in part.values()} | \
                    {id(r) for r in chain.restores.values()} if chain else set()
                if chain is not None and not mine & used:
                    chains.append(chain)
                    used |= mine
        if not chains:
            return graph
        replace: Dict[int, List[IRFwOperation]] = {}
        for chain in chains:
            replace.update(_rewrite(chain, order, registry))
        ops = [new for op in graph.ops for new in replace.get(id(op), [op])]
        graph = IRGraph(_without_unread_copies(ops, chains), graph.attrs, graph.loss, graph.name)
    raise CubeInternalError("unmerge_heads: the rewrite of merged heads does not end")


def _without_unread_copies(ops: List[IRFwOperation], chains: List[_Chain]) -> List[IRFwOperation]:
    """``ops`` without the copies of rows (and their casts) the chains read that no op reads any more:
    the tensor they copied may be merged heads of its own, whose chain they would end."""
    count: Dict[int, int] = {}
    for op in ops:
        for t in {id(t) for t in op.inputs}:
            count[t] = count.get(t, 0) + 1
    dropped: Set[int] = set()
    for copy, casts in {id(s[0]): s for chain in chains for s in chain.sources.values()}.values():
        for op in [*casts[::-1], copy]:
            if any(count.get(id(t), 0) for t in op.outputs) or inplace.effect(op):
                break
            dropped.add(id(op))
            for t in {id(t) for t in op.inputs}:
                count[t] -= 1
    return [op for op in ops if id(op) not in dropped]


def _leads(big: Tuple[int, ...], rows: Tuple[int, ...]) -> Set[Tuple[int, ...]]:
    """The ways ``big`` is ``rows`` with its dim 0 unmerged: prefixes of two dims or more whose
    product is ``rows[0]``, the other dims holding as many elements as ``rows[1:]``."""
    if not rows or not big or big[0] == rows[0] or rows[0] <= 1:
        return set()
    rest = math.prod(rows[1:])
    return {tuple(big[:k]) for k in range(2, len(big) + 1)
            if math.prod(big[:k]) == rows[0] and math.prod(big[k:]) == rest}


def _view_of(op: IRFwOperation, names) -> bool:
    """Whether ``op`` is a view of one tensor named in ``names`` changing its shape only (not its dtype)."""
    return op.name in names and len(op.inputs) == 1 and len(op.outputs) == 1 and op.args[:1] == (op.inputs[0],) \
        and op.outputs[0].dtype == op.inputs[0].dtype


def _merge_leads(op: IRFwOperation) -> Set[Tuple[int, ...]]:
    """The leads ``op`` merges when it is a view merging leading dims, else none."""
    if not _view_of(op, _MERGES):
        return set()
    return _leads(tuple(op.inputs[0].shape), tuple(op.outputs[0].shape))


def _restore_leads(op: IRFwOperation, t: IRTensor) -> Set[Tuple[int, ...]]:
    """The leads ``op`` restores when it is a view of ``t`` unmerging its dim 0, else none."""
    if not _view_of(op, _RESTORES) or op.inputs[0] is not t:
        return set()
    return _leads(tuple(op.outputs[0].shape), tuple(t.shape))


def _unary(op: IRFwOperation) -> bool:
    """An elementwise op of one tensor keeping its shape (a cast) that draws and writes nothing."""
    return op_info(op.name).rule == "elementwise" and len(op.inputs) == 1 and len(op.outputs) == 1 and \
        op.args[:1] == (op.inputs[0],) and op.outputs[0].shape == op.inputs[0].shape and not inplace.effect(op)


def _copied(t: IRTensor, makers, n: int) -> Optional[Tuple[IRFwOperation, List[IRFwOperation]]]:
    """``(op, casts)`` when ``t`` is casts of ``n`` rows copied from a tensor without them:
    ``repeat(x, (r, 1, ...))`` or ``expand(x, (n, ...))`` of ``x`` with a dim 0 of 1, else None."""
    casts: List[IRFwOperation] = []
    m = makers.get(id(t))
    while isinstance(m, IRFwOperation) and _unary(m):
        casts.insert(0, m)
        m = makers.get(id(m.inputs[0]))
    if not isinstance(m, IRFwOperation) or m.name not in ("repeat", "expand") or len(m.inputs) != 1 or \
            set(m.kwargs) - {"implicit"} or len(m.args) != 2 or m.args[0] is not m.inputs[0]:
        return None
    x, sizes = m.inputs[0], m.args[1]
    if not isinstance(sizes, (list, tuple)) or len(sizes) != x.ndim or x.ndim < 1 or \
            tuple(m.outputs[0].shape) != (n,) + tuple(x.shape[1:]):
        return None
    if m.name == "repeat" and any(r != 1 for r in sizes[1:]) or m.name == "expand" and x.shape[0] != 1:
        return None
    return m, casts


def _outside(t: IRTensor, like: IRTensor) -> bool:
    """Whether ``t``, not a chain value, broadcasts over the rows of ``like``: fewer dims, or a first dim of 1."""
    return t.ndim < like.ndim or (t.ndim == like.ndim and t.shape[0] == 1)


def _merged(op: IRFwOperation, n: int) -> Optional[List[IRTensor]]:
    """The inputs of ``op`` it reads as merged values when it is of a kind a chain holds (module
    docstring; its arguments are checked by ``_call`` once the lead is known), else None."""
    if not op.outputs or any(o.ndim < 1 or o.shape[0] != n for o in op.outputs):
        return None
    name, out = op.name, op.outputs[0]
    if name in _DROPOUTS:   # drawing or not: its mask is drawn in the same memory order (module docstring)
        if len(op.inputs) != 1:
            return None
    elif inplace.effect(op):
        return None
    if name in ("bmm", "baddbmm"):
        if len(op.args) != (2 if name == "bmm" else 3) or not all(isinstance(a, IRTensor) for a in op.args):
            return None
        *c, a, b = op.args
        if a.shape[0] != n or b.shape[0] != n or a.ndim != 3 or b.ndim != 3:
            return None
        if c and not _outside(c[0], out):
            return [c[0], a, b] if c[0].ndim == 3 and c[0].shape[0] == n else None
        return [a, b]
    if name == "gather":   # gather(t, dim, index): the index has the rows too
        index = op.args[2] if len(op.args) > 2 else op.kwargs.get("index")
        t = op.args[0] if op.args else None
        if not isinstance(t, IRTensor) or not isinstance(index, IRTensor) or t is index or \
                t.ndim != index.ndim or t.shape[0] != n or index.shape[0] != n:
            return None
        return [t, index]
    if name in _BATCHED or _view_of(op, _MERGES | _RESTORES):   # of one merged value
        return list(op.inputs) if len(op.inputs) == 1 and op.inputs[0].shape[0] == n else None
    if op_info(name).rule == "elementwise":
        merged = [t for t in op.inputs if not _outside(t, out)]
        if not merged or any(t.ndim != out.ndim or t.shape[0] != n for t in merged):
            return None
        return merged
    return None


def _find(seed: IRFwOperation, readers, makers, loss: IRTensor) -> Optional[_Chain]:
    """The chain ``seed``, a merge, starts (module docstring), or None."""
    n = seed.outputs[0].shape[0]
    chain = _Chain(n)
    values: Set[int] = set()
    todo: List[IRTensor] = []
    reads: Dict[int, Set[int]] = {}   # id of a chain op -> ids of the inputs it reads merged

    def value(t: IRTensor) -> bool:   # a merged value of the chain: its readers are visited
        if t is loss:
            return False
        if id(t) not in values:
            values.add(id(t))
            todo.append(t)
        return True

    def pull(t: IRTensor) -> bool:   # a merged input of a chain op: its maker joins the chain
        if id(t) in values or id(t) in chain.sources:
            return True
        m = makers.get(id(t))
        if not isinstance(m, IRFwOperation):
            return False
        if _merge_leads(m):
            chain.merges[id(m)] = m
            return value(t)
        source = _copied(t, makers, n)
        if source is not None:
            chain.sources[id(t)] = source
            return True
        return take(m)

    def take(op: IRFwOperation) -> bool:
        if id(op) in chain.ops:
            return True
        merged = _merged(op, n)
        if merged is None:
            return False
        chain.ops[id(op)] = op
        reads[id(op)] = {id(t) for t in merged}
        return all(value(o) for o in op.outputs) and all(pull(t) for t in merged)

    chain.merges[id(seed)] = seed
    value(seed.outputs[0])
    while todo:
        t = todo.pop()
        for op in readers.get(id(t), []):
            if id(op) in chain.ops or chain.restores.get(id(t)) is op:
                continue
            if _restore_leads(op, t) and op.outputs[0].shape[0] != n:
                if id(t) in chain.restores:
                    return None
                chain.restores[id(t)] = op
            elif not isinstance(op, IRFwOperation) or id(op) in chain.merges or not take(op):
                return None
    if not chain.restores or any(id(t) not in reads[id(op)] for op in chain.ops.values() for t in op.inputs
                                 if id(t) in values or id(t) in chain.sources):   # merged, read as a broadcast
        return None
    leads = set.intersection(*[_merge_leads(m) for m in chain.merges.values()],
                             *[_restore_leads(r, r.inputs[0]) for r in chain.restores.values()])
    if not leads:
        return None
    chain.lead = min(leads, key=len)
    k = len(chain.lead)
    if any(_split(chain.lead, src[0].inputs[0].shape[0]) is None for src in chain.sources.values()
           if src[0].name == "repeat") or \
            any(tuple(m.inputs[0].shape[:k]) != chain.lead for m in chain.merges.values()) or \
            any(_call(op, chain) is None for op in chain.ops.values() if op.name != "baddbmm") or \
            any(not _baddbmm_args(op) for op in chain.ops.values() if op.name == "baddbmm"):
        return None
    return chain


def _split(lead: Tuple[int, ...], h: int) -> Optional[int]:
    """``j`` such that ``h`` rows repeated ``prod(lead[:j])`` times are ``lead``, or None."""
    return next((j for j in range(len(lead) + 1) if math.prod(lead[j:]) == h), None)


def _baddbmm_args(op: IRFwOperation) -> bool:
    scale = (op.kwargs.get("beta", 1), op.kwargs.get("alpha", 1))
    return not set(op.kwargs) - {"beta", "alpha"} and all(isinstance(s, (int, float)) and not isinstance(s, bool)
                                                         for s in scale)


def _dim(d, ndim: int, shift: int) -> Optional[int]:
    """Dim ``d`` of a merged value of ``ndim`` dims on the unmerged dims; None for the rows or a non-dim."""
    if not isinstance(d, int) or isinstance(d, bool) or not -ndim <= d < ndim or d % ndim == 0:
        return None
    return d + shift if d >= 0 else d


def _call(op: IRFwOperation, chain: _Chain) -> Optional[Tuple[Any, str, tuple, dict]]:
    """``(target, name, args, kwargs)`` of ``op`` on the unmerged dims (chain values still in its
    arguments), or None when it cannot run there; ``baddbmm`` is made by ``_rewrite``."""
    name, args, kwargs = op.name, tuple(op.args), dict(op.kwargs)
    shift = len(chain.lead) - 1
    first = args[0] if args else None
    if name == "bmm":
        return (aten.matmul.default, "matmul", args, {}) if not kwargs else None
    if name == "transpose":
        if len(args) != 3 or kwargs:
            return None
        d0, d1 = (_dim(d, first.ndim, shift) for d in args[1:])
        return None if d0 is None or d1 is None else (op.target, name, (first, d0, d1), {})
    if name == "permute":
        dims = args[1] if len(args) == 2 else None
        if kwargs or not isinstance(dims, (list, tuple)) or len(dims) != first.ndim or \
                not isinstance(dims[0], int) or dims[0] % first.ndim != 0:
            return None
        moved = [_dim(d, first.ndim, shift) for d in dims[1:]]
        if None in moved:
            return None
        return op.target, name, (first, list(range(shift + 1)) + [d % first.ndim + shift for d in dims[1:]]), {}
    if name in _SOFTMAX:
        at = 1 if len(args) > 1 else None
        d = _dim(args[1] if at else kwargs.get("dim"), first.ndim, shift)
        if d is None:
            return None
        return (op.target, name, (first, d) + args[2:], kwargs) if at else (op.target, name, args, dict(kwargs, dim=d))
    if name in _DROPOUTS:
        return op.target, name, args, kwargs
    if name == "gather":
        d = _dim(args[1] if len(args) > 1 else kwargs.get("dim"), first.ndim, shift)
        if d is None or set(kwargs) - {"sparse_grad", "index"}:
            return None
        return (op.target, name, (first, d) + args[2:], kwargs) if len(args) > 1 else \
            (op.target, name, args, dict(kwargs, dim=d))
    if _view_of(op, _MERGES | _RESTORES):   # a view keeping the rows: of the same rows on the unmerged dims
        return aten.reshape.default, "reshape", (first, list(chain.lead) + list(op.outputs[0].shape[1:])), {}
    if op_info(name).rule == "elementwise":
        return op.target, name, args, kwargs
    return None


def _rewrite(chain: _Chain, order: Dict[int, int], registry: Registry) -> Dict[int, List[IRFwOperation]]:
    """What replaces each op of ``chain`` (by op id): the merges of the inner dims (or nothing),
    each op on the unmerged dims, and nothing (or views of the inner dims) for the restoring views."""
    lead = chain.lead
    new: Dict[int, IRTensor] = {}
    out: Dict[int, List[IRFwOperation]] = {}

    def like(t: IRTensor, shape) -> IRTensor:
        return IRTensor(tuple(shape), t.dtype, t.requires_grad, TensorKind.ACTIVATION, t.hint)

    def swap(a):
        return new.get(id(a), a) if isinstance(a, IRTensor) else a

    for merge in chain.merges.values():
        x, u = merge.inputs[0], merge.outputs[0]
        shape = lead + tuple(u.shape[1:])
        if tuple(x.shape) == shape:
            new[id(u)], out[id(merge)] = x, []
        else:
            new[id(u)] = like(u, shape)
            out[id(merge)] = [make_op(merge, aten.reshape.default, "reshape", (x, list(shape)), {}, [new[id(u)]],
                                    registry)]
    for t, r in chain.restores.items():   # a merge restored as it is: the restore views the new value
        if t in new:
            out[id(r)] = [make_op(r, aten.reshape.default, "reshape", (new[t], list(r.outputs[0].shape)), {},
                                [r.outputs[0]], registry)]
    for op in sorted(chain.ops.values(), key=lambda o: order[id(o)]):
        made: List[IRFwOperation] = []
        for t in op.inputs:
            if id(t) in chain.sources and id(t) not in new:
                new[id(t)] = _source(t, chain, made, like, registry)
        outs = []
        for o in op.outputs:
            r = chain.restores.get(id(o))
            shape = lead + tuple(o.shape[1:])
            o2 = r.outputs[0] if r is not None and tuple(r.outputs[0].shape) == shape else like(o, shape)
            if r is not None:
                out[id(r)] = [] if o2 is r.outputs[0] else \
                    [make_op(r, aten.reshape.default, "reshape", (o2, list(r.outputs[0].shape)), {}, [r.outputs[0]],
                           registry)]
            new[id(o)] = o2
            outs.append(o2)
        if op.name == "baddbmm":
            made += _baddbmm(op, [swap(a) for a in op.args], outs[0], like, registry)
        else:
            call = _call(op, chain)
            if call is None:
                raise CubeInternalError(f"op {op.name!r} ({op.where()}) was found to run on merged heads "
                                        f"and is not any more")
            target, name, args, kwargs = call
            made.append(make_op(op, target, name, map_leaves(args, swap), map_leaves(kwargs, swap), outs, registry))
        out[id(op)] = made
    return out


def _source(t: IRTensor, chain: _Chain, made: List[IRFwOperation], like, registry: Registry) -> IRTensor:
    """``t``, rows copied (and casts of them), on the unmerged dims: a repeated tensor viewed with
    dims of 1 for the lead dims it was repeated along, an expanded one expanded to the lead, and
    the casts again; their ops go to ``made``."""
    copy, casts = chain.sources[id(t)]
    x = copy.inputs[0]
    if copy.name == "expand":
        shape = chain.lead + tuple(x.shape[1:])
        cur = like(copy.outputs[0], shape)
        made.append(make_op(copy, aten.expand.default, "expand", (x, list(shape)), {}, [cur], registry))
    else:
        j = _split(chain.lead, x.shape[0])
        if j is None:
            raise CubeInternalError(f"op {copy.name!r} ({copy.where()}) no longer repeats merged heads")
        shape = (1,) * j + chain.lead[j:] + tuple(x.shape[1:])
        cur = like(copy.outputs[0], shape)
        made.append(make_op(copy, aten.reshape.default, "reshape", (x, list(shape)), {}, [cur], registry))
    for cast in casts:
        o = like(cast.outputs[0], shape)
        made.append(make_op(cast, cast.target, cast.name, (cur,) + tuple(cast.args[1:]), dict(cast.kwargs), [o],
                          registry))
        cur = o
    return cur


def _baddbmm(op: IRFwOperation, args: list, out: IRTensor, like, registry: Registry) -> List[IRFwOperation]:
    """``baddbmm(c, a, b, beta=, alpha=)`` on the unmerged dims: ``add(c * beta, matmul(a, b), alpha=)``."""
    c, a, b = args
    beta, alpha = op.kwargs.get("beta", 1), op.kwargs.get("alpha", 1)
    if beta == 0:   # baddbmm ignores c then (even NaN in it)
        if alpha == 1:
            return [make_op(op, aten.matmul.default, "matmul", (a, b), {}, [out], registry)]
        mm = like(out, out.shape)
        return [make_op(op, aten.matmul.default, "matmul", (a, b), {}, [mm], registry),
                make_op(op, aten.mul.Tensor, "mul", (mm, alpha), {}, [out], registry)]
    mm = like(out, out.shape)
    ops = [make_op(op, aten.matmul.default, "matmul", (a, b), {}, [mm], registry)]
    if beta != 1:
        cb = like(c, c.shape)
        ops.append(make_op(op, aten.mul.Tensor, "mul", (c, beta), {}, [cb], registry))
        c = cb
    ops.append(make_op(op, aten.add.Tensor, "add", (c, mm), {"alpha": alpha} if alpha != 1 else {}, [out], registry))
    return ops
