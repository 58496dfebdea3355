"""Flattened rows given back their dims: a view merging leading dims around row-wise ops is removed.

Code written for 2-D matrix APIs merges the leading dims of a tensor into one, runs ops on
the rows, and restores the dims. ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``,
so ``nn.TransformerEncoderLayer``, ``nn.Transformer`` and torchvision's ViT) ends with::

    out = out.permute(2, 0, 1, 3).reshape(L * B, E)       # (L, B, H, D) -> (L*B, E)
    out = linear(out, out_proj.weight, out_proj.bias)
    out = out.view(L, B, E)

The batch ``B`` is the inner factor of ``L*B``: a block of samples is no contiguous block of
that dim, so no op between the two views carries a batch split. Data parallel gathers the
activations there and a pipeline cannot cut the batch into micro-batches.

This pass, run once on the traced graph before any policy, runs such ops on the unmerged
shape: with ``x`` of shape ``(*lead, *inner)`` merged to ``(N, C)`` (``N = prod(lead)``,
``C = prod(inner)``) and the result of the ops restored to ``(*lead, F)``, the ops run on
``(*lead, ...)``, the restoring view disappears, and the merging one merges only ``inner``
into ``C`` (``(L, B, H, D) -> (L, B, E)``), or disappears when ``inner`` is one dim already.

The values are the same: a row-major view makes row ``r`` of ``(N, C)`` the elements of ``x``
at the index of ``lead`` that ``r`` numbers, and each op of the chain computes a row of its
outputs from the same row of its inputs. The pass is exact or does nothing; a chain is
rewritten only when:

- every op reading a value of the chain (the merged tensor and what the chain makes from it)
  is in the chain, or is a view (``view``, ``reshape``, ``_unsafe_view``, ``unflatten``) restoring
  exactly ``(*lead, last dim)``, at most one per value; at least one such view ends the chain;
- every op in the chain is row-wise: ``linear``, ``matmul`` and ``mm`` of a chain value by a
  2-D weight from outside (``mm`` becomes ``matmul``, which takes N-D inputs), ``addmm`` of a 2-D
  weight (it becomes ``linear``, aten having no N-D ``addmm``: of the weight's transpose's input, or
  of its transpose, a ``t`` op, for an ``(in, out)`` weight such as Hugging Face's ``Conv1D``'s), ops
  with the elementwise rule whose operands from outside broadcast over the rows (every dim but
  the last of size 1), layer and RMS norm over the last dim, softmax and ``topk`` along the last
  dim, ``sum``/``mean``/``amax``/``amin`` along it keeping it (an MoE router's renormalized
  weights), a fused MoE layer (``moe_experts``, dropless: ``cube.ir.experts.unflatten``; the pass
  runs again after the fusion, ``cube.ir.experts._tokens_back``); views keeping a value's shape,
  and the same merge of the same tensor elsewhere, are the value itself;
- values of ``c`` rows per row (``(N * c, ...)``, or ``(N, c, ...)``: the (token, expert) pairs of
  Transformers' ``batched_mm`` experts) run as ``(*lead, c, ...)``: ``repeat_interleave`` of the
  rows along dim 0 (along a new dim after ``lead``), ``index`` of a weight from outside by the
  pairs' expert ids, ``bmm`` of two such values (as ``matmul``), ``unsqueeze``, ``squeeze``,
  ``chunk`` and reductions along dims past the rows (moved by the dims added in front),
  elementwise ops of values of one shape, and views between ``(N * c, ...)`` and ``(N, c, ...)``
  (the same tensor there); dim 0 is never an op's argument;
- ops along the dims past the rows of values whose dim 0 is the rows (an MoE router's, along the
  experts: ``cube.trace.along``, which says why each is exact): views and ``expand`` keeping
  dim 0 (DeepSeek-V3's ``(N, E) -> (N, G, E / G)`` groups), ``max``/``min``/``argmax``/``argmin`` and
  ``topk`` along such a dim, ``gather`` and ``scatter`` along it by an index of the same rows,
  ``cat`` along it, ``zeros_like`` and its kin; their dim arguments move by the dims added in front
  (a negative one stays);
- no op of the chain writes a tensor or draws random numbers (a draw follows the memory order,
  which the other shape may change), but a dropout of probability 0: it draws nothing (OPT's
  ``dropout(fc2(h))`` on its ``(B*T, E)`` rows, dropout off), and a draw already marked
  (``cube.passes.rng``) that ``exact_rng`` makes from its shape alone on a contiguous tensor of
  the whole batch: a row-major ``(N, C)`` draw and a ``(*lead, C)`` one are the same numbers
  (``cube.trace.along``). At trace time the draws are not marked, and a chain with a random op
  stays as it is: ``exact_rng`` finds the layout of a random op's input in the exported program,
  which a rewritten op is not in; a policy's graph (``cube.ir.experts._tokens_back``) has them.

A loss reads flattened rows the same way: language models end with
``cross_entropy(logits.view(-1, V).float(), labels.view(-1))``, the sequence the inner factor of
the rows. :func:`unflatten_loss` computes the same loss on ``(B, V, S)`` logits
(``cross_entropy(logits.float().permute(0, 2, 1), labels)``, computed on the class rows of each
piece without copying the permuted logits: ``cube.runtime.ops.cross_entropy_loss``), whose sequence
dim a context or sequence split keeps: no rank gathers the logits, the largest activation of the model. A mean
over ``(B, S)`` targets is the mean over the ``B * S`` rows (``ignore_index``, class weights and
label smoothing mean the same per element), and a sum is the sum; only the order of the
additions differs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir.experts import EXPERTS, unflatten as unflatten_experts, weights_of
from cube.ir.graph import IRGraph, makers as graph_makers, readers as graph_readers
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.trace import along, inplace, major
from cube.trace.major import Unsqueezed
from cube.trace.rules import Registry

aten = torch.ops.aten

_MERGES = {"view", "_unsafe_view", "reshape", "flatten"}
_RESTORES = {"view", "_unsafe_view", "reshape", "unflatten"}
_MATMULS = {"linear", "matmul", "mm"}
_NORMS = {"layer_norm", "native_layer_norm", "rms_norm"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_DROPOUTS = {"dropout", "native_dropout"}


_TOPK = {"topk"}
_REDUCTIONS = {"sum", "mean", "amax", "amin"}   # along the last dim, keepdim=True: one value a row
# ops on rows of (token, expert) pairs, ``(N * k, ...)`` run as ``(*lead, k, ...)`` (``_pair``)
_PAIRS = {"repeat_interleave", "index", "unsqueeze", "squeeze", "bmm", "chunk"}


@dataclass
class _Chain:
    """A merge, the row-wise ops after it (in graph order) and the views restoring their results."""
    merge: IRFwOperation
    lead: Tuple[int, ...]
    ops: List[IRFwOperation]
    restores: Dict[int, IRFwOperation]   # id of a chain value -> the view restoring it
    aliases: Dict[int, IRTensor]          # id of an op of ``ops`` making a value equal to this one
    entries: Dict[int, IRFwOperation] = None   # merges of other tensors into the same rows (``_back``)


def unflatten_rows(graph: IRGraph, registry: Registry) -> IRGraph:
    """The graph with every chain of row-wise ops between a merge of leading dims and views
    restoring them (module docstring) run on the unmerged dims.

    Returns:
        ``graph`` itself when nothing is rewritten, else a new graph of the same model.
    """
    while True:
        readers, makers = graph_readers(graph.ops), graph_makers(graph.ops)
        chains, used = [], set()
        order = {id(op): i for i, op in enumerate(graph.ops)}
        for op in graph.ops:
            if isinstance(op, IRFwOperation) and op.name in _MERGES and id(op) not in used:
                # with the same merge of the same tensor elsewhere (a layer viewing its input twice) or alone
                chain = _find(op, readers, makers, order, graph.loss, True) or \
                    _find(op, readers, makers, order, graph.loss, False)
                mine = {id(o) for o in [op, *chain.ops, *chain.restores.values()]} if chain else set()
                if chain is not None and not mine & used:   # a view both restoring one chain and merging
                    chains.append(chain)                      # another is rewritten in the next round
                    used |= mine
        if not chains:
            return graph
        replace: Dict[int, List[IRFwOperation]] = {}
        for chain in chains:
            replace.update(_rewrite(chain, makers, registry))
        graph = IRGraph([new for op in graph.ops for new in replace.get(id(op), [op])], graph.attrs,
                        graph.loss, graph.name)


def _merges(op: IRFwOperation) -> bool:
    return len(op.inputs) == 1 and len(op.outputs) == 1 and op.args[:1] == (op.inputs[0],)


def _find(merge: IRFwOperation, readers, makers, order, loss: IRTensor, siblings: bool) -> Optional[_Chain]:
    """The chain ``merge`` starts (module docstring), or None. With ``siblings``, the same merge
    of the same tensor elsewhere joins the chain as an alias of ``merge``'s result."""
    if not _merges(merge):
        return None
    x, u = merge.inputs[0], merge.outputs[0]
    if u.ndim < 2 or u is loss:
        return None
    rows = u.shape[:-1]
    # a merge of leading dims: more of x's dims than the rows' hold them, the rest the last dim (the
    # other way, a view splitting rows, merging them around the ops is as exact and loses a dim a split
    # could take); checked first, as the walk below may reach far
    if not any(math.prod(x.shape[:k]) == math.prod(rows) and math.prod(x.shape[k:]) == u.shape[-1]
               for k in range(len(rows) + 1, x.ndim + 1)):
        return None
    # every op a value of the chain reaches; restoring views end it; views keeping the shape are aliases
    inside, ops, restores, todo, aliases, entries, pending = {id(u)}, {}, {}, [u], {}, {}, []
    for op in readers.get(id(x), []) if siblings else ():
        if op is not merge and op.name in _MERGES and _merges(op) and op.outputs[0].shape == u.shape:
            ops[id(op)], aliases[id(op)] = op, u
            inside.add(id(op.outputs[0]))
            todo.append(op.outputs[0])
    if siblings and not aliases:
        return None
    while todo or pending:
        if not todo:
            t = pending.pop()
            if id(t) not in inside:   # else (not found) the op reading it is judged as before (``_row``)
                _back(t, u, merge, makers, ops, entries, inside, todo, loss)
            continue
        t = todo.pop()
        for op in readers.get(id(t), []):
            if id(op) in ops or op in restores.values():
                continue
            if op.name in _MERGES | _RESTORES and _merges(op) and (op.outputs[0].shape == t.shape or
                                                                   _same_rows(t, op.outputs[0], rows)):
                ops[id(op)], aliases[id(op)] = op, t
                inside.add(id(op.outputs[0]))
                todo.append(op.outputs[0])
                continue
            o = op.outputs[0] if len(op.outputs) == 1 else None
            # a view of a value made in the chain back to x's leading dims restores them, also where it reads
            # as (1, N, ...) (a batch of one); a view of the merge itself never does (Llama 4's copies)
            restoring = o is not None and t is not u and t.shape[:-1] == rows and o.ndim >= 2 and \
                o.shape[-1] == t.shape[-1] and tuple(o.shape[:-1]) == tuple(x.shape[:o.ndim - 1])
            if not restoring and major.view(op, t, rows):   # into, out of or between expert-major values
                ops[id(op)] = op
                inside.add(id(op.outputs[0]))
                todo.append(op.outputs[0])
                continue
            if op.name in _RESTORES and op.inputs == [t] and t is not u and len(op.outputs) == 1 and \
                    not along.reshapes_row(op, x, rows):
                if id(t) in restores:
                    return None
                restores[id(t)] = op
                continue
            if not isinstance(op, IRFwOperation) or not op.outputs or not _rowish(op):
                return None
            ops[id(op)] = op
            # rows of another tensor merged alike (a gate), when the walk has not reached them: the chain
            # starts there too (``_back``, once the walk is done)
            pending += [t_in for t_in in op.inputs if t_in.ndim == u.ndim and t_in.shape[:-1] == rows]
            for o in op.outputs:
                if o is loss or not (o.shape[:-1] == rows or _pair_rows(o, rows) or major.is_major(o, rows)):
                    return None
                inside.add(id(o))
                todo.append(o)
    if not restores:
        return None
    leads = {r.outputs[0].shape[:-1] for r in restores.values()}
    if len(leads) != 1:
        return None
    lead = leads.pop()
    k = len(lead)
    if k <= len(rows) or tuple(x.shape[:k]) != lead or math.prod(x.shape[k:]) != u.shape[-1]:
        return None
    if any(r.outputs[0].shape[-1] != r.inputs[0].shape[-1] for r in restores.values()):
        return None
    if any(tuple(m.inputs[0].shape[:k]) != lead or math.prod(m.inputs[0].shape[k:]) != u.shape[-1]
           for m in entries.values()):
        return None
    if any(_row(op, inside, rows, makers, lead) is None for op in ops.values()
           if id(op) not in aliases and id(op) not in entries):
        return None
    return _Chain(merge, lead, sorted(ops.values(), key=lambda op: order[id(op)]), restores, aliases, entries)


