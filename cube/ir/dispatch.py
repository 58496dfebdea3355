"""Token-local dispatch regions: an MoE kernel that sorts the tokens of the batch by expert.

Hugging Face's default experts kernel (``grouped_mm``) flattens the (token, expert) pairs of the
whole batch, sorts them by expert id (``torch.sort``), gathers each pair's token row
(``hidden[perm // k]``), computes every expert's rows as one group of a grouped matmul whose
group offsets count the sorted ids (``histc`` then ``cumsum``), weights them, and puts the pairs
back in their order (``inv[perm] = arange(S)``, ``out = rows[inv]``). No op of it can be split
along the batch: the sort orders the tokens of the whole batch. But the region as a whole is
token-local: each pair's output row depends only on its own token's row, expert id and weight, so
running it on a micro-batch (or any contiguous block of the batch) gives exactly that block's rows
of the result on the whole batch.

``Dispatch(graph)(sort, tracked)`` proves that structurally, for a ``sort``/``argsort`` of a 1-d
tensor whose dim 0 carries the batch (``tracked``: tensor id -> its batch dim, as
``cube.ir.follow`` follows it), by giving every tensor computed from what the sort makes a kind:

- ``rows``: a row per pair in sorted order, each a function of that pair alone (the sorted ids,
  ``x[perm // c]`` of a token tensor ``x`` with ``M / c`` rows, where ``M`` is the number of pairs;
  what row-wise ops make of rows);
- ``perm`` (``c``): the sort's indices (over ``c``): usable only as indices, their values are
  positions in the whole batch;
- ``counts``, ``offsets``: ``histc`` of the ascending sorted ids (proved in range: indices of a
  ``topk``, of a ``max`` along a dim or of an ``argmax``) and its ``cumsum``: the group offsets
  consistent with the sort, usable only by a grouped matmul of rows of the same sort
  (``_grouped_mm``, ``transformers::grouped_mm_fallback``), which is then row-wise: row ``j`` times
  the weight of its own id's group;
- ``inv``: the inverse permutation (``index_put`` of ``arange(M)`` at ``perm`` into a fresh
  tensor, ``argsort(perm)``), usable only to index rows: ``rows[inv]`` returns to the batch order.

Row-wise ops are those whose rule carries the rows' dim 0 to dim 0 of every output, as the same
unmarked letter and at the same size, with every other input independent of the batch (a weight):
elementwise ops, linears, activations, the gate split; no random op. The region ends where rows
return to the batch order (``rows[inv]``, ``index_put``/``index_add`` of rows at ``perm // c``);
those outputs carry the batch along dim 0, like the sort's input. Any other use of what the region
makes (a count in an auxiliary loss, sorted rows read without restoring their order, a cumsum over
them, a capacity cut ``rows[:capacity]``) is not proved: the sort stays refused, with that op named.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

import torch

from cube.ir.graph import IRGraph
from cube.ir.ops import BUILTIN, op_info
from cube.ir.operator import IRDataOperation, IRFwOperation
from cube.ir.tensor import IRTensor

_SORTS = frozenset("sort argsort".split())
_GROUPED_MM = frozenset("_grouped_mm grouped_mm_fallback".split())
# ops whose output holds their input's values (what a kind survives); casts are checked exact
_SAME = frozenset("to _to_copy contiguous clone alias detach lift_fresh_copy".split())
_RESHAPES = frozenset("view reshape _unsafe_view flatten".split())
_LIKE = frozenset("empty_like zeros_like ones_like full_like new_empty new_zeros new_ones new_full".split())
_ZERO = frozenset("zeros zeros_like new_zeros".split())
_CREATION = frozenset("empty zeros ones full".split())
# scatter_add along dim 0; torchtitan's deterministic_scatter_add(out, index, src) is the same sum
_SCATTER_ADD = frozenset("scatter_add deterministic_scatter_add".split())
# random ops with an elementwise rule (cube.ir.ops): on sorted rows they would draw in another order
_RANDOM = frozenset("""dropout dropout_ alpha_dropout native_dropout rand_like randn_like randint_like exponential
exponential_ uniform uniform_ normal normal_ normal_functional bernoulli bernoulli_ random random_ geometric geometric_
log_normal log_normal_ cauchy cauchy_""".split())
# the exact integers each dtype holds (a cast of ids, counts or positions must keep them)
_EXACT = {torch.int32: 2 ** 31, torch.int64: 2 ** 63, torch.float32: 2 ** 24, torch.float64: 2 ** 53}


@dataclass
class Region:
    """A token-local dispatch region (module docstring).

    Attributes:
        sort: the sort that starts it.
        ops: its ops, in program order.
        outputs: the tensors by which it returns to the batch order: dim 0 carries the batch.
        sizes: op id -> the number of pairs its arguments hold (``arange(M)``): on a micro-batch
            they hold the micro-batch's.
        scaled: ids of the tensors its ops read or make whose dim 0 is proportional to the batch
            (one row per pair or per token); the others (weights, group counts) are the same on a
            micro-batch.
        needs: the tensors made after the sort that it reads as one row per token: the batch must
            reach them along dim 0 (``Dispatch.late``).
        recount: offsets tensor id -> ``(groups, dtype)`` for group offsets counted outside the
            region over the whole batch from the sorted ids (``Dispatch._whole_offsets``): the fused
            layer counts them again from its own tokens' ids (``bincount`` then ``cumsum``).
        counting: the ops counting those offsets (the one-hot ``scatter``, its ``sum``, the ``cumsum``):
            on a micro-batch they count the micro-batch's tokens, the ones its sort orders.
    """

    sort: IRFwOperation
    ops: List[IRFwOperation]
    outputs: List[IRTensor]
    sizes: Dict[int, int] = field(default_factory=dict)
    recount: Dict[int, tuple] = field(default_factory=dict)
    counting: List[IRFwOperation] = field(default_factory=list)
    scaled: Set[int] = field(default_factory=set)
    needs: List[IRTensor] = field(default_factory=list)


@dataclass(frozen=True)
class _Val:
    kind: str            # rows, keys (the sorted ids: rows too), perm, inv, counts, offsets, fresh
    c: int = 1           # perm: its values are the pair's position // c
    bound: int = 0       # keys: their values lie in [0, bound); counts, offsets: the groups
    zero: bool = False   # fresh: zero-filled


class _NotLocal(Exception):
    def __init__(self, op: IRFwOperation, why: str):
        super().__init__(why)
        self.op, self.why = op, why


def _arg(op: IRFwOperation, i: int, name: str, default=None):
    if len(op.args) > i:
        return op.args[i]
    return op.kwargs.get(name, default)


def _exact(t: IRTensor, bound: int) -> bool:
    return _EXACT.get(t.dtype, 0) >= bound


class Dispatch:
    """Proves the dispatch regions of ``graph`` token-local (module docstring); ``why`` keeps, per
    sort it could not prove, the op that breaks the proof and why."""

    def __init__(self, graph: IRGraph):
        self.graph = graph
        self.ops = graph.select(ntype=IRFwOperation)
        self.pos = {id(op): i for i, op in enumerate(self.ops)}
        self.makers = {id(t): op for op in self.ops for t in op.outputs}
        self.readers: Dict[int, List[int]] = {}
        for i, op in enumerate(self.ops):
            for t in op.inputs:
                self.readers.setdefault(id(t), []).append(i)
        self.why: Dict[int, str] = {}
        self.excluded: Dict[int, str] = {}   # sort id -> why its region fails once the flow is known
        self._batchy: Optional[Set[int]] = None

    def __call__(self, sort: IRFwOperation, tracked: Dict[int, int]) -> Optional[Region]:
        """The region ``sort`` starts, proved token-local, or None (``why`` says why, when ``sort``
        sorts the tokens of the batch)."""
        if sort.name not in _SORTS or len(sort.inputs) != 1:
            return None
        if id(sort) in self.excluded:
            self.why[id(sort)] = self.excluded[id(sort)]
            return None
        try:
            return self._prove(sort, tracked)
        except _NotLocal as e:
            self.why[id(sort)] = f"op {e.op.name!r} ({e.op.where()}) {e.why}"
            return None

    def late(self, regions, tracked: Dict[int, int]) -> bool:
        """Excludes the ``regions`` (proved as the flow reached their sorts) whose ``needs`` the flow,
        now complete, does not carry along dim 0; True when it excluded one (follow again)."""
        again = False
        for region in regions:
            for t in region.needs:
                if tracked.get(id(t)) != 0:
                    op = self.makers[id(t)]
                    self.excluded[id(region.sort)] = (f"op {op.name!r} ({op.where()}) makes a tensor of shape "
                                                      f"{list(t.shape)} that the region reads as one row per token, "
                                                      f"but the batch does not reach its dim 0")
                    again = True
                    break
        return again

    @property
    def batchy(self) -> Set[int]:
        """Ids of the tensors computed from the batch."""
        if self._batchy is None:
            seen = {id(t) for op in self.graph.select(ntype=IRDataOperation) for t in op.outputs}
            for op in self.ops:
                if any(id(t) in seen for t in op.inputs):
                    seen.update(id(t) for t in op.outputs)
            self._batchy = seen
        return self._batchy

    # ------------------------------------------------------------------ the proof
    def _prove(self, sort: IRFwOperation, tracked: Dict[int, int]) -> Region:
        ids = sort.inputs[0]
        if tracked.get(id(ids)) != 0 or ids.ndim != 1 or _arg(sort, 1, "dim", -1) not in (0, -1):
            raise _NotLocal(sort, f"sorts a tensor of shape {list(ids.shape)} along another dim than its batch "
                                  f"dim 0; cube proves only sorts of one id per token (or per (token, expert) "
                                  f"pair) along the tokens")
        region = Region(sort, [sort], [], scaled={id(ids)})
        m = ids.shape[0]
        vals: Dict[int, _Val] = {}
        region.scaled.update(id(t) for t in sort.outputs)
        bound = self._id_bound(ids)
        if sort.name == "sort":
            ascending = not _arg(sort, 2, "descending", False)
            vals[id(sort.outputs[0])] = _Val("keys", bound=bound if ascending else 0)
            vals[id(sort.outputs[1])] = _Val("perm")
        else:
            vals[id(sort.outputs[0])] = _Val("perm")
        heap = sorted({j for t in sort.outputs for j in self.readers.get(id(t), ())})
        seen = set(heap)
        while heap:
            op = self.ops[heapq.heappop(heap)]
            outs = self._step(op, vals, m, tracked, region)
            region.ops.append(op)
            for t in op.outputs:
                v = outs.get(id(t))
                if v is not None and (v == "batch" or v.kind not in ("counts", "offsets")):
                    region.scaled.add(id(t))
                if v == "batch":
                    region.outputs.append(t)
                elif v is not None:
                    vals[id(t)] = v
                    for j in self.readers.get(id(t), ()):
                        if j not in seen:
                            seen.add(j)
                            heapq.heappush(heap, j)
                elif self.readers.get(id(t)):
                    raise _NotLocal(op, "makes a tensor cube cannot follow")
        if id(self.graph.loss) in vals:
            raise _NotLocal(self.makers[id(self.graph.loss)], "returns a value of the sorted order as the loss")
        region.ops.sort(key=lambda o: self.pos[id(o)])
        return region

    def _id_bound(self, ids: IRTensor) -> int:
        """``n`` where ``ids`` are provably in ``[0, n)`` (the indices of a ``topk``, of a ``max``/``min``
        along a dim or of an ``argmax``/``argmin`` over ``n`` values (PhiMoE's Gumbel-sampled experts),
        reshaped, cast or concatenated), else 0."""
        t = ids
        while True:
            op = self.makers.get(id(t))
            if op is None or t.dtype.is_floating_point:
                return 0
            if (op.name == "topk" or (op.name in ("max", "min") and len(op.inputs) == 1)) and \
                    len(op.outputs) == 2 and op.outputs[1] is t:
                x = op.inputs[0]
                dim = _arg(op, 2, "dim", -1) if op.name == "topk" else _arg(op, 1, "dim", -1)
                return x.shape[dim % x.ndim] if x.ndim else 0
            if op.name in ("argmax", "argmin") and len(op.inputs) == 1 and _arg(op, 1, "dim") is not None:
                x = op.inputs[0]
                return x.shape[_arg(op, 1, "dim") % x.ndim] if x.ndim else 0
            if op.name in ("cat", "concat") and op.inputs:
                bounds = [self._id_bound(x) for x in op.inputs]
                return max(bounds) if all(bounds) else 0
            if (op.name in _SAME or op.name in _RESHAPES or op.name in ("unsqueeze", "squeeze")) and \
                    len(op.inputs) == 1:
                t = op.inputs[0]
                continue
            return 0

    def _tokens(self, x: IRTensor, c: int, m: int, tracked, region: Region) -> bool:
        """Whether ``x`` holds one row per ``c`` pairs in the batch's order: dim 0 carries the
        batch and has ``m / c`` rows (the pair at position ``p`` reads row ``p // c``, on any
        contiguous block of the batch as on the whole)."""
        if x.ndim < 1 or x.shape[0] * c != m:
            return False
        maker = self.makers.get(id(x))
        if tracked.get(id(x)) != 0:
            if maker is None or self.pos[id(maker)] < self.pos[id(region.sort)]:
                return False
            region.needs.append(x)   # made after the sort: the flow has not reached it yet
        region.scaled.add(id(x))
        return True

    def _base(self, x: IRTensor, c: int, m: int, tracked, vals, zero: bool, region: Region) -> bool:
        """Whether ``x`` may receive rows put back at ``perm // c``: a token tensor (``_tokens``), or
        a fresh one of ``m / c`` rows (zero-filled when the rows are added to it)."""
        v = vals.get(id(x))
        maker = self.makers.get(id(x))
        fresh = (v is not None and v.kind == "fresh" and (v.zero or not zero)) or \
            (v is None and maker is not None and not maker.inputs and maker.name in _CREATION and
             (maker.name == "zeros" or not zero))
        if fresh and x.ndim >= 1 and x.shape[0] * c == m:
            region.scaled.add(id(x))
            return True
        return v is None and self._tokens(x, c, m, tracked, region)

    def _step(self, op: IRFwOperation, vals: Dict[int, _Val], m: int, tracked, region: Region) -> Dict[int, object]:
        """The kinds of ``op``'s outputs (``"batch"``: back in the batch's order), or raises."""
        ins = [vals.get(id(t)) for t in op.inputs]
        kinds = [v.kind if v is not None else None for v in ins]
        name, out = op.name, (op.outputs[0] if op.outputs else None)
        first = ins[0] if ins else None
        if name in _SAME or (name in _RESHAPES and len(op.inputs) == 1 and
                             out is not None and tuple(out.shape) == tuple(op.inputs[0].shape)):
            if first is not None and first.kind != "rows" and len(op.inputs) == 1:
                need = {"keys": first.bound, "perm": m, "inv": m, "counts": m + 1, "offsets": m + 1}.get(first.kind, 0)
                if _exact(out, need):
                    return {id(out): first}
                if first.kind != "keys":   # ids cast inexactly are still each pair's own values: rows
                    raise _NotLocal(op, f"casts the {first.kind} of the sorted pairs to {out.dtype}, which does not "
                                        f"hold them exactly")
        if name in _LIKE and first is not None and first.kind not in ("rows", "keys"):
            return {id(out): _Val("fresh", zero=name in _ZERO)}
        if "perm" in kinds or "inv" in kinds or "permcol" in kinds:
            return self._indexing(op, vals, m, tracked, region)
        if "keys" in kinds and name in ("histc", "bincount"):
            return {id(out): _Val("counts", bound=self._counts(op, first))}
        if "counts" in kinds:
            if name == "cumsum" and first is not None and first.kind == "counts" and \
                    _arg(op, 1, "dim", 0) in (0, -1) and len(op.inputs) == 1:
                return {id(out): _Val("offsets", bound=first.bound)}
            raise _NotLocal(op, "reads the tokens per group counted over the whole batch (an auxiliary loss, say): "
                                "a value of the whole batch, not of each token")
        if "offsets" in kinds or (name in _GROUPED_MM and ("rows" in kinds or "keys" in kinds)):
            return self._grouped(op, vals, region)
        if "fresh" in kinds:
            raise _NotLocal(op, "reads a tensor made only to put the sorted pairs back, for something else")
        return self._rows(op, vals, m)

    def _counts(self, op: IRFwOperation, keys: Optional[_Val]) -> int:
        """The groups of a ``histc``/``bincount`` of the sorted ids, checked to give each id its own
        bin (so the offsets bound each group's rows)."""
        if keys is None or keys.kind != "keys" or len(op.inputs) != 1:
            raise _NotLocal(op, "counts the sorted ids with weights: cube proves only plain counts")
        if not keys.bound:
            raise _NotLocal(op, "counts sorted ids that cube cannot prove ascending and in [0, groups) (the indices "
                                "of a topk): ids out of range would shift every group's rows")
        if op.name == "histc":
            bins, lo, hi = _arg(op, 1, "bins", 100), _arg(op, 2, "min", 0), _arg(op, 3, "max", 0)
            if not (lo <= 0 and hi >= keys.bound - 1 and hi > lo):
                raise _NotLocal(op, f"counts ids in [0, {keys.bound}) over the range [{lo}, {hi}], which drops some")
            return bins
        length = _arg(op, 2, "minlength", 0)
        if length < keys.bound:
            raise _NotLocal(op, f"counts ids in [0, {keys.bound}) into {length} bins: the number of groups would "
                                f"depend on the batch")
        return length

    def _whole_offsets(self, offs: IRTensor, region: Region) -> Optional[_Val]:
        """Group offsets counted before the sort from the ids it sorts: ``cumsum`` over the
        per-group count ``sum`` (over every dim but the last) of a one-hot ``scatter`` of ``topk``
        indices into a zero tensor, the sort's ids being those indices flattened. They equal the
        ``histc``/``cumsum`` of the sorted ids over the whole batch; the fused layer counts its own
        tokens' ids again (``Region.recount``). None when ``offs`` is not that."""
        ids = region.sort.inputs[0]
        cum = self.makers.get(id(offs))
        if cum is None or cum.name != "cumsum" or len(cum.inputs) != 1 or _arg(cum, 1, "dim", 0) not in (0, -1) or \
                offs.ndim != 1 or offs.dtype.is_floating_point or not _exact(offs, ids.shape[0] + 1):
            return None
        total = self.makers.get(id(cum.inputs[0]))
        if total is None or total.name != "sum" or len(total.inputs) != 1:
            return None
        hot = total.inputs[0]
        dims = _arg(total, 1, "dim", None)
        if hot.ndim < 2 or sorted(d % hot.ndim for d in (dims or ())) != list(range(hot.ndim - 1)) or \
                _arg(total, 2, "keepdim", False):
            return None
        scatter = self.makers.get(id(hot))
        if scatter is None or scatter.name != "scatter" or _arg(scatter, 1, "dim") not in (-1, hot.ndim - 1) or \
                len(scatter.inputs) != 2 or _arg(scatter, 3, "value") not in (True, 1):
            return None
        zero, index = scatter.args[0], scatter.args[2]
        zmaker = self.makers.get(id(zero))
        groups = hot.shape[-1]
        if zmaker is None or zmaker.name not in _ZERO or not isinstance(index, IRTensor) or \
                index is not scatter.inputs[1] or self._id_bound(index) != groups or \
                self.makers.get(id(index)) is None or self.makers[id(index)].name != "topk":
            return None   # a topk's indices: distinct per token, so the one-hot counts each pair once
        src = ids   # the sorted ids: the same indices, flattened
        while src is not index:
            maker = self.makers.get(id(src))
            if maker is None or maker.name not in _RESHAPES or len(maker.inputs) != 1:
                return None
            src = maker.inputs[0]
        if math.prod(ids.shape) != math.prod(index.shape):
            return None
        region.recount[id(offs)] = (groups, offs.dtype)
        region.counting = [scatter, total, cum]
        region.scaled.update({id(hot), id(zero), id(index)})   # one row per token (or sample) along dim 0
        return _Val("offsets", bound=groups)

    def _grouped(self, op: IRFwOperation, vals: Dict[int, _Val], region: Optional[Region] = None) -> Dict[int, object]:
        """A grouped matmul of sorted rows by the offsets of the same sort: row-wise."""
        if op.name not in _GROUPED_MM:
            raise _NotLocal(op, "reads the group offsets of the sorted pairs (counted over the whole batch) other "
                                "than as a grouped matmul's offs")
        x, w, offs = op.args[0], op.args[1], _arg(op, 2, "offs")
        xv, ov = vals.get(id(x)), vals.get(id(offs)) if isinstance(offs, IRTensor) else None
        if ov is None and isinstance(offs, IRTensor) and region is not None:
            ov = self._whole_offsets(offs, region)
        if ov is None or ov.kind != "offsets" or xv is None or xv.kind not in ("rows", "keys") or x.ndim != 2:
            raise _NotLocal(op, "is a grouped matmul whose input is not the sorted rows its offsets count")
        if not isinstance(w, IRTensor) or w.ndim != 3 or w.shape[0] != ov.bound or id(w) in self.batchy or \
                id(w) in vals:
            raise _NotLocal(op, "is a grouped matmul whose weights are not one (groups, in, out) tensor "
                                "independent of the batch")
        if op.name == "_grouped_mm" and _arg(op, 3, "bias") is not None:
            raise _NotLocal(op, "is a grouped matmul with a bias, which cube does not prove row-wise")
        return {id(op.outputs[0]): _Val("rows")}

    def _indexing(self, op: IRFwOperation, vals: Dict[int, _Val], m: int, tracked, region: Region) -> Dict[int, object]:
        """The ops that read the sort's indices or their inverse: gathers into the sorted order,
        inverting the permutation, putting rows back into the batch's order."""
        name, out = op.name, op.outputs[0]

        def val(t):
            return vals.get(id(t)) if isinstance(t, IRTensor) else None
        if name in ("floor_divide", "div") and len(op.inputs) == 1 and val(op.args[0]) is not None:
            v, k = val(op.args[0]), op.args[1]
            floor = name == "floor_divide" or op.kwargs.get("rounding_mode") == "floor"
            if v.kind == "perm" and floor and isinstance(k, int) and k > 0 and m % (v.c * k) == 0:
                return {id(out): _Val("perm", c=v.c * k)}
        if (name in _RESHAPES or name == "expand") and len(op.inputs) == 1 and val(op.args[0]) is not None and \
                val(op.args[0]).kind in ("perm", "permcol") and out.ndim == 2 and out.shape[0] == m and \
                (out.shape[1] == 1 or (name == "expand" and op.inputs[0].ndim == 2)):
            return {id(out): _Val("permcol", c=val(op.args[0]).c)}   # each row: its pair's position, repeated
        if name in _SCATTER_ADD:
            base, idx, src = (op.args[0], op.args[2], op.args[3]) if name == "scatter_add" else op.args[:3]
            iv, sv = val(idx), val(src)
            if (name != "scatter_add" or op.args[1] in (0, -base.ndim)) and iv is not None and \
                    iv.kind == "permcol" and sv is not None and sv.kind in ("rows", "keys") and src.ndim == 2 and \
                    tuple(idx.shape) == tuple(src.shape) and base.ndim == 2 and base.shape[1] == src.shape[1] and \
                    (val(base) is None or val(base).kind == "fresh") and \
                    self._base(base, iv.c, m, tracked, vals, True, region):
                return {id(out): "batch"}   # index_add(base, 0, perm // c, rows), written element-wise
        if name in ("index", "index_select"):
            x = op.args[0]
            if name == "index":
                idx = op.args[1][0] if isinstance(op.args[1], (list, tuple)) and len(op.args[1]) == 1 else None
            else:
                idx = op.args[2] if _arg(op, 1, "dim") in (0, -x.ndim) else None
            iv, xv = val(idx), val(x)
            if iv is not None and iv.kind == "perm" and xv is None:
                if iv.c == 1 and x is region.sort.inputs[0]:   # the ids in sorted order: the sort's values
                    ascending = not _arg(region.sort, 2, "descending", False)
                    return {id(out): _Val("keys", bound=self._id_bound(x) if ascending else 0)}
                if self._tokens(x, iv.c, m, tracked, region):
                    return {id(out): _Val("rows")}
                raise _NotLocal(op, f"gathers by the sort's indices from a tensor of shape {list(x.shape)}, which "
                                    f"is not one row per token of the {m} sorted pairs in the batch's order")
            if iv is not None and iv.kind == "inv" and xv is not None and xv.kind in ("rows", "keys") and \
                    x.shape[0] == m:
                return {id(out): "batch"}
        if name in ("argsort", "sort") and val(op.args[0]) == _Val("perm") and \
                _arg(op, 1, "dim", -1) in (0, -1) and not _arg(op, 2, "descending", False) and \
                (name == "argsort" or not self.readers.get(id(op.outputs[0]))):
            return {id(op.outputs[-1]): _Val("inv")}
        if name == "index_put":
            base, idx, values = op.args[0], op.args[1], op.args[2]
            idx = idx[0] if isinstance(idx, (list, tuple)) and len(idx) == 1 else None
            accumulate = _arg(op, 3, "accumulate", False)
            iv, vv, bv = val(idx), val(values), val(base)
            if iv is not None and iv.kind == "perm" and (bv is None or bv.kind == "fresh"):
                if iv.c == 1 and not accumulate and vv is None and self._iota(values, m, region) and \
                        self._base(base, 1, m, tracked, vals, False, region):
                    return {id(out): _Val("inv")}
                if vv is not None and vv.kind in ("rows", "keys") and (accumulate or iv.c == 1) and \
                        self._base(base, iv.c, m, tracked, vals, accumulate, region):
                    return {id(out): "batch"}
        if name == "index_add" and _arg(op, 1, "dim") == 0:
            base, idx, src = op.args[0], op.args[2], op.args[3]
            iv, sv = val(idx), val(src)
            if iv is not None and iv.kind == "perm" and sv is not None and sv.kind in ("rows", "keys") and \
                    (val(base) is None or val(base).kind == "fresh") and \
                    self._base(base, iv.c, m, tracked, vals, True, region):
                return {id(out): "batch"}
        raise _NotLocal(op, "reads the sort's indices (positions in the whole batch) other than to gather rows "
                            "into the sorted order or to put them back into the batch's order")

    def _iota(self, t, m: int, region: Region) -> bool:
        """Whether ``t`` is ``arange(m)`` (recorded: on a micro-batch it is the micro-batch's)."""
        op = self.makers.get(id(t)) if isinstance(t, IRTensor) else None
        if op is None or op.name != "arange" or op.inputs or tuple(t.shape) != (m,) or t.dtype.is_floating_point:
            return False
        if tuple(op.args) not in ((m,), (0, m), (0, m, 1)):
            return False
        region.ops.append(op)
        region.sizes[id(op)] = m
        region.scaled.add(id(t))
        return True

    def _rows(self, op: IRFwOperation, vals: Dict[int, _Val], m: int) -> Dict[int, object]:
        """A row-wise op of sorted rows: its rule carries their dim 0, as one unmarked letter, to dim
        0 of every output at the same size; its other inputs do not depend on the batch."""
        info = op_info(op.name)
        if op.anno is None or op.name not in BUILTIN or op.name in _RANDOM or info.running_stats:
            raise _NotLocal(op, "reads the sorted rows and is no op cube knows to work on each row alone "
                                + ("(a random op)" if op.name in _RANDOM else "(no partition rule)" if op.anno is None
                                   else ""))
        letter = None
        for idx, t in enumerate(op.inputs):
            if id(t) not in vals:
                continue
            if vals[id(t)].kind not in ("rows", "keys"):
                raise _NotLocal(op, f"reads the {vals[id(t)].kind} of the sorted pairs")
            d0 = op.anno.inputs[idx][0] if op.anno.inputs[idx] else None
            if d0 is None or len(d0.idents) != 1 or d0.head.marked or letter not in (None, d0.head.name):
                raise _NotLocal(op, f"does not work on each sorted row alone (its rule '{op.anno}' keeps their dim "
                                    f"whole or reshapes it): it mixes, drops or reorders the tokens of the batch")
            letter = d0.head.name
        for idx, t in enumerate(op.inputs):
            at = [d for d, dim in enumerate(op.anno.inputs[idx]) if any(i.name == letter for i in dim.idents)]
            if id(t) in vals and at != [0]:
                raise _NotLocal(op, f"does not work on each sorted row alone (its rule '{op.anno}' moves their "
                                    f"dim): it mixes the tokens of the batch")
            if id(t) not in vals and (at or id(t) in self.batchy):
                raise _NotLocal(op, f"combines the sorted rows with a tensor of shape {list(t.shape)} that is not in "
                                    f"the sorted order (a token tensor, or one indexed by position)")
        kinds = {}
        for k, t in enumerate(op.outputs):
            g = op.anno.outputs[k]
            at = [d for d, dim in enumerate(g) if any(i.name == letter for i in dim.idents)]
            if at != [0] or len(g[0].idents) != 1 or t.shape[0] != m:
                raise _NotLocal(op, f"does not keep the {m} sorted rows as its rows (output shape {list(t.shape)}, "
                                    f"rule '{op.anno}'): it mixes or drops tokens of the batch")
            kinds[id(t)] = _Val("rows")
        return kinds
