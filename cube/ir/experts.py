"""Dropless expert parallel on MoE layers that sort their tokens by expert (``moe_experts``).

Hugging Face's default experts kernel (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) sorts the (token,
expert) pairs of the batch by expert, gathers each pair's token row, runs every expert's rows
through grouped matmuls over its ``(E, ., .)`` weights, weights the rows and puts them back in
the pairs' order. ``cube.ir.dispatch`` proves such a region token-local; :func:`fuse_experts`
turns each proved region into one op, ``moe_experts``, whose arguments carry the region's own
ops as a small program (ATen calls over numbered slots, printed in the generated code). Its
annotation splits the tokens along the batch (``t``) and the experts along their leading dim
(``e~``): a split of ``e`` over an expert-parallel group also gives each rank its block of the
group's tokens, and the piece communicates inside its call (``cube.runtime.experts``): it runs
the program on its own tokens up to the first grouped matmul, sends each row to the rank
holding its expert by an all-to-all whose split sizes are exchanged first (data-dependent, no
token dropped), runs the experts' part of the program on the rows it received (its experts'
weights only), returns them by the adjoint all-to-all and runs the rest on its own tokens.
Every pair's row is computed by the same ops as on one device and returned to its place, so the
result is the single device's (up to the grouping of rows in a matmul).

The experts' part (the *body*) is what lies between the first and last grouped matmul on the
way from the gathered rows: it may read only the gathered rows, the group offsets and the
expert weights (through transposes and casts); anything else (a routing weight applied before
the last grouped matmul, an expert weight read outside the body) is refused with the op named. A
per-expert bias gathered by the sorted expert ids before the body (GPT-OSS's ``bias[ids]``) is
read there as a row per pair: the fused op then runs on each rank's own tokens with every expert
(data, sequence, tensor splits), and an expert split of it is refused.
"""
from __future__ import annotations

import logging
import math
from typing import Dict, List, Optional, Set, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir.annotation import parse
from cube.ir.dispatch import Region
from cube.ir.graph import IRGraph, makers as graph_makers, readers as graph_readers
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind

EXPERTS = "moe_experts"
_GROUPED = frozenset("_grouped_mm grouped_mm_fallback".split())
_CASTS = frozenset("to _to_copy contiguous clone alias".split())
_PARAM_CHAIN = frozenset("transpose t permute to _to_copy contiguous clone alias".split())
TOKENS, EXPERT = "t", "e"   # the annotation's letters (cube.ir.layout ties them under a split of e)


def fuse_experts(graph: IRGraph, num: int, capacity_factor: Optional[float] = None) -> List[IRFwOperation]:
    """Replaces every proved sort-dispatch MoE region of ``graph`` by one ``moe_experts`` op.

    Args:
        num: the data parallel degree the batch is split over (the proof follows that split).
        capacity_factor: None: dropless; a positive number ``c``: each expert takes at most
            ``ceil(c * T * k / E)`` of the batch's ``T * k`` (token, expert) pairs, kept in their
            tokens' order in the batch, the rest dropped (``cube.runtime.experts``).

    Returns:
        The fused ops, in program order.

    Raises:
        ValueError: the graph has no sort-dispatch region, or one cube cannot prove token-local
            or cannot split by experts (naming the op and why).
    """
    regions, unproven = _regions(graph, max(num, 2))
    if unproven:
        raise ValueError("expert parallel: cube could not prove a token sort of the MoE layer token-local: "
                         + "; ".join(unproven))
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or
                                        not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0):
        raise ValueError(f"expert parallel: capacity_factor={capacity_factor!r} must be a positive number (each "
                         f"expert takes ceil(capacity_factor * tokens * top_k / experts) pairs) or None (dropless)")
    fused = [_fuse(graph, r, capacity_factor) for r in regions]
    return _tokens_back(graph) if capacity_factor is None else fused