def _back(t: IRTensor, u: IRTensor, merge: IRFwOperation, makers, ops, entries, inside, todo,
          loss: IRTensor) -> bool:
    """Walks back from ``t``, a value of the chain's rows made outside it, through row-wise ops of one
    value of those rows to a merge of another tensor into the same rows (Qwen3-Next's gate ``z``,
    merged as its attention output is, then cast and activated) and adds them to the chain (``entries``:
    the merges); adds nothing and gives False when the walk meets anything else."""
    rows = u.shape[:-1]
    walked: List[Tuple[IRFwOperation, IRTensor]] = []
    while True:
        m = makers.get(id(t))
        if m is None or m is merge or not isinstance(m, IRFwOperation) or len(m.outputs) != 1 or t is loss:
            return False
        walked.append((m, t))
        if m.name in _MERGES and _merges(m) and t.shape == u.shape:
            entries[id(m)] = m
            for op, made in walked:
                ops[id(op)] = op
                inside.add(id(made))
                todo.append(made)
            return True
        if not _rowish(m) or op_info(m.name).rule != "elementwise":
            return False
        grown = [x for x in m.inputs if id(x) not in inside and x.ndim == u.ndim and x.shape[:-1] == rows]
        if len(grown) != 1:
            return False
        t = grown[0]


