"""Pipeline steps take the global batch: what a micro-batch's graph must compute so the step is exact.

A pipeline plan's compiled step takes one batch (the global batch, what the
user would train on in one process) and cuts it along dim 0 into ``nmicros``
equal micro-batches that run through the schedule; the policy plans the graph
traced on one micro-batch. The step's loss is the *sum* of what each
micro-batch returns, and backward starts from each micro-batch's value
unscaled, so each micro-batch must return its *share* of the global loss:
the shares add up to the loss of the whole batch and their gradients to its
gradient, exactly, with no rescaling anywhere.

``micro_shares(full, micro, nmicros)`` compares the graph traced on the global
batch (``full``) with the one traced on a micro-batch (``micro``) and makes the
micro graph compute shares (changing only the micro graph, right after its
trace, before any policy sees it):

- The batch is followed from the data operation (dim 0 of every batch tensor,
  ``cube.ir.follow.batch_flow``). Every op reading a sample-carrying tensor must
  carry the batch split (it works on each sample alone); an op that mixes the
  samples of a micro-batch (batch norm's statistics, a softmax over the batch,
  an op with no split rule) would see another batch than on one device: refused.
  Except a dispatch of the tokens sorted by expert (an MoE kernel) that ``cube.ir.dispatch`` proves
  token-local: no op of it splits along the batch, but each token's output depends on that token
  alone, so the region runs on the micro-batch's tokens; its ops must run with the same arguments
  on the micro-batch except the number of pairs (``arange``) and shapes, its tensors of one row per
  pair or token ``nmicros`` times shorter. A sort whose region is not proved is refused with the
  op that breaks the proof.
- Where the batch is summed away (a ``sum``, a ``mean``, a mean-reduced loss)
  the micro graph's value is a share of the global one. A ``sum`` is already its
  share; a ``mean`` or ``mse_loss`` becomes the micro-batch's sum over the
  *global* count (which equal micro-batches make ``nmicros`` times the micro
  count); a ``cross_entropy``/``nll_loss`` mean over valid targets
  (``ignore_index``, class weights) becomes the micro-batch's sum over the weight
  of the valid targets of the *whole* batch, counted from the global batch before
  the schedule runs (``TargetCount``): the mean of micro-batch means would be
  wrong whenever ``-100`` labels are spread unevenly over the micro-batches.
- A loss normalized by hand, ``loss_sum / count`` where ``count`` is computed from the batch alone
  and reduces over it (``(labels != -100).sum()``, as torchtitan writes a mean over valid
  targets), divides each micro-batch's sum by the *global* count, computed on the whole batch
  before the schedule runs (``TargetCount`` of kind ``"value"``); such a count may be used only
  as a divisor or factor of a share.
- From there to the loss only linear ops may follow (sums of shares, products
  with values that do not depend on the batch, views): their constants are taken
  from the global trace (``loss.sum() / x.numel()`` divides by the global
  ``numel``, not the micro-batch's). Anything non-linear in a batch reduction
  (``x.mean() ** 2``, adding a term that does not depend on the batch, which
  every micro-batch would add again) is refused.
- Elsewhere the two traces must agree except in shapes (``view`` sizes,
  ``expand``, ``zeros``...): a constant that depends on the batch size (an
  ``arange`` over it, a division by it before the reduction) is refused, since
  it would differ between one micro-batch and the whole batch.

Refusals are ``ValueError`` naming the op, its source line and the fixes: make
the loss a mean or sum over samples, or use ``nmicros=1``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from cube.errors import CubeInternalError
from cube.ir.follow import batch_flow
from cube.ir.graph import IRGraph
from cube.ir.ops import op_info
from cube.ir.operator import IRDataOperation, IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind

# ops whose arguments may differ between the two traces only by the batch size in a shape
_SHAPE_OPS = frozenset("""view reshape _unsafe_view flatten unflatten expand expand_as view_as zeros ones full empty rand
randn randint new_zeros new_ones new_full new_empty zeros_like ones_like full_like empty_like""".split())
_LIKE_OPS = frozenset("new_zeros new_ones new_full new_empty zeros_like ones_like full_like empty_like".split())
# ops linear in a share of a batch reduction (the other operands must not depend on the batch)
_LINEAR = frozenset("""add sub mul div neg view reshape _unsafe_view flatten unflatten unsqueeze squeeze clone
contiguous alias detach to _to_copy lift_fresh_copy sum mean expand view_as""".split())
_SUMMED = frozenset("add sub".split())   # every batch-dependent operand must be a share
_SORTS = frozenset("sort argsort".split())   # ops that order all the tokens of a batch


@dataclass
class TargetCount:
    """A mean loss over valid targets whose denominator is counted on the global batch.

    Attributes:
        index: its position in ``MicroBatches.counts``.
        ops: the global trace's ops that make the loss's targets from the batch, in order.
        target: the global trace's targets tensor.
        weight: the class weights (a parameter or buffer of the micro graph), or None.
        ignore_index: targets of this value are not counted.
        dtype: the loss's dtype (the count's).
        kind: ``"targets"`` (the valid targets of ``target`` are counted), or ``"value"``: ``target``
            is itself the value, a reduction over the batch computed from the batch alone (the
            denominator of a loss normalized by hand, ``loss_sum / (labels != -100).sum()``).
    """

    index: int
    ops: List[IRFwOperation]
    target: IRTensor
    weight: Optional[IRTensor]
    ignore_index: int
    dtype: Any
    kind: str = "targets"


@dataclass
class MicroBatches:
    """How a step of a pipeline plan cuts the global batch (``graph.micro`` of a micro-batch graph).

    Attributes:
        nmicros: micro-batches per step.
        batch: the global batch size (dim 0 of every batch tensor).
        full_inputs: the global trace's batch tensors (what ``TargetCount.ops`` read).
        counts: the mean losses whose valid targets are counted on the global batch.
    """

    nmicros: int
    batch: int
    full_inputs: List[IRTensor]
    counts: List[TargetCount] = field(default_factory=list)


def _names(op: IRFwOperation) -> List[str]:
    return [a.name for a in op.target._schema.arguments]


def _arg(op: IRFwOperation, name: str, default=None):
    names = _names(op)
    if name not in names:
        return default
    i = names.index(name)
    return op.args[i] if i < len(op.args) else op.kwargs.get(name, default)


def _leaves_equal(a, b) -> bool:
    """Whether two argument trees agree outside their tensors."""
    if isinstance(a, IRTensor) or isinstance(b, IRTensor):
        return isinstance(a, IRTensor) and isinstance(b, IRTensor)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_leaves_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_leaves_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def _take_constants(micro, full):
    """``micro``'s argument tree with ``full``'s constants (tensors stay the micro graph's)."""
    if isinstance(micro, IRTensor):
        return micro
    if isinstance(micro, (list, tuple)):
        out = [_take_constants(x, y) for x, y in zip(micro, full)]
        return out if isinstance(micro, list) else tuple(out)
    if isinstance(micro, dict):
        return {k: _take_constants(v, full[k]) for k, v in micro.items()}
    return full


def _where(op: IRFwOperation) -> str:
    return f"op {op.name!r} ({op.where()})"


_FIX = ("Make the loss a mean or a sum over the samples of the batch, or plan the pipeline with nmicros=1 "
        "(one micro-batch: the whole batch per step).")


def micro_shares(full: IRGraph, micro: IRGraph, nmicros: int, batch: int) -> MicroBatches:
    """Makes ``micro`` (traced on one of ``nmicros`` equal micro-batches of the global batch that
    ``full`` was traced on) compute its share of the global loss (module docstring).

    Sets ``op.micro_share`` on ops of ``micro`` that a piece must call differently (``("mean",
    global count)`` or ``("targets", count index)``), replaces the constants of the linear ops
    after a batch reduction by the global trace's, and returns the ``MicroBatches`` (also set as
    ``micro.micro``).

    Raises:
        ValueError: the step on micro-batches cannot equal the step on the whole batch (the
            message names the op and the fix).
    """
    fops = full.ops
    pairs = _pairs(fops, micro.ops, batch, nmicros)
    data = full.select(ntype=IRDataOperation)[0]
    flow = batch_flow(full, nmicros)
    carried = flow.tracked   # tensor id -> its batch dim
    local = flow.local       # op id -> the token-local dispatch region it is part of
    reduced = {id(op) for op in flow.reduced}
    blocked = {id(op) for op in flow.blocked}
    shares: Set[int] = set()     # tensors (of ``full``) holding a share of a batch reduction
    info = MicroBatches(nmicros, batch, list(data.outputs))
    batchy = set(carried)
    makers = {id(t): op for op in fops for t in op.outputs}
    order = {id(op): i for i, op in enumerate(fops)}
    readers: Dict[int, List[IRFwOperation]] = {}
    for op in fops:
        for t in op.inputs:
            readers.setdefault(id(t), []).append(op)
    # the tokens per group a dispatch region counts on each micro-batch (``Region.counting``'s sum)
    counted = {id(t) for region in local.values() for op in region.counting if op.name == "sum" for t in op.outputs}
    dataonly = {id(t) for t in data.outputs}   # tensors computed from the batch alone, needing no gradient
    countable: Set[int] = set()   # of those, the ones reduced over the batch (counted on the global batch)
    for fop, mop in pairs:
        if not isinstance(fop, IRFwOperation):
            continue
        if fop.inputs and all(id(t) in dataonly or id(t) in countable for t in fop.inputs) and \
                not any(t.requires_grad for t in fop.outputs):
            dataonly.update(id(t) for t in fop.outputs)
            if id(fop) in reduced or any(id(t) in countable for t in fop.inputs):
                countable.update(id(t) for t in fop.outputs)
                continue
        if any(id(t) in countable for t in fop.inputs):
            if mop is not None and _scaled_by_count(fop, mop, shares, countable, info, makers, order):
                shares.update(id(t) for t in fop.outputs)
                batchy.update(id(t) for t in fop.outputs)
                continue
            raise ValueError(f"pipeline plan: {_where(fop)} reads a value reduced over the batch that is computed "
                             f"from the batch alone (a count of valid targets, say) other than as the divisor or "
                             f"factor of a loss summed over the batch; cube counts such values on the global "
                             f"batch only for `loss_sum / count`. {_FIX}")
        if _accumulates_state(fop, shares, counted, readers):
            continue   # each micro-batch adds its share to the buffer: together, the global batch's
        if id(fop) in local:   # a token-local region runs on the micro-batch's own tokens
            if mop is not None:
                _local_pair(fop, mop, local[id(fop)], nmicros)
            batchy.update(id(t) for t in fop.outputs)
            continue
        # a new tensor like a batch tensor reads only its shape (the batch size: checked below)
        reads = [] if fop.name in _LIKE_OPS else [t for t in fop.inputs if id(t) in batchy]
        mixes = id(fop) in blocked and fop.name not in _LIKE_OPS
        unsplit = reads and id(fop) not in flow.splits and id(fop) not in reduced and \
            not any(id(t) in shares for t in fop.inputs)
        if mixes or unsplit:
            head = (f"pipeline plan: {_where(fop)} mixes the samples of the batch (it cannot be split along the "
                    f"batch dim), so on a micro-batch it would compute something else than on the global batch.")
            if fop.name in _SORTS:
                why = flow.unproven.get(id(fop), "it sorts no tensor of one id per token along the tokens")
                raise ValueError(f"{head} It orders the tokens of the whole batch (an MoE kernel dispatching tokens "
                                 f"by expert, as Hugging Face's default grouped_mm does). cube runs such a dispatch "
                                 f"on each micro-batch's own tokens when it proves that every token's output "
                                 f"depends on that token alone (cube.ir.dispatch), but not here: {why}. Work on the "
                                 f"sorted rows one row at a time and put them back in the batch's order "
                                 f"(rows[inverse permutation]) before anything else reads them; or use a per-token "
                                 f"dispatch (Hugging Face's config._experts_implementation = 'batched_mm'); or plan "
                                 f"the pipeline with nmicros=1.")
            raise ValueError(f"{head} Keep such ops out of the model (batch norm: use layer or group-free norms), "
                             f"or plan the pipeline with nmicros=1.")
        if op_info(fop.name).running_stats and reads:
            training = _arg(fop, op_info(fop.name).running_stats, False)
            if training:
                raise ValueError(f"pipeline plan: {_where(fop)} normalizes with statistics over the batch, which "
                                 f"micro-batches of {batch // nmicros} samples would change. Use a per-sample norm "
                                 f"(layer norm), or plan the pipeline with nmicros=1.")
        if mop is None:   # an identity only the global trace has (``_pairs``): its output is its input's value
            if any(id(t) in shares for t in fop.inputs):
                shares.update(id(t) for t in fop.outputs)
            if reads or any(id(t) in shares for t in fop.inputs):
                batchy.update(id(t) for t in fop.outputs)
            continue
        if id(fop) in reduced:
            _reduction(fop, mop, info, shares, carried, makers, order)
            continue
        share_in = [t for t in fop.inputs if id(t) in shares]
        if share_in:
            _linear(fop, share_in, batchy, shares, batch, nmicros)
            mop.args = _take_constants(mop.args, fop.args)
            mop.kwargs = _take_constants(mop.kwargs, fop.kwargs)
            shares.update(id(t) for t in fop.outputs)
            batchy.update(id(t) for t in fop.outputs)
            continue
        if reads:
            batchy.update(id(t) for t in fop.outputs)
        if not (_leaves_equal(fop.args, mop.args) and _leaves_equal(fop.kwargs, mop.kwargs)) \
                and fop.name not in _SHAPE_OPS and not _row_index(fop, readers, batch) \
                and not _batch_repeat(fop, mop, batchy, nmicros):
            raise ValueError(f"pipeline plan: {_where(fop)} has other arguments on a micro-batch of "
                             f"{batch // nmicros} samples than on the global batch of {batch} (a constant "
                             f"computed from the batch size): the micro-batches would not add up to the "
                             f"global batch. Compute it from the data instead, or plan the pipeline with "
                             f"nmicros=1.")
    if id(full.loss) not in shares:
        raise ValueError(f"pipeline plan: the loss is not a sum or mean over the samples of the batch, so the "
                         f"losses of {nmicros} micro-batches do not add up to the loss of the global batch. {_FIX}")
    micro.micro = info
    return info


def _local_pair(fop: IRFwOperation, mop: IRFwOperation, region, nmicros: int) -> None:
    """Checks that ``mop`` runs ``fop``'s part of a token-local region (``cube.ir.dispatch``) on a
    micro-batch: the same arguments but the number of pairs (``arange(M)``) and shapes, and the
    tensors whose rows are pairs or tokens ``nmicros`` times shorter, the others (weights, group
    counts) the same. The proof on the global trace then holds for the micro-batch's."""
    size = region.sizes.get(id(fop))
    if size is not None:
        m = size // nmicros
        same = tuple(mop.args) in ((m,), (0, m), (0, m, 1)) and size % nmicros == 0
    else:
        same = _leaves_equal(fop.args, mop.args) and _leaves_equal(fop.kwargs, mop.kwargs) or fop.name in _SHAPE_OPS
    pairs = list(zip(fop.inputs, mop.inputs)) + list(zip(fop.outputs, mop.outputs))
    for f, m in pairs:
        want = tuple(f.shape)
        if id(f) in region.scaled:
            want = (f.shape[0] // nmicros,) + want[1:] if f.shape[0] % nmicros == 0 else None
        same = same and tuple(m.shape) == want and f.dtype == m.dtype
    if not same or len(fop.inputs) != len(mop.inputs) or len(fop.outputs) != len(mop.outputs):
        raise ValueError(f"pipeline plan: {_where(fop)} is part of a dispatch of the tokens sorted by expert "
                         f"(cube.ir.dispatch) but runs with other arguments or shapes on a micro-batch of "
                         f"{region.sort.inputs[0].shape[0] // nmicros} pairs than on the global batch's "
                         f"{region.sort.inputs[0].shape[0]} (a size written into the model, say): compute sizes from "
                         f"the tensors, or plan the pipeline with nmicros=1.")


def _scaled_by_count(fop: IRFwOperation, mop: IRFwOperation, shares: Set[int], countable: Set[int],
                     info: MicroBatches, makers, order) -> bool:
    """Whether ``fop`` divides (or multiplies) a share of a batch reduction by a value counted from the
    batch alone (``loss_sum / (labels != -100).sum()``); if so, marks ``mop`` to take that value as
    computed on the global batch (``("value", k, position)``)."""
    if fop.name not in ("div", "mul") or len(fop.inputs) != 2:
        return False
    a, b = fop.inputs
    if fop.name == "div":
        if not (id(a) in shares and id(b) in countable):
            return False
        pos, value = 1, b
    elif id(a) in shares and id(b) in countable:
        pos, value = 1, b
    elif id(b) in shares and id(a) in countable:
        pos, value = 0, a
    else:
        return False
    def alone(t, op) -> None:   # ``countable`` holds only values made from the batch
        if not isinstance(op, IRFwOperation):
            raise CubeInternalError(f"the count read by {_where(fop)} is not made from the batch")
    ops = _made_from_batch(value, info, makers, order, alone)
    k = len(info.counts)
    info.counts.append(TargetCount(k, ops, value, None, -100, value.dtype, kind="value"))
    mop.micro_share = ("value", k, pos)
    return True


def _made_from_batch(value: IRTensor, info: MicroBatches, makers, order, check) -> List[IRFwOperation]:
    """The global trace's ops that make ``value`` from the batch tensors, in program order;
    ``check(tensor, its maker)`` raises where a tensor on the way is not made from the batch alone."""
    data = {id(t) for t in info.full_inputs}
    ops, seen, todo = [], set(), [value]
    while todo:
        t = todo.pop()
        if id(t) in data or id(t) in seen:
            continue
        seen.add(id(t))
        op = makers.get(id(t))
        check(t, op)
        ops.append(op)
        todo.extend(op.inputs)
    return sorted({id(o): o for o in ops}.values(), key=lambda o: order[id(o)])


def _identity(op) -> bool:
    """An op whose output holds its input's value (``contiguous``; a slice of a whole dim is no op at all,
    ``cube.trace.builder``)."""
    return isinstance(op, IRFwOperation) and op.name == "contiguous" and len(op.inputs) == 1


def _pairs(fops: list, mops: list, batch: int, nmicros: int) -> list:
    """The ops of the global trace paired with the micro-batch trace's, in order (``None``: a
    ``contiguous`` that the global trace has and the micro-batch's lacks, or the reverse, skipped:
    whether a tensor is already contiguous can depend on the batch size, as for a slice of one
    sample).

    Raises:
        ValueError: the traces run other ops (the forward depends on the batch size).
    """
    pairs, i, j = [], 0, 0
    while i < len(fops) or j < len(mops):
        a = fops[i] if i < len(fops) else None
        b = mops[j] if j < len(mops) else None
        if a is not None and b is not None and type(a) is type(b) and a.name == b.name:
            pairs.append((a, b))
            i, j = i + 1, j + 1
        elif a is not None and _identity(a):
            pairs.append((a, None))
            i += 1
        elif b is not None and _identity(b):
            j += 1
        else:
            what = (f"op {i}: {a.name!r} on the whole batch, {b.name!r} on a micro-batch" if a is not None and
                    b is not None else f"{len(fops)} ops against {len(mops)}")
            hint = (" (micro-batches of one sample are traced with a dynamic batch dim; this model still takes "
                    f"another path for one sample: use micro-batches of at least 2 samples, a global batch of at "
                    f"least {2 * nmicros})" if batch // nmicros == 1 else "")
            raise ValueError(f"pipeline plan: the model runs other ops on a micro-batch of {batch // nmicros} "
                             f"samples than on the global batch of {batch} ({what}): its forward depends on the "
                             f"batch size{hint}, so cube cannot cut the global batch into {nmicros} micro-batches. "
                             f"Keep the forward independent of the batch size, or plan the pipeline with nmicros=1.")
    return pairs


def _reduction(fop: IRFwOperation, mop: IRFwOperation, info: MicroBatches, shares: Set[int], carried,
               makers, order) -> None:
    """Marks a batch reduction of ``mop`` with what its micro-batch share divides by."""
    name = fop.name
    oi = op_info(name)
    if name == "sum":
        pass
    elif name == "mean":
        x = fop.inputs[0]
        dims = _arg(fop, "dim")
        dims = range(x.ndim) if dims is None or (isinstance(dims, (list, tuple)) and not dims) else \
            ([dims] if isinstance(dims, int) else dims)
        mop.micro_share = ("mean", math.prod(x.shape[d % x.ndim] for d in dims))
    elif oi.mean_loss or oi.counts_targets:
        reduction = _arg(fop, "reduction", 1)
        if reduction == 1 and oi.mean_loss:
            mop.micro_share = ("mean", math.prod(fop.inputs[0].shape))
        elif reduction == 1:
            mop.micro_share = ("targets", _target_count(fop, mop, info, carried, makers, order))
    else:
        raise ValueError(f"pipeline plan: {_where(fop)} sums over the samples of the batch in a way cube cannot "
                         f"cut into micro-batches (only sum, mean and the mean or summed losses can be). {_FIX}")
    shares.update(id(t) for t in fop.outputs)


def _target_count(fop: IRFwOperation, mop: IRFwOperation, info: MicroBatches, carried, makers, order) -> int:
    """Records how to count the valid targets of the global batch for the mean loss ``fop``."""
    target = fop.inputs[1]

    def alone(t, op) -> None:
        if not isinstance(op, IRFwOperation) or id(t) not in carried:
            raise ValueError(f"pipeline plan: the targets of {_where(fop)} are not made from the batch alone, so "
                             f"cube cannot count its valid targets (ignore_index, class weights) on the global "
                             f"batch before the micro-batches run. Pass the targets in the batch, use "
                             f"reduction='sum' and divide by a count from the batch, or plan the pipeline with "
                             f"nmicros=1.")
    ops = _made_from_batch(target, info, makers, order, alone)
    weight = _arg(mop, "weight")
    if weight is not None and weight not in mop.inputs:
        raise CubeInternalError(f"the class weights of {_where(fop)} are not among its inputs")
    if weight is not None and weight.kind not in (TensorKind.PARAM, TensorKind.BUFFER):
        raise ValueError(f"pipeline plan: the class weights of {_where(fop)} are computed in forward; cube counts "
                         f"the valid targets of the global batch before the micro-batches run and needs them as a "
                         f"parameter or buffer. Register them as a buffer, or plan the pipeline with nmicros=1.")
    k = len(info.counts)
    info.counts.append(TargetCount(k, ops, target, weight, _arg(fop, "ignore_index", -100), fop.inputs[0].dtype))
    return k


def _accumulates_state(fop: IRFwOperation, shares: Set[int], counted: Set[int], readers) -> bool:
    """Whether ``fop`` is ``buffer.add_(share)`` that nothing of the step reads after (torchtitan's MoE
    counting the tokens each expert gets, ``tokens_per_expert.add_(counts)``, for its load-balancing bias):
    the micro-batches add their shares one after another, and the shares add up to the global batch's. A
    share is a sum over the batch, or the tokens per group a dispatch region counts on each micro-batch
    (``Region.counting``)."""
    if fop.name != "add_" or len(fop.inputs) != 2 or _arg(fop, "alpha", 1) != 1:
        return False
    state, term = fop.inputs
    return state.kind is TensorKind.BUFFER and (id(term) in shares or id(term) in counted) and \
        id(state) not in shares and not any(readers.get(id(t)) for t in fop.outputs)


def _linear(fop: IRFwOperation, share_in, batchy, shares, batch: int, nmicros: int) -> None:
    """Checks that ``fop`` is linear in the shares it reads (module docstring)."""
    others = [t for t in fop.inputs if id(t) not in shares]
    batch_others = [t for t in others if id(t) in batchy]
    ok = fop.name in _LINEAR and not batch_others
    if ok and fop.name in _SUMMED:
        ok = not others   # adding a value that does not depend on the batch: every micro-batch would add it
    if ok and fop.name in ("mul",):
        ok = len(share_in) == 1
    if ok and fop.name == "div":
        ok = len(share_in) == 1 and fop.inputs[0] is share_in[0]
    if not ok:
        raise ValueError(f"pipeline plan: {_where(fop)} is not linear in a sum or mean over the samples of the "
                         f"batch, so it cannot be computed per micro-batch and added up (a term that does not "
                         f"depend on the batch would be added once per micro-batch; a product or power of batch "
                         f"means is not the sum of those of the micro-batches). {_FIX}")


_INDEX_PATH = frozenset("unsqueeze view reshape _unsafe_view expand to _to_copy alias clone contiguous slice".split())


def _batch_repeat(fop: IRFwOperation, mop: IRFwOperation, batchy: Set[int], nmicros: int) -> bool:
    """Whether ``fop`` repeats a tensor that does not depend on the batch once per sample along dim
    0 (BLOOM's ``alibi.repeat(batch_size, 1, 1)``): its copies are equal, so any block of them is the
    micro-batch's; as ``expand``, only the count differs, ``nmicros`` times smaller on the micro graph."""
    if fop.name != "repeat" or not fop.inputs or id(fop.inputs[0]) in batchy or len(fop.args) < 2:
        return False
    full, micro = list(fop.args[1]), list(mop.args[1]) if len(mop.args) > 1 else None
    return micro is not None and len(full) == len(micro) and full[1:] == micro[1:] and \
        full[0] == micro[0] * nmicros and _leaves_equal(fop.args[2:], mop.args[2:]) and \
        _leaves_equal(fop.kwargs, mop.kwargs)


def _row_index(op: IRFwOperation, readers, batch: int) -> bool:
    """Whether ``op`` is ``arange(batch)`` used only to pick, for each sample, its own row of
    tensors whose dim 0 is the batch (``x[torch.arange(B)[:, None], ...]``, as Hugging Face's mask
    functions do): on a micro-batch ``arange(b)`` picks the micro-batch's own rows, the same."""
    if op.name != "arange" or not op.outputs or tuple(op.outputs[0].shape) != (batch,):
        return False
    args = tuple(op.args)
    if args[:1] != (batch,) and args[:3] not in ((0, batch), (0, batch, 1)):
        return False
    todo, seen = [op.outputs[0]], set()
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        for r in readers.get(id(t), []):
            if r.name in _INDEX_PATH and r.inputs and r.inputs[0] is t and r.outputs \
                    and r.outputs[0].ndim and r.outputs[0].shape[0] == batch:
                todo.extend(r.outputs)
            elif r.name == "index" and r.inputs[0] is not t and r.inputs[0].ndim and \
                    r.inputs[0].shape[0] == batch and isinstance(r.args[1], (list, tuple)) and \
                    r.args[1] and r.args[1][0] is t and all(x is not t for x in r.args[1][1:]):
                continue
            else:
                return False
    return True