def fuse_local(graph: IRGraph, num: int) -> List[IRFwOperation]:
    """Replaces every sort-dispatch MoE region of ``graph`` that ``batch_flow`` proves token-local
    and :func:`_fuse` can write as a program by one dropless ``moe_experts`` op, so that a split
    of the batch over ``num`` ranks runs it on each rank's own tokens, all experts on every rank
    (``cube.passes.inside._experts_whole``). A region cube cannot prove or fuse is left as it is:
    the batch split then runs it whole on the tokens gathered, and reports it (``cube.ir.lost``).

    Returns:
        The fused ops, in program order.
    """
    if num < 2 or graph.stages or not has_sort(graph):
        return []   # after staging the stages hold the region's ops: fuse before graph.staging
    fused = []
    for region in _regions(graph, num)[0]:   # the proved ones; the others stay as they are
        try:
            fused.append(_fuse(graph, region))
        except ValueError as why:   # not a program cube can run on a piece of the tokens: the region
            logging.getLogger("cube").debug("data parallel keeps an MoE layer unfused: %s", why)   # stays
    return _tokens_back(graph) if fused else fused


def _tokens_back(graph: IRGraph) -> List[IRFwOperation]:
    """Gives the fused layers of ``graph`` and the row-wise ops around them (the router) the dims
    of the tokens back: ``(B, S, H)`` where the model viewed them as ``(B * S, H)``
    (``cube.trace.rows``, run again now that each layer is one op), so that a split of the sequence
    (sequence or context parallel) reaches them. Returns the fused ops, in program order."""
    from cube.trace.rows import unflatten_rows   # a trace pass (cube.trace imports this module)
    from cube.trace.rules import REGISTRY
    new = unflatten_rows(graph, REGISTRY)
    if new is not graph:
        graph.ops = new.ops
        graph._pos = {}
    return expert_ops(graph)


def has_sort(graph: IRGraph) -> bool:
    """Whether ``graph`` sorts anything (a sort-dispatch MoE layer sorts its tokens by expert)."""
    return any(op.name in ("sort", "argsort") for op in graph.select(ntype=IRFwOperation))


def _regions(graph: IRGraph, num: int) -> Tuple[List[Region], List[str]]:
    """The sort-dispatch regions ``batch_flow`` proves token-local under a batch split over ``num``
    ranks, in program order, and why the others are not."""
    from cube.ir.follow import batch_flow   # follow imports dispatch; keep the import graph acyclic
    flow = batch_flow(graph, num)
    regions = list({id(r): r for r in flow.local.values()}.values())
    pos = {id(op): i for i, op in enumerate(graph.ops)}
    regions.sort(key=lambda r: pos[id(r.sort)])
    return regions, list(flow.unproven.values())


def _refuse(op: IRFwOperation, why: str) -> ValueError:
    return ValueError(f"expert parallel: op {op.name!r} ({op.where()}) {why}; cube splits only MoE layers whose "
                      f"experts are grouped matmuls over (E, ., .) weights reached by the gathered token rows "
                      f"alone. Drop ep= for this model (its experts then stay whole on every rank)")