def _rowish(op: IRFwOperation) -> bool:
    """Whether ``op`` is of a kind ``_row`` may find row-wise (a first look, before the chain is known)."""
    name = op.name
    return name in _MATMULS or name in _NORMS or name in _SOFTMAX or name in _DROPOUTS or name == "addmm" or \
        name in _TOPK or name in _REDUCTIONS or name == EXPERTS or name in _PAIRS or name in major.OPS or \
        op_info(name).rule == "elementwise" or along.rowish(op)


def _pair_rows(t: IRTensor, rows: Tuple[int, ...]) -> bool:
    """Whether ``t`` holds ``c >= 1`` rows per row of a one-dim ``rows``: ``(N * c, ...)``."""
    return len(rows) == 1 and t.ndim >= 1 and t.shape[0] >= rows[0] and t.shape[0] % rows[0] == 0


def _nd(t: IRTensor, rows: Tuple[int, ...], lead: Tuple[int, ...]) -> Tuple[int, ...]:
    """The shape ``t``, a chain value, takes on the unmerged dims: ``(*lead, ...)`` for one row
    per row of ``rows``, ``(*lead, c, ...)`` for ``c`` (the pairs of a token and its ``c`` experts)."""
    if len(rows) != 1:   # rows of several dims: every chain value is ``rows + (last,)``
        return tuple(lead) + tuple(t.shape[-1:])
    if major.is_major(t, rows):   # (c, N, ...): the experts' copies of the rows (cube.trace.major)
        return major.nd(t, lead)
    c = t.shape[0] // rows[0]
    return tuple(lead) + ((c,) if c > 1 else ()) + tuple(t.shape[1:])


def _same_rows(a: IRTensor, b: IRTensor, rows: Tuple[int, ...]) -> bool:
    """Whether a view of ``a`` as ``b`` is the same tensor on the unmerged dims (``(N, k)`` and
    ``(N * k,)``; ``(N * k, H)`` and ``(N, k, H)``)."""
    return _pair_rows(a, rows) and _pair_rows(b, rows) and _nd(a, rows, ()) == _nd(b, rows, ())


def _last(dim, ndim: int) -> bool:
    """Whether ``dim`` (an int or a one-element list) names the last of ``ndim`` dims."""
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else None
    return dims is not None and len(dims) == 1 and isinstance(dims[0], int) and dims[0] % ndim == ndim - 1


def _over_rows(t: IRTensor, rows: Tuple[int, ...]) -> bool:
    """An operand from outside the chain that broadcasts over the rows: a scalar, a vector of
    the last dim, or a tensor whose other dims are all 1."""
    return t.ndim <= len(rows) + 1 and all(s == 1 for s in t.shape[:-1])


def _row(op: IRFwOperation, inside, rows, makers, lead) -> Optional[Tuple[Any, str, tuple, dict]]:
    """``(target, name, args, kwargs)`` of ``op`` when it is row-wise (chain values still in its
    arguments), or None."""
    if major.involved(op, inside, rows):   # values of the rows behind a dim of experts (cube.trace.major)
        return major.row(op, inside, rows, lead, lambda t: _nd(t, rows, lead))
    if along.rowish(op) and len(rows) == 1:   # along dims past the rows, or a draw (cube.trace.along)
        return along.row(op, inside, rows, lambda t: _nd(t, rows, lead))
    if any(id(t) in inside and t.shape[:-1] != rows for t in op.inputs) or \
            any(t.shape[:-1] != rows for t in op.outputs):
        return _pair(op, inside, rows, lead)   # some value of (token, expert) pairs
    if op.name in _DROPOUTS and _draws_nothing(op, inside):
        return op.target, op.name, tuple(op.args), dict(op.kwargs)
    if op.name == EXPERTS:   # a dropless fused MoE layer reading chain rows only: on tokens of any dims
        weights = set(weights_of(op))
        tokens = [t for i, t in enumerate(op.inputs) if i not in weights]
        if op.kwargs.get("capacity") is not None or op.kwargs.get("lead", 1) != 1 or not tokens or \
                any(id(t) not in inside for t in tokens) or \
                any(op.inputs[i].kind is not TensorKind.PARAM for i in weights):
            return None
        return op.target, op.name, tuple(op.args), dict(op.kwargs)
    if inplace.effect(op):
        return None
    ins = [t for t in op.inputs if id(t) in inside]
    out = [t for t in op.inputs if id(t) not in inside]
    args, name = tuple(op.args), op.name
    first = args[0] if args else None
    only_first = len(ins) == 1 and first is ins[0] and sum(t is first for t in op.inputs) == 1
    if name in _PAIRS:
        return _pair(op, inside, rows, lead)
    if name in _MATMULS:
        w = args[1] if len(args) > 1 else None
        if not only_first or op.kwargs or not isinstance(w, IRTensor) or w.ndim != 2 or \
                any(t.ndim > 1 for t in out if t is not w):
            return None
        return (aten.matmul.default, "matmul", args, {}) if name == "mm" else (op.target, name, args, {})
    if name == "addmm":
        b, x, w = (list(args) + [None] * 3)[:3]
        wt = makers.get(id(w)) if isinstance(w, IRTensor) else None
        if len(ins) != 1 or x is not ins[0] or sum(t is x for t in op.inputs) != 1 or \
                any(op.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(op.kwargs) - {"beta", "alpha"} or \
                not isinstance(b, IRTensor) or b.ndim > 1 or not isinstance(w, IRTensor) or w.ndim != 2:
            return None
        if wt is not None and major.swaps(wt):
            return aten.linear.default, "linear", (x, wt.inputs[0], b), {}
        # a weight of shape (in, out) (Hugging Face's Conv1D: addmm(bias, x, weight)): linear of its transpose
        return aten.linear.default, "linear", (x, _Transposed(w), b), {}
    if name in _NORMS:
        shape = args[1] if len(args) > 1 else None
        if not only_first or not isinstance(shape, (list, tuple)) or len(shape) != 1 or any(t.ndim > 1 for t in out):
            return None
        return op.target, name, args, dict(op.kwargs)
    if name in _SOFTMAX:
        dim = args[1] if len(args) > 1 else op.kwargs.get("dim")
        if not only_first or not isinstance(dim, int) or dim % first.ndim != first.ndim - 1:
            return None
        kwargs = dict(op.kwargs, dim=-1) if "dim" in op.kwargs else dict(op.kwargs)
        return op.target, name, ((first, -1) + args[2:] if len(args) > 1 else args), kwargs
    if name in _TOPK:   # topk(x, k, dim=-1, largest, sorted): values and indices of each row
        dim = args[2] if len(args) > 2 else op.kwargs.get("dim", -1)
        if not only_first or not _last(dim, first.ndim):
            return None
        return op.target, name, (args[:2] + (-1,) + args[3:] if len(args) > 2 else args), \
            (dict(op.kwargs, dim=-1) if "dim" in op.kwargs else dict(op.kwargs))
    if name in _REDUCTIONS:   # sum(x, [-1], True): one value a row
        dim = args[1] if len(args) > 1 else op.kwargs.get("dim")
        keep = args[2] if len(args) > 2 else op.kwargs.get("keepdim", False)
        if not only_first or not _last(dim, first.ndim) or keep is not True:
            return None
        if len(args) > 1:
            return op.target, name, (first, [-1]) + args[2:], dict(op.kwargs)
        return op.target, name, args, dict(op.kwargs, dim=[-1])
    if op_info(name).rule == "elementwise" and ins:
        last = op.outputs[0].shape[-1]
        if all(t.shape[-1] in (1, last) for t in ins) and all(_over_rows(t, rows) for t in out):
            return op.target, name, args, dict(op.kwargs)
    return None


def _pair(op: IRFwOperation, inside, rows, lead) -> Optional[Tuple[Any, str, tuple, dict]]:
    """``_row`` of an op among values holding ``c`` rows per token (``_pair_rows``): Transformers'
    ``batched_mm`` experts copy each token's row for its ``k`` experts, gather each pair's expert
    weight and multiply pair by pair. On the unmerged dims a ``(N * k, ...)`` value is ``(*lead,
    k, ...)``: dims past the rows move by the dims added in front, and dim 0 is not touched."""
    if len(rows) != 1 or inplace.effect(op) or op.name == EXPERTS:
        return None
    n = rows[0]
    ins = [t for t in op.inputs if id(t) in inside]
    out = [t for t in op.inputs if id(t) not in inside]
    args, name = tuple(op.args), op.name
    first = args[0] if args else None
    if not ins or any(not _pair_rows(t, rows) for t in ins + list(op.outputs)):
        return None

    def moved(t: IRTensor, d) -> Optional[int]:   # dim ``d`` of ``t`` on the unmerged dims
        if not isinstance(d, int) or isinstance(d, bool) or not -t.ndim <= d < t.ndim or d % t.ndim == 0:
            return None
        return d if d < 0 else d + len(_nd(t, rows, lead)) - t.ndim
    if name == "repeat_interleave":   # a row per (token, expert): the token's row copied, along a new dim
        reps = args[1] if len(args) > 1 else None
        dim = args[2] if len(args) > 2 else op.kwargs.get("dim")
        if first is not ins[0] or len(op.inputs) != 1 or not isinstance(reps, int) or dim != 0 or \
                first.shape[0] != n or set(op.kwargs) - {"dim", "output_size"}:
            return None
        return op.target, name, (Unsqueezed(first, len(lead)), reps, len(lead)), {}
    if name == "index":   # a weight from outside indexed by a chain value: the pair's expert's weight
        idx = args[1] if len(args) > 1 else None
        if not isinstance(first, IRTensor) or id(first) in inside or not isinstance(idx, (list, tuple)) or \
                len(idx) != 1 or not isinstance(idx[0], IRTensor) or id(idx[0]) not in inside or \
                idx[0].dtype.is_floating_point or op.kwargs:
            return None
        return op.target, name, args, {}
    if name == "bmm":   # pair by pair: a batched matmul over every leading dim
        if len(ins) != 2 or out or op.kwargs or ins[0].shape[0] != ins[1].shape[0]:
            return None
        return aten.matmul.default, "matmul", args, {}
    if op_info(name).rule == "elementwise":
        return (op.target, name, args, dict(op.kwargs)) if _pair_elementwise(op, inside, rows) else None
    if len(op.inputs) != 1 or first is not ins[0]:
        return None
    if name in ("unsqueeze", "squeeze") and len(args) == 2 and not op.kwargs:
        dims = args[1]
        if isinstance(dims, (list, tuple)):
            new = [moved(first, d) for d in dims]
            return None if None in new else (op.target, name, (first, new), {})
        d = moved(op.outputs[0] if name == "unsqueeze" else first, dims)
        return None if d is None else (op.target, name, (first, d), {})
    if name == "chunk":
        dim = args[2] if len(args) > 2 else op.kwargs.get("dim", 0)
        d = moved(first, dim)
        return None if d is None or len(args) < 2 else (op.target, name, (first, args[1], d), {})
    if name in _REDUCTIONS:   # over dims past the rows (a token's k expert rows summed)
        dims = args[1] if len(args) > 1 else op.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else dims
        new = [moved(first, d) for d in dims] if isinstance(dims, (list, tuple)) and dims else [None]
        if None in new or len(args) > 3 or set(op.kwargs) - {"keepdim", "dtype"}:
            return None
        return op.target, name, (first, new) + args[2:], dict(op.kwargs)
    return None


def _pair_elementwise(op: IRFwOperation, inside, rows) -> bool:
    """An elementwise op of chain values of its output's shape, the others broadcasting over the rows."""
    o = op.outputs[0]
    return all(t.shape == o.shape or (t.ndim == o.ndim and t.shape[0] == o.shape[0] and
                                      all(a in (1, b) for a, b in zip(t.shape, o.shape)))
               for t in op.inputs if id(t) in inside) and \
        all(t.ndim < o.ndim and all(s == 1 for s in t.shape[:-1]) for t in op.inputs if id(t) not in inside)


@dataclass(frozen=True)
class _Transposed:
    """A 2-D weight the rewritten op reads transposed: ``_rewrite`` makes the ``t`` op."""
    weight: IRTensor


def _draws_nothing(op: IRFwOperation, inside) -> bool:
    """A dropout of a chain value that draws nothing (probability 0; module docstring)."""
    return len(op.inputs) == 1 and bool(op.args) and op.args[0] is op.inputs[0] and id(op.inputs[0]) in inside and \
        not inplace.draws(op.target, op.args, op.kwargs)


def _rewrite(chain: _Chain, makers, registry: Registry) -> Dict[int, List[IRFwOperation]]:
    """What replaces each op of ``chain`` (by op id): the merge of ``inner`` (or nothing), each
    op on the unmerged rows, and nothing for the restoring views."""
    merge, lead = chain.merge, chain.lead
    u = merge.outputs[0]
    new: Dict[int, IRTensor] = {}
    out: Dict[int, List[IRFwOperation]] = {id(r): [] for r in chain.restores.values()}
    _merge_inner(merge, lead, new, out, registry)
    inside = set(new) | {id(o) for op in chain.ops for o in op.outputs}
    for op in chain.ops:
        if id(op) in (chain.entries or {}):   # another tensor merged alike
            _merge_inner(op, lead, new, out, registry)
            continue
        if id(op) in chain.aliases:   # the same value: its readers read the one it equals
            new[id(op.outputs[0])], out[id(op)] = new[id(chain.aliases[id(op)])], []
            continue
        made = _row(op, inside, u.shape[:-1], makers, lead)
        if made is None:
            raise CubeInternalError(f"op {op.name!r} ({op.where()}) was found row-wise and is not any more")
        target, name, args, kwargs = made
        outs = []
        for o in op.outputs:
            r = chain.restores.get(id(o))
            o2 = r.outputs[0] if r is not None else \
                IRTensor(_nd(o, u.shape[:-1], lead), o.dtype, o.requires_grad, TensorKind.ACTIVATION, o.hint)
            new[id(o)] = o2
            outs.append(o2)
        made_ops = []
        for i, a in enumerate(args):
            if isinstance(a, _Transposed):
                w = a.weight
                wt = IRTensor(tuple(w.shape[::-1]), w.dtype, w.requires_grad, TensorKind.ACTIVATION, w.hint)
                made_ops.append(make_op(op, aten.t.default, "t", (w,), {}, [wt], registry))
                args = args[:i] + (wt,) + args[i + 1:]
        swap = lambda a: new.get(id(a), a) if isinstance(a, IRTensor) else a   # noqa: E731
        for i, a in enumerate(args):
            if isinstance(a, Unsqueezed):
                vu = swap(a.value)
                for _ in range(a.times):
                    v, shape = vu, vu.shape[:a.dim] + (1,) + vu.shape[a.dim:]
                    vu = IRTensor(shape, v.dtype, v.requires_grad, TensorKind.ACTIVATION, v.hint)
                    made_ops.append(make_op(op, aten.unsqueeze.default, "unsqueeze", (v, a.dim), {}, [vu], registry))
                args = args[:i] + (vu,) + args[i + 1:]
        if name == EXPERTS:
            weights = set(weights_of(op))
            out[id(op)] = [unflatten_experts(op, [swap(t) for i, t in enumerate(op.inputs) if i not in weights], outs)]
            continue
        out[id(op)] = made_ops + [make_op(op, target, name, map_leaves(args, swap), map_leaves(kwargs, swap), outs, registry)]
        along.redraw(op, out[id(op)][-1])   # a random op keeps its draw, in its new shape
    return out


def _merge_inner(merge: IRFwOperation, lead: Tuple[int, ...], new: Dict[int, IRTensor],
                 out: Dict[int, List[IRFwOperation]], registry: Registry) -> None:
    """``merge`` of ``x`` into rows, rewritten to merge only the dims past ``lead`` (nothing when they are
    one dim already): its result in ``new``, the op replacing it in ``out``."""
    x, u = merge.inputs[0], merge.outputs[0]
    if tuple(x.shape[len(lead):]) == u.shape[-1:]:
        new[id(u)], out[id(merge)] = x, []
        return
    target = aten.reshape.default if merge.name == "flatten" else merge.target
    u2 = IRTensor(lead + u.shape[-1:], u.dtype, u.requires_grad, TensorKind.ACTIVATION, u.hint)
    new[id(u)] = u2
    out[id(merge)] = [make_op(merge, target, target._schema.name.split("::")[-1], (x, list(u2.shape)), {}, [u2],
                              registry)]


def map_leaves(a, fn):
    """``a`` (an op's arguments: lists, tuples and dicts of values) with ``fn`` applied to each leaf."""
    if isinstance(a, (list, tuple)):
        return type(a)(map_leaves(x, fn) for x in a)
    if isinstance(a, dict):
        return {k: map_leaves(v, fn) for k, v in a.items()}
    return fn(a)


def _tensors(a):
    if isinstance(a, (list, tuple)):
        for x in a:
            yield from _tensors(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from _tensors(x)
    elif isinstance(a, IRTensor):
        yield a


def make_op(like: IRFwOperation, target, name: str, args, kwargs, outputs: List[IRTensor],
          registry: Registry) -> IRFwOperation:
    """An op made from ``like`` (its place in the model) calling ``target``; inputs in call order,
    as the builder lists them."""
    op = IRFwOperation(name=name, inputs=list(_tensors((args, kwargs))), outputs=outputs, target=target,
                       args=tuple(args), kwargs=dict(kwargs), module_path=like.module_path, source=like.source,
                       grad_enabled=like.grad_enabled, recompute=like.recompute)
    _check_shapes(op)
    registry.annotate(op)
    return op


def _check_shapes(op: IRFwOperation) -> None:
    """Runs ``op`` on meta tensors: a rewrite whose declared output shapes are not the op's (a
    broadcast it did not mean) is an internal error here, not a wrong shape at run time. A dim of
    1 the op makes where the rewrite declares more is a broadcast it means (``cube.trace.heads``
    gives a repeat back as its input, broadcast by the ops reading it). An op with no meta kernel is
    not checked."""
    if not isinstance(op.target, torch._ops.OpOverload):
        return
    meta = lambda a: torch.empty(a.shape, dtype=a.dtype, device="meta") if isinstance(a, IRTensor) else a  # noqa: E731
    try:
        got = op.target(*map_leaves(op.args, meta), **map_leaves(op.kwargs, meta))
    except Exception:   # noqa: BLE001 - no meta kernel for it: nothing to compare
        return
    got = [got] if isinstance(got, torch.Tensor) else [g for g in got if isinstance(g, torch.Tensor)] \
        if isinstance(got, (list, tuple)) else []
    if len(got) != len(op.outputs) or any(g.ndim != o.ndim or any(a not in (1, b) for a, b in zip(g.shape, o.shape))
                                          for g, o in zip(got, op.outputs)):
        declared = [tuple(o.shape) for o in op.outputs]
        raise CubeInternalError(f"op {op.name!r} ({op.where()}) rewritten to make {declared}, "
                                f"but it makes {[tuple(g.shape) for g in got]}")


_LOSSES = {"cross_entropy_loss"}
_COPIES = {"to", "_to_copy", "contiguous", "clone", "alias", "detach", "lift_fresh_copy"}   # same values, same dtype


def unflatten_loss(graph: IRGraph, registry: Registry) -> IRGraph:
    """The graph with each cross entropy of flattened rows (module docstring) computed on the
    unmerged dims: ``loss(E(x.view(N, C)), y.view(N))`` with ``x`` of shape ``(*lead, C)``, ``y`` of
    shape ``lead`` (two dims or more) and ``E`` unary elementwise ops (casts) becomes
    ``loss(E(x).permute(0, k, 1, ..., k - 1), y)``. A loss of reduction ``"none"`` (its output the
    rows), a merged value read by another op and anything else stay as they are.

    Returns:
        ``graph`` itself when nothing is rewritten, else a new graph of the same model.
    """
    readers, makers = graph_readers(graph.ops), graph_makers(graph.ops)
    replace: Dict[int, List[IRFwOperation]] = {}
    for op in graph.ops:
        if isinstance(op, IRFwOperation) and op.name in _LOSSES:
            found = _flat_loss(op, readers, makers)
            if found is not None:
                replace.update(_rewrite_loss(op, *found, registry))
    if not replace:
        return graph
    return IRGraph([new for op in graph.ops for new in replace.get(id(op), [op])], graph.attrs, graph.loss,
                   graph.name)


def _flat_loss(loss: IRFwOperation, readers, makers):
    """``(merge, casts, y)`` of a loss of flattened rows, or None."""
    args = loss.args
    if len(args) < 2 or not isinstance(args[0], IRTensor) or not isinstance(args[1], IRTensor):
        return None
    z, t = args[0], args[1]
    reduction = args[3] if len(args) > 3 else loss.kwargs.get("reduction", 1)
    if reduction == 0 or z.ndim != 2 or t.ndim != 1 or t.dtype.is_floating_point or \
            sum(a is z for a in loss.inputs) != 1:
        return None
    casts, cur = [], z
    while True:
        made = makers.get(id(cur))
        if made is None or not isinstance(made, IRFwOperation) or len(readers.get(id(cur), [])) != 1 or \
                len(made.outputs) != 1:
            return None
        if made.name in _MERGES:
            break
        if op_info(made.name).rule != "elementwise" or len(made.inputs) != 1 or not made.args or \
                made.args[0] is not made.inputs[0] or made.inputs[0].shape != cur.shape or inplace.effect(made) or \
                inplace.draws(made.target, made.args, made.kwargs):
            return None
        casts.insert(0, made)
        cur = made.inputs[0]
    merge = made
    x = merge.inputs[0] if len(merge.inputs) == 1 and merge.args[:1] == (merge.inputs[0],) else None
    if x is None or x.ndim < 3 or x.shape[-1] != z.shape[-1] or math.prod(x.shape[:-1]) != z.shape[0]:
        return None
    tm = makers.get(id(t))
    while tm is not None and tm.name in _COPIES and len(tm.inputs) == 1 and tm.args[:1] == (tm.inputs[0],) and \
            tm.inputs[0].dtype == t.dtype and tm.inputs[0].shape == t.shape:   # labels.to(logits.device)
        tm = makers.get(id(tm.inputs[0]))
    if tm is None or tm.name not in _MERGES or len(tm.inputs) != 1 or tm.args[:1] != (tm.inputs[0],) or \
            tuple(tm.inputs[0].shape) != tuple(x.shape[:-1]):
        return None
    return merge, casts, tm.inputs[0]


def _rewrite_loss(loss: IRFwOperation, merge: IRFwOperation, casts: List[IRFwOperation], y: IRTensor,
                  registry: Registry) -> Dict[int, List[IRFwOperation]]:
    """What replaces the merge, the casts and the loss (by op id)."""
    x = merge.inputs[0]
    out: Dict[int, List[IRFwOperation]] = {id(merge): []}
    cur = x
    for op in casts:
        o = op.outputs[0]
        o2 = IRTensor(tuple(x.shape), o.dtype, o.requires_grad, TensorKind.ACTIVATION, o.hint)
        out[id(op)] = [make_op(op, op.target, op.name, (cur,) + tuple(op.args[1:]), dict(op.kwargs), [o2], registry)]
        cur = o2
    k = x.ndim - 1
    order = [0, k] + list(range(1, k))
    moved = IRTensor(tuple(cur.shape[d] for d in order), cur.dtype, cur.requires_grad, TensorKind.ACTIVATION,
                     cur.hint)
    permute = make_op(loss, aten.permute.default, "permute", (cur, order), {}, [moved], registry)
    z, t = loss.args[0], loss.args[1]
    swap = lambda a: moved if a is z else y if a is t else a   # noqa: E731
    from cube.runtime.ops import cross_entropy_loss   # aten's, on class rows: no copy of the permuted logits
    new = make_op(loss, cross_entropy_loss, loss.name, map_leaves(tuple(loss.args), swap), map_leaves(dict(loss.kwargs), swap),
                list(loss.outputs), registry)
    out[id(loss)] = [permute, new]
    return out