def _fuse(graph: IRGraph, region: Region, capacity_factor: Optional[float] = None) -> IRFwOperation:
    ops = list(region.ops)
    inside = {id(op) for op in ops}
    made = {id(t): op for op in ops for t in op.outputs}
    makers = {k: op for k, op in graph_makers(graph.ops).items() if isinstance(op, IRFwOperation)}
    readers = graph_readers(graph.ops)
    # the expert weights' transposes and casts join the op: it reads the parameters themselves
    _join_makers(ops, inside, made, makers, lambda m, t: (
        m.name in _PARAM_CHAIN and len(m.inputs) == 1 and
        (m.inputs[0].kind is TensorKind.PARAM or id(m.inputs[0]) in made or _param_chain(m.inputs[0], makers)) and
        all(id(r) in inside for r in readers.get(id(t), ()))))
    order = {id(op): i for i, op in enumerate(graph.ops)}
    ops.sort(key=lambda o: order[id(o)])
    scaled = set(region.scaled)
    prefix, outputs, views = _token_views(region, ops, inside, made, makers, readers, scaled)
    first = {id(op) for op in prefix}   # the views first: after the ops they read, before the recounts
    ops = [op for op in ops if id(op) in first] + [op for op in ops if id(op) not in first]
    grouped = [op for op in ops if op.name in _GROUPED]
    if not grouped:
        raise _refuse(region.sort, "sorts the tokens by expert but no grouped matmul computes the experts")
    offs = grouped[0].args[2] if len(grouped[0].args) > 2 else grouped[0].kwargs.get("offs")
    experts = grouped[0].args[1].shape[0]
    x = grouped[0].args[0]
    while id(x) in made and made[id(x)].name in _CASTS and len(made[id(x)].inputs) == 1:
        x = made[id(x)].inputs[0]   # the rows before their casts (each grouped matmul may cast them again)
    # the body: from the gathered rows through the grouped matmuls
    flowing, body = {id(x)}, []
    first = min(order[id(r)] for r in readers.get(id(x), ()) if id(r) in inside)
    last = order[id(grouped[-1])]
    for op in ops:
        if first <= order[id(op)] <= last and any(id(t) in flowing for t in op.inputs):
            body.append(op)
            flowing.update(id(t) for t in op.outputs)
    weights: List[IRTensor] = []
    params = {}
    for op in ops:
        for t in op.inputs:
            if t.kind is TensorKind.PARAM:
                params[id(t)] = t
    chain = {id(t) for op in ops if op.name in _PARAM_CHAIN and id(op) not in {id(b) for b in body}
             and all(s.kind is TensorKind.PARAM or id(s) in made for s in op.inputs) for t in op.outputs}
    for g in grouped:
        if g not in body:
            raise _refuse(g, "is a grouped matmul the gathered token rows do not reach")
    body_ids = {id(op) for op in body}
    by_id = _by_id(ops, body_ids, made, chain, params, experts)
    for op in body:
        for t in op.inputs:
            if id(t) in flowing or t is offs or id(t) in chain or id(t) in params or id(t) in by_id:
                continue
            raise _refuse(op, f"reads a tensor of shape {list(t.shape)} in the experts' part that is neither the "
                              f"gathered rows, the group offsets nor an expert weight (each rank computes only the "
                              f"rows it receives)")
    y = grouped[-1].outputs[0]
    for op in body:
        for t in op.outputs:
            outside = [r for r in readers.get(id(t), ()) if id(r) not in body_ids]
            if t is not y and outside:
                raise _refuse(outside[0], "reads an intermediate value of the experts' part")
    for r in readers.get(id(x), ()):
        if id(r) not in body_ids:
            raise _refuse(r, "reads the gathered rows outside the experts' part")
    for p in params.values():
        if p.ndim < 2 or p.shape[0] != experts:
            raise _refuse(grouped[0], f"reads the parameter {p.names[0] if p.names else p!r} of shape "
                                      f"{list(p.shape)}, not one (E={experts}, ...) expert weight")
        for r in readers.get(id(p), ()):
            if id(r) not in inside:
                raise _refuse(r, f"reads the expert weight {p.names[0] if p.names else ''} outside the MoE layer")
        for op in ops:
            if p in op.inputs and id(op) not in body_ids and op.name not in _PARAM_CHAIN and \
                    not any(id(t) in by_id for t in op.outputs):
                raise _refuse(op, "reads an expert weight outside the grouped matmuls other than by the sorted "
                                  "expert ids")
        weights.append(p)
    # external inputs in order: token tensors first, then the expert weights
    externals: List[IRTensor] = []
    for op in ops:
        for t in op.inputs:
            if id(t) in region.recount:   # counted again from this rank's ids (below)
                continue
            if id(t) not in made and t.kind is not TensorKind.PARAM and all(t is not e for e in externals):
                externals.append(t)
    for t in externals:
        if id(t) not in scaled or t.ndim < 1:
            raise _refuse(next(op for op in ops if t in op.inputs),
                          f"reads a tensor of shape {list(t.shape)} that is neither a token tensor of the batch nor "
                          f"an expert weight")
    for op in ops:
        for t in op.outputs:
            if t not in outputs and any(id(r) not in inside for r in readers.get(id(t), ())):
                raise _refuse(op, "makes a value read outside the MoE layer other than its output rows")
    inputs = externals + weights
    slot: Dict[int, int] = {id(t): i for i, t in enumerate(inputs)}
    program = []

    def emit(op: IRFwOperation) -> None:
        for t in op.outputs:
            slot[id(t)] = len(slot)
        args = _refs(op.args, slot, op)
        if id(op) in views and op.name != "flatten":   # the piece's own number of tokens
            args = (args[0], [-1, *args[1][1:]]) + tuple(args[2:])
        if id(op) in region.sizes:   # arange(M): on a rank, the number of its pairs (the sorted ids' length)
            args = tuple(f"#{slot[id(region.sort.inputs[0])]}" if a == region.sizes[id(op)] else a for a in args)
        program.append((op.target, args, _refs(op.kwargs, slot, op), tuple(slot[id(t)] for t in op.outputs)))

    for op in ops[:len(prefix)]:   # the views of the token rows into pairs, then the recounts from the pairs' ids
        emit(op)
    ids = region.sort.inputs[0]
    for t in {id(op.args[2] if len(op.args) > 2 else op.kwargs.get("offs")): None for op in grouped}:
        if t in region.recount:   # group offsets counted over the whole batch: this rank's own, from its ids
            groups, dtype = region.recount[t]
            counts = len(slot)
            slot[("counts", t)] = counts
            slot[t] = len(slot)
            program.append((torch.ops.aten.bincount.default, (f"%{slot[id(ids)]}", None, groups), {}, (counts,)))
            program.append((torch.ops.aten.cumsum.default, (f"%{counts}", 0), {"dtype": dtype}, (slot[t],)))
    for op in ops[len(prefix):]:
        emit(op)
    lead = len(program) - len(ops)   # the recounting steps before the region's own (after the views)
    anno = _anno(externals, weights, outputs)
    kwargs = dict(program=tuple(program), dispatch=slot[id(x)], offsets=slot[id(offs)],
                  body=(ops.index(body[0]) + lead, ops.index(body[-1]) + lead), combine=slot[id(y)], experts=experts,
                  outputs=tuple(slot[id(t)] for t in outputs), pairs=max(1, x.shape[0] // outputs[0].shape[0]))
    if by_id:   # its rows are the sorting rank's: an expert split would run the body on rows from other ranks
        kwargs.update(by_id=next(iter(by_id.values())).where())
    if capacity_factor is not None:   # the arrival order inside an expert: the sort's indices
        perm = region.sort.outputs[1] if region.sort.name == "sort" else region.sort.outputs[0]
        kwargs.update(capacity=float(capacity_factor), perm=slot[id(perm)], layer=grouped[0].module_path)
    from cube.runtime.experts import moe
    fused = IRFwOperation(EXPERTS, inputs=inputs, outputs=outputs, target=moe, args=tuple(inputs), kwargs=kwargs,
                          anno=parse(anno, len(inputs)), module_path=grouped[0].module_path, source=grouped[0].source)
    rest = [op for op in graph.ops if id(op) not in inside]
    # after every op making its inputs (some may come after the region's first op: a view of the
    # routing weights taken after the sort), before every op reading its outputs
    at = 1 + max((i for i, op in enumerate(rest) for t in op.outputs if any(t is e for e in externals)),
                 default=-1)
    out_ids = {id(t) for t in outputs}
    first_reader = min((i for i, op in enumerate(rest) if any(id(t) in out_ids for t in op.inputs)),
                       default=len(rest))
    if at > first_reader:   # refused before the graph changes: a caller may keep the region as it is
        raise _refuse(grouped[0], "reads a value made after an op that reads the layer's output")
    rest.insert(at, fused)
    graph.ops = rest
    graph._pos = {}
    return fused


def _by_id(ops: List[IRFwOperation], body: Set[int], made: dict, chain: Set[int], params: dict,
           experts: int) -> Dict[int, IRFwOperation]:
    """The values of one row per sorted pair that the region gathers from an expert weight by the pairs'
    expert ids, before the body, for the body to read (GPT-OSS's per-expert biases,
    ``bias[sorted_ids]``): tensor id -> the ``index`` op making it. A fused layer reading them runs its
    body on the rows its rank sorted, so data, sequence and tensor splits keep it, and an expert split
    is refused (``cube.ir.follow.expert_flow``): it would run the body on rows other ranks sorted."""
    found: Dict[int, IRFwOperation] = {}
    for op in ops:
        if op.name != "index" or id(op) in body or len(op.inputs) != 2 or len(op.outputs) != 1:
            continue
        w, ids = op.inputs
        weight = id(w) in params or id(w) in chain
        if weight and w.shape[0] == experts and id(ids) in made and not ids.dtype.is_floating_point and ids.ndim == 1:
            found[id(op.outputs[0])] = op
    return found


_VIEWS = frozenset("view reshape _unsafe_view flatten".split())
_PAIR_SUMS = frozenset("sum mean amax amin".split())


def _token_views(region: Region, ops: List[IRFwOperation], inside: set, made: dict, makers: dict, readers: dict,
                 scaled: set) -> Tuple[List[IRFwOperation], List[IRTensor], Set[int]]:
    """Joins to ``ops`` the views that turn a token tensor's rows into the region's pairs (Hugging
    Face's ``top_k_index.reshape(-1)``) and the views and reductions over the pairs that give its
    result back one row per token (``.view(T, k, H).sum(dim=1)``), when nothing else reads what they
    read or make: the fused layer then reads and makes one row per token, rows a sequence split
    keeps (``cube.trace.rows``). Each is token-local: a token's rows come from its own rows.

    Returns:
        The views joined before the region (its first ops, after the ops making what they read),
        the layer's outputs and the ids of the views joined (their first size is the piece's own:
        the program views them with ``-1`` there).
    """
    tokens = min(t.shape[0] for op in ops for t in op.inputs + op.outputs if id(t) in region.scaled and t.ndim)

    def local(src: IRTensor, dst: IRTensor) -> bool:   # a row-major view keeping each token's rows together
        return src.ndim >= 1 and dst.ndim >= 1 and src.shape[0] % tokens == 0 and dst.shape[0] % tokens == 0 and \
            math.prod(src.shape) == math.prod(dst.shape)

    prefix = _join_makers(ops, inside, made, makers, lambda m, t: (
        m.name in _VIEWS and len(m.inputs) == 1 and len(m.outputs) == 1 and m.inputs[0].kind is not TensorKind.PARAM
        and id(t) in scaled and local(m.inputs[0], t) and all(id(r) in inside for r in readers.get(id(t), ()))))
    scaled.update(id(m.inputs[0]) for m in prefix)
    after: List[IRFwOperation] = []
    outputs = list(region.outputs)
    changed = True
    while changed:
        changed = False
        for o in list(outputs):
            rs = readers.get(id(o), [])
            if not rs or any(len(r.inputs) != 1 or len(r.outputs) != 1 or r.outputs[0].ndim < 1 or
                             not (r.name in _VIEWS and local(o, r.outputs[0]) or
                                  r.name in _PAIR_SUMS and _off_rows(r) and r.outputs[0].shape[0] == o.shape[0])
                             for r in rs):
                continue
            outputs.remove(o)
            for r in rs:
                _join(r, ops, inside, made)
                after.append(r)
                outputs.append(r.outputs[0])
                scaled.add(id(r.outputs[0]))
            changed = True
    return prefix, outputs, {id(op) for op in prefix + after if op.name in _VIEWS}


def _join_makers(ops: List[IRFwOperation], inside: set, made: dict, makers: dict, accept) -> List[IRFwOperation]:
    """Joins to ``ops`` (and ``inside``, ``made``), until none is left, each op making an input of
    one of them that ``accept(maker, input)`` takes. Returns the ops joined, in the order joined."""
    joined: List[IRFwOperation] = []
    changed = True
    while changed:
        changed = False
        for op in list(ops):
            for t in op.inputs:
                m = makers.get(id(t))
                if m is None or id(m) in inside or not accept(m, t):
                    continue
                _join(m, ops, inside, made)
                joined.append(m)
                changed = True
    return joined


def _join(op: IRFwOperation, ops: List[IRFwOperation], inside: set, made: dict) -> None:
    """Adds ``op`` to the layer's ``ops``, its id to ``inside`` and its outputs to ``made``."""
    ops.append(op)
    inside.add(id(op))
    made.update((id(o), op) for o in op.outputs)


def _off_rows(op: IRFwOperation) -> bool:
    """Whether ``op`` (a reduction) reduces dims other than the first only, keeping them."""
    dim = op.args[1] if len(op.args) > 1 else op.kwargs.get("dim")
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
    nd = op.inputs[0].ndim
    return bool(dims) and all(isinstance(d, int) and d % nd != 0 for d in dims) and op.args[:1] == (op.inputs[0],)


def _param_chain(t: IRTensor, makers: Dict[int, IRFwOperation]) -> bool:
    """Whether ``t`` is a parameter through transposes and casts alone (``w.bfloat16().t()``)."""
    while t.kind is not TensorKind.PARAM:
        m = makers.get(id(t))
        if m is None or m.name not in _PARAM_CHAIN or len(m.inputs) != 1:
            return False
        t = m.inputs[0]
    return True


def _anno(tokens: List[IRTensor], weights: List[IRTensor], outputs: List[IRTensor], lead: int = 1) -> str:
    """The annotation of a fused layer reading ``tokens`` and ``weights``, making ``outputs``: the
    tokens along the leading dim(s), each expert weight along its experts (``e~``), the rest whole."""
    rows = min(math.prod(t.shape[:lead]) for t in tokens + outputs)
    return ", ".join(_dims(t, rows, f"x{i}", lead) for i, t in enumerate(tokens)) + ", " + \
        ", ".join(f"{EXPERT}~ " + " ".join(f"w{i}_{d}^" for d in range(1, p.ndim)) for i, p in enumerate(weights)) + \
        " -> " + ", ".join(_dims(t, rows, f"o{i}", lead) for i, t in enumerate(outputs))


def _dims(t: IRTensor, rows: int, tag: str, lead: int = 1) -> str:
    """``t``'s dims: its rows (``t``, or ``(t kc)`` for ``c`` rows per token; ``t t_1 ...`` for
    ``lead`` dims of tokens), the rest whole."""
    if lead > 1:
        head = " ".join([TOKENS] + [f"{TOKENS}_{j}" for j in range(1, lead)])
    else:
        c = t.shape[0] // rows
        head = TOKENS if c == 1 else f"({TOKENS} k{c})"
    return " ".join([head] + [f"{tag}_{d}^" for d in range(lead, t.ndim)])


def unflatten(op: IRFwOperation, tokens: List[IRTensor], outputs: List[IRTensor]) -> IRFwOperation:
    """``op`` (a dropless ``moe_experts``) on tokens of ``lead`` dims: each token tensor ``(N, ...)``
    given as ``(*lead, ...)``, each output made so (``cube.trace.rows``). The call merges the
    leading dims of its piece of each token tensor and restores them on its outputs: the layer is
    token-wise, so any block of the tokens (a block of the sequence, under a sequence or context
    split) computes its own rows as the layer computes them on all of them.

    Raises:
        CubeInternalError: ``op`` is no dropless fused layer, or the shapes do not match its own.
    """
    w = weights_of(op)
    old = [t for i, t in enumerate(op.inputs) if i not in w]
    lead = tokens[0].ndim - old[0].ndim + 1 if tokens else 0
    shape = tuple(tokens[0].shape[:lead]) if tokens else ()
    if op.name != EXPERTS or op.kwargs.get("capacity") is not None or lead < 2 or len(tokens) != len(old) or \
            any(tuple(t.shape[:lead]) != shape or t.shape[lead:] != o.shape[1:] or o.shape[0] != math.prod(shape)
                for t, o in zip(tokens + outputs, old + list(op.outputs))) or len(outputs) != len(op.outputs):
        raise CubeInternalError(f"{op.name} ({op.where()}): no dropless fused MoE layer on these tokens")
    weights = [op.inputs[i] for i in w]
    inputs = list(tokens) + weights
    kwargs = dict(op.kwargs, lead=lead, tokens=len(tokens))
    return IRFwOperation(EXPERTS, inputs=inputs, outputs=list(outputs), target=op.target, args=tuple(inputs),
                         kwargs=kwargs, anno=parse(_anno(list(tokens), weights, list(outputs), lead), len(inputs)),
                         module_path=op.module_path, source=op.source, grad_enabled=op.grad_enabled,
                         recompute=op.recompute)


def _refs(value, slot: Dict[int, int], op: IRFwOperation):
    """``value`` with each tensor replaced by ``"%k"`` (its slot); ``"#k"`` (a size: the length of
    slot ``k``) is made by the caller."""
    if isinstance(value, IRTensor):
        return f"%{slot[id(value)]}"
    if isinstance(value, str) and value[:1] in ("%", "#"):
        raise _refuse(op, f"takes the string argument {value!r}, which the program's slots would misread")
    if isinstance(value, (list, tuple)):
        out = [_refs(v, slot, op) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, dict):
        return {k: _refs(v, slot, op) for k, v in value.items()}
    return value


def expert_ops(graph: IRGraph) -> List[IRFwOperation]:
    """The fused ``moe_experts`` ops of ``graph``."""
    return graph.select(name=EXPERTS)


def weights_of(op: IRFwOperation) -> Tuple[int, ...]:
    """Indices of ``op``'s expert weights among its inputs."""
    return tuple(i for i, t in enumerate(op.inputs) if t.kind is TensorKind.PARAM)


def tokens_of(op: IRFwOperation) -> Optional[IRTensor]:
    return op.inputs[0] if op.inputs else None
