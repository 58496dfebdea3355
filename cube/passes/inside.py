"""Op pieces that communicate inside their own call.

A piece split along a factor its annotation marks ``~`` cannot run as the same
ATen op on its block alone: a convolution's block of output reads a halo of
its neighbours' input, a batch norm normalizes by statistics of the whole
batch. Such a piece's call becomes a runtime function that does the
communication itself (``OpInfo.inside`` names the kind; ``KINDS`` maps it to
the planner below). The planner decides everything the call needs, as data:
for each split factor the ranks of its group in block order and this rank's
position, the windows each block reads, the op's arguments for one piece;
and what moves (bytes to each neighbour, bytes all-reduced) for the
simulator and the report. Ring attention (``"ring"``) is one more kind, and so are
``flex_attention``'s keys and values gathered along the sequence (``"gather_kv"``), and
Megatron's vocabulary-parallel embedding and cross entropy (``"vocab_lookup"``,
``"vocab_loss"``), whose outputs lack the split factor: whole on every piece, and a cumsum
split along its dim (``"scan"``: each piece adds the totals of the blocks before it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from cube.errors import CubeInternalError
from cube.ir import halo, ring
from cube.ir.experts import EXPERTS, TOKENS
from cube.ir.layout import PieceLayout, box_shape
from cube.ir.operator import IRFwOperation, IROperator
from cube.ir.ops import op_info

Ranks = Tuple[int, ...]


@dataclass(frozen=True)
class Inside:
    """The call of a piece that communicates inside it.

    Attributes:
        fn: the runtime function (``runtime.halo.stencil``), or None to call ``args[0]`` (an ATen op)
            on the rest: a piece whose blocks read only themselves but whose arguments change.
        args, kwargs: its arguments (``IRTensor``s, ATen ops and constants; printed by codegen).
        groups: process groups the call's collectives use (made on every rank at start-up).
        p2p: ``(peer, bytes)`` this rank sends each neighbour in forward; backward receives the
            same amounts back.
        recvs: ``(peer, bytes)`` this rank receives from each neighbour in forward (and sends back
            in backward).
        all_reduce: bytes all-reduced over ``groups[0]`` in forward (and again in backward, unless
            ``bw_all_reduce`` says otherwise).
        bw_all_reduce: bytes all-reduced over ``groups[0]`` in backward, where not ``all_reduce``
            (a vocabulary-parallel piece: 0, its backward is local); None: ``all_reduce``.
        bw_p2p, bw_recvs: backward's ``(peer, bytes)`` sent and received, where backward is not
            forward's messages the other way (ring attention sends on around the ring); None: it is.
        reorder: ``(peer, forward bytes, backward bytes)`` sent to put blocks in another order and
            back (ring attention's zigzag load balancing), apart from the messages above;
            ``reorder_recvs`` the same received.
        rounds: the messages go in this many equal rounds, each overlapping ``1 / (rounds + 1)``
            of the compute (a ring's steps); 1: all before the compute (a halo).
        work: the piece's compute relative to the op on its blocks alone (a ring rank's queries
            meet every key block: the number of blocks).
        counts: a mean loss over valid targets: the generated code passes the global count
            (``count=``) or the ranks whose pieces of the batch sum it (``count_ranks=``).
        all_gather: bytes of the whole tensors all-gathered over ``groups[0]`` in forward, whose
            gradients are reduce-scattered back in backward (``flex_attention`` split along the
            sequence: its keys and values).
        all_to_all: bytes of this rank's rows each all-to-all over ``groups[0]`` takes (a split MoE
            layer: the dispatch before its experts' compute and the combine after, and their adjoints
            in backward), under a balanced router; ``experts``: the per-expert row counts exchanged
            before the dispatch (an all-to-all of that many integers).
    """

    fn: Optional[str]
    args: tuple
    kwargs: dict = field(default_factory=dict)
    groups: Tuple[Ranks, ...] = ()
    p2p: Tuple[Tuple[int, int], ...] = ()
    recvs: Tuple[Tuple[int, int], ...] = ()
    all_reduce: int = 0
    bw_p2p: Optional[Tuple[Tuple[int, int], ...]] = None
    bw_recvs: Optional[Tuple[Tuple[int, int], ...]] = None
    reorder: Tuple[Tuple[int, int, int], ...] = ()
    reorder_recvs: Tuple[Tuple[int, int, int], ...] = ()
    rounds: int = 1
    work: float = 1.0
    bw_all_reduce: Optional[int] = None
    counts: bool = False
    all_to_all: int = 0
    experts: int = 0
    all_gather: int = 0


def _inside_splits(p: IROperator) -> List[Tuple[int, str, int, int]]:
    return [(lv, f, i, n) for lv, (f, i, n) in enumerate(p.splits) if p.anno.ident(f).inside]


def _key(p: IROperator, r: int, drop) -> tuple:
    """What a piece shares with the other members of its group: every split but the dropped
    factors', its replicas, and its position among the devices holding it."""
    return (tuple(s for s in p.splits if not drop(s[0])), p.replicas, p.device.index(r))


def _position(p: IROperator, factor: str) -> Tuple[int, int]:
    """(index, number) of the piece's block along ``factor`` over all partitions of it."""
    index, num = 0, 1
    for f, i, n in p.splits:
        if f == factor:
            index, num = index * n + i, num * n
    return index, num


def group_of(by: Dict[int, IROperator], r: int, factors) -> Ranks:
    """The ranks whose pieces differ from rank ``r``'s only along ``factors``, in block order."""
    p = by[r]
    mine = _key(p, r, lambda f: f in factors)
    members = [q for q, o in by.items() if _key(o, q, lambda f: f in factors) == mine]
    return tuple(sorted(members, key=lambda q: [_position(by[q], f)[0] for f in factors]))


def _halo(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    root = op.root
    specs, split, exchanged, p2p, recvs = _exchanges(op, by, r, layout)
    target, args, kwargs = halo.local_args(op, split, exchanged, box_shape(layout.outputs[0]),
                                            box_shape(layout.inputs[0]))
    args = [target] + args
    if not specs:
        return Inside(None, tuple(args), kwargs)
    kwargs = dict(kwargs, halo=tuple(specs), fill=halo.fill(root))
    return Inside("runtime.halo.stencil", tuple(args), kwargs, p2p=tuple(sorted(p2p.items())),
                  recvs=tuple(sorted(recvs.items())))


def _exchanges(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout):
    """What a piece split along its ``~`` spatial dims exchanges.

    Returns:
        ``(specs, split, exchanged, p2p, recvs)``: one ``(dim, ranks, position, windows)`` per
        exchanged dim, the split dims of input 0, those whose window leaves the block, and the
        bytes sent to / received from each peer in forward.
    """
    root = op.root
    factors = sorted({f for _, f, _, _ in _inside_splits(op)})
    specs, split, exchanged = [], [], []
    shape = list(box_shape(layout.inputs[0]))
    itemsize = root.inputs[0].dtype.itemsize
    p2p: Dict[int, int] = {}
    recvs: Dict[int, int] = {}
    for d in sorted(d for f in factors for d in halo.split_dims(root, f)):
        f = root.anno.inputs[0][d].head.name
        pos, num = _position(op, f)
        split.append(d)
        if not halo.needs_exchange(root, d, num):
            continue
        ranks = group_of(by, r, (f,))
        if len(ranks) != num:
            raise CubeInternalError(f"{root.name} ({root.where()}): group {ranks} of {num} blocks along {f!r}")
        wins = halo.windows(root, d, num)
        block = shape[d]
        for q, (a, b) in enumerate(wins):   # what each other block reads of mine
            lo, hi = max(a, pos * block), min(b, (pos + 1) * block)
            if q != pos and lo < hi:
                p2p[ranks[q]] = p2p.get(ranks[q], 0) + math.prod(shape) // block * (hi - lo) * itemsize
            lo, hi = max(wins[pos][0], q * block), min(wins[pos][1], (q + 1) * block)   # what mine reads of q's
            if q != pos and lo < hi:
                recvs[ranks[q]] = recvs.get(ranks[q], 0) + math.prod(shape) // block * (hi - lo) * itemsize
        specs.append((d, ranks, pos, wins))
        exchanged.append(d)
        shape[d] = wins[pos][1] - wins[pos][0]
    return specs, split, exchanged, p2p, recvs


def _transposed(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """A transposed convolution's piece: the op without padding (nor output padding) along its
    split dims on its window, then its block cropped out of the window's larger output."""
    root = op.root
    specs, split, _, p2p, recvs = _exchanges(op, by, r, layout)
    out = box_shape(layout.outputs[0])
    target, args, kwargs = halo.local_args(op, split, split, out, box_shape(layout.inputs[0]))
    crop = []
    for d in split:
        pos, num = _position(op, root.anno.inputs[0][d].head.name)
        st = halo.stencil(root, d)
        o0 = pos * out[d]
        crop.append((d, st.crop(o0, o0 + out[d]), out[d]))
    kwargs = dict(kwargs, halo=tuple(specs), fill=0.0, crop=tuple(crop))
    return Inside("runtime.halo.stencil", (target, *args), kwargs, p2p=tuple(sorted(p2p.items())),
                  recvs=tuple(sorted(recvs.items())))


def _linear(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """A linear interpolation's piece: its window's rows interpolated at the global coordinates
    (``runtime.halo.linear``)."""
    root = op.root
    specs, split, _, p2p, recvs = _exchanges(op, by, r, layout)
    x = root.inputs[0]
    out = box_shape(layout.outputs[0])
    axes = []
    for d in range(x.ndim - halo.spatial(root), x.ndim):
        st = halo.stencil(root, d)
        start = 0
        if d in split:
            start = _position(op, root.anno.inputs[0][d].head.name)[0] * out[d]
        axes.append((d, st.size_in, st.size_out, st.scale, start, out[d]))
    kwargs = dict(align_corners=bool(halo.linear_align(root)), axes=tuple(axes), halo=tuple(specs))
    return Inside("runtime.halo.linear", (op.inputs[0],), kwargs, p2p=tuple(sorted(p2p.items())),
                  recvs=tuple(sorted(recvs.items())))


def _stats(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    root = op.root
    names = [a.name for a in root.target._schema.arguments]
    training = root.args[names.index("training")] if len(root.args) > names.index("training") else \
        root.kwargs.get("training", False)
    if not training:   # normalized by the running statistics: nothing to sum
        return None
    factors = tuple(sorted({f for _, f, _, _ in _inside_splits(op)}))
    ranks = tuple(sorted(group_of(by, r, factors)))
    if len(ranks) < 2:
        return None
    channels = box_shape(layout.inputs[0])[1]
    # one all-reduce of (sums, sums of squares, count) per channel, in double precision
    return Inside("runtime.sync_norm.batch_norm", tuple(op.args), dict(op.kwargs, ranks=ranks), groups=(ranks,),
                  all_reduce=(2 * channels + 1) * 8)


def _group_stats(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """Group / instance norm: one all-reduce of (sum, sum of squares, count) per sample and group
    over the pieces that split its spatial dims (and its batch, when an instance norm's running
    statistics need the whole batch: each piece fills its samples' rows of the global batch)."""
    root = op.root
    names = [a.name for a in root.target._schema.arguments]
    if "use_input_stats" in names:   # instance norm
        i = names.index("use_input_stats")
        if not (root.args[i] if len(root.args) > i else root.kwargs.get("use_input_stats", False)):
            return None   # normalized by the running statistics: nothing to sum
    factors = tuple(sorted({f for _, f, _, _ in _inside_splits(op)}))
    ranks = tuple(sorted(group_of(by, r, factors)))
    if len(ranks) < 2:
        return None
    n, c = box_shape(layout.inputs[0])[:2]
    batch = root.anno.inputs[0][0].head.name
    start, total = 0, n
    if root.anno.ident(batch).inside:
        start, total = _position(op, batch)[0] * n, root.inputs[0].shape[0]
    groups = c if "num_groups" not in names else \
        (root.args[1] if len(root.args) > 1 else root.kwargs["num_groups"])
    return Inside(f"runtime.sync_norm.{root.name}", tuple(op.args), dict(op.kwargs, ranks=ranks, batch=(start, total)),
                  groups=(ranks,), all_reduce=total * groups * 3 * 8)


def _ring(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """Ring attention (``cube.runtime.ring``): q, k and v split alike along the sequence; the
    key/value blocks go around the ring of the split group, ``n - 1`` hops forward, and in backward
    ``n - 1`` hops again with their gradients ``n`` hops. Under a causal mask the blocks are put in
    zigzag order and back (``reorder``): cube's layouts hold contiguous blocks, and every op but
    attention is indifferent to the order of tokens, so only this call pays for the balance. A
    mask tensor's rows stay with their queries (under zigzag they move with them, and the
    gradient of a mask that needs one moves back); its blocks stay contiguous (whether it is
    causal is data), and chunk pairs it hides wholly are skipped at run time. A mask's gradient
    (a learned position bias) is computed on its rows where they are: nothing more travels."""
    root = op.root
    _, pos, n, ranks = _one_factor(op, by, r)
    names = [a.name for a in root.target._schema.arguments]
    arg = dict(zip(names, root.args), **root.kwargs)
    causal, scale = bool(arg.get("is_causal", False)), arg.get("scale")
    q, k, v, out = (box_shape(b) for b in (*layout.inputs[:3], layout.outputs[0]))
    itemsize = root.inputs[0].dtype.itemsize
    kv = (math.prod(k) + math.prod(v)) * itemsize   # one block of k and v
    nxt, prv = ranks[(pos + 1) % n], ranks[(pos - 1) % n]
    kwargs = dict(ranks=ranks, pos=pos, causal=causal, scale=scale, balance=causal)
    reorder, reorder_recvs = [], []
    if causal and n > 1:   # the chunks of q, k, v go to zigzag order and the output's back
        home, zig = ring.contiguous(n), ring.zigzag(n)
        qkv_chunk = (math.prod(q) + math.prod(k) + math.prod(v)) * itemsize // 2
        out_chunk = math.prod(out) * itemsize // 2
        # the mask's rows go with the queries (when it has rows), its gradient back when it needs one
        mask = root.inputs[3] if len(root.inputs) > 3 and root.inputs[3].shape[-2] != 1 else None
        rows = 0 if mask is None else math.prod(box_shape(layout.inputs[3])) * mask.dtype.itemsize // 2
        fw_in, bw_in = qkv_chunk + rows, qkv_chunk + (rows if mask is not None and mask.requires_grad else 0)
        (se, re_), (sx, rx) = ring.moves(home, zig, pos), ring.moves(zig, home, pos)
        for p in sorted(set(se) | set(sx)):   # backward: the output's gradient in, q, k, v's (and the mask's) out
            reorder.append((ranks[p], se.get(p, 0) * fw_in + sx.get(p, 0) * out_chunk,
                            se.get(p, 0) * out_chunk + sx.get(p, 0) * bw_in))
        for p in sorted(set(re_) | set(rx)):
            reorder_recvs.append((ranks[p], re_.get(p, 0) * fw_in + rx.get(p, 0) * out_chunk,
                                  re_.get(p, 0) * out_chunk + rx.get(p, 0) * bw_in))
    args = tuple(op.inputs[:4])   # q, k, v and a mask's rows (they stay: only keys and values travel)
    return Inside("runtime.ring.attention", args, kwargs,
                  p2p=((nxt, (n - 1) * kv),), recvs=((prv, (n - 1) * kv),),
                  bw_p2p=((nxt, (2 * n - 1) * kv),), bw_recvs=((prv, (2 * n - 1) * kv),),
                  reorder=tuple(reorder), reorder_recvs=tuple(reorder_recvs), rounds=n - 1, work=float(n))


def _gather_kv(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """``flex_attention`` split along the sequence (``cube.runtime.flex``), as torch's context parallel
    runs it: each rank keeps its block of queries, the keys and values are all-gathered along the
    sequence inside the call (their gradients reduce-scattered back in backward), and the block mask's
    rows for those queries are read with the score and mask functions seeing global query indices
    (``q_start`` in the op's spec). Blocks stay contiguous, so under a causal mask the last rank's
    queries meet the most keys: no load balancing (ring attention's zigzag) here."""
    import json
    root = op.root
    _, _, n, ranks = _one_factor(op, by, r)
    xs, spec = op.args[:2]
    start = layout.inputs[0][-2][0]   # this piece's first query
    spec = json.dumps(dict(json.loads(spec), q_start=start))
    k, v = (box_shape(b) for b in layout.inputs[1:3])
    kv = (math.prod(k) * root.inputs[1].dtype.itemsize + math.prod(v) * root.inputs[2].dtype.itemsize) * n
    return Inside("runtime.flex.attention", (list(xs), spec), dict(ranks=ranks), groups=(ranks,),
                  all_gather=kv, work=float(n))


def _one_factor(op: IRFwOperation, by: Dict[int, IROperator], r: int) -> Tuple[str, int, int, Ranks]:
    """``(factor, position, blocks, ranks)`` of a piece split along its one ``~`` factor (a sequence, a
    vocabulary, a scanned dim, the experts): this piece's block along it, how many blocks, and the
    ranks of its group in block order.

    Raises:
        CubeInternalError: the group does not hold one piece per block.
    """
    (f,) = sorted({f for _, f, _, _ in _inside_splits(op)})
    pos, n = _position(op, f)
    ranks = group_of(by, r, (f,))
    if len(ranks) != n:
        raise CubeInternalError(f"{op.name} ({op.root.where()}): group {ranks} of {n} blocks along {f!r}")
    return f, pos, n, ranks


def _one_group(op: IRFwOperation, by: Dict[int, IROperator], r: int) -> Ranks:
    """The ranks of a piece split along its one ``~`` factor, in block order."""
    return _one_factor(op, by, r)[3]


def _vocab_lookup(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """An embedding holding a block of its table's rows (``cube.runtime.vocab.embedding``): the ids
    in its range looked up, the pieces' outputs summed by one all-reduce; backward is local."""
    ranks = _one_group(op, by, r)
    out = math.prod(box_shape(layout.outputs[0])) * op.root.outputs[0].dtype.itemsize
    return Inside("runtime.vocab.embedding", tuple(op.args), dict(op.kwargs, ranks=ranks, start=layout.inputs[0][0][0]),
                  groups=(ranks,), all_reduce=out, bw_all_reduce=0)


def _vocab_loss(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """A cross entropy holding a block of the classes (``cube.runtime.vocab.cross_entropy``): per row
    one all-reduce of the maximum, one of the sum of exponentials and the target's logit (and the sum
    of logits under label smoothing), in float32; backward is local."""
    root = op.root
    ranks = _one_group(op, by, r)
    names = [a.name for a in root.target._schema.arguments]
    arg = dict(zip(names, root.args), **root.kwargs)
    rows = math.prod(box_shape(layout.inputs[1]))
    stats = 3 + (1 if arg.get("label_smoothing", 0.0) else 0)   # max, sum of exp, target's logit, sum
    return Inside("runtime.vocab.cross_entropy", tuple(op.args),
                  dict(op.kwargs, ranks=ranks, start=layout.inputs[0][1][0], classes=root.inputs[0].shape[1]),
                  groups=(ranks,), all_reduce=rows * stats * 4, bw_all_reduce=0,
                  counts=arg.get("reduction", 1) == 1)


def _scan(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """A cumsum split along its dim (``cube.runtime.scan.cumsum``): the local cumsum plus the totals
    of the blocks before it; one all-reduce of every block's totals (``(n, *slice)`` in the dtype it
    computes in) in forward, and one of the gradient's totals in backward when its input needs one."""
    root = op.root
    f, _, _, ranks = _one_factor(op, by, r)
    out = box_shape(layout.outputs[0])
    dim = next(k for k, d in enumerate(root.anno.outputs[0]) if d.head is not None and d.head.name == f)
    x = root.inputs[0]
    nbytes = len(ranks) * math.prod(out) // out[dim] * root.outputs[0].dtype.itemsize
    grad = x.requires_grad and x.dtype.is_floating_point   # the gradient's totals: in the output's dtype
    return Inside("runtime.scan.cumsum", tuple(op.args), dict(op.kwargs, ranks=ranks, pos=_position(op, f)[0]),
                  groups=(ranks,), all_reduce=nbytes, bw_all_reduce=nbytes if grad else 0)


def _experts(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """A fused MoE layer split by experts (``cube.runtime.experts.moe``): this rank's tokens go to
    the ranks holding their experts by one all-to-all (split sizes exchanged first) and come back by
    another. How many rows go where is data; ``all_to_all`` is this rank's (token, expert) rows, the
    input of each all-to-all, of which a balanced router sends ``(n - 1) / n`` away (the simulator
    prices it, and a busiest rank receiving more, ``cube.sim.program``)."""
    root = op.root
    f, _, _, ranks = _one_factor(op, by, r)
    w = next(i for i, t in enumerate(root.inputs) if t.kind.value == "param")
    first, stop = layout.inputs[w][0]
    rows = box_shape(layout.outputs[0])   # the piece's output rows; each comes from ``pairs`` (token, expert) rows
    nbytes = math.prod(rows) * root.kwargs.get("pairs", 1) * root.outputs[0].dtype.itemsize
    kwargs = dict(root.kwargs, ranks=ranks, first=first, local=stop - first)
    groups: Tuple[Ranks, ...] = (ranks,)
    if root.kwargs.get("capacity") is not None:   # the per-expert counts of every block of the batch
        batch = group_of(by, r, (TOKENS, f))
        kwargs.update(batch=batch, start=layout.inputs[0][0][0])
        groups = (ranks, batch) if batch != ranks else groups
    return Inside("runtime.experts.moe", tuple(op.inputs), kwargs, groups=groups, all_to_all=nbytes,
                  experts=root.kwargs.get("experts", 0))


def _experts_whole(op: IRFwOperation) -> Inside:
    """A fused MoE layer not split by experts: its program on the piece's tokens, all experts
    here. Capacity mode split along the tokens would cut each rank's capacity from its own tokens
    alone: refused."""
    root = op.root
    if root.kwargs.get("capacity") is not None and any(f == TOKENS and n > 1 for f, _, n in op.splits):
        raise ValueError(f"{root.name} ({root.where()}): a capacity-factor MoE layer split along its tokens must "
                         f"also split its experts over those ranks (capacity counts the whole batch's tokens); "
                         f"plan it with PASMegatron(ep=dp, capacity_factor=...) or run it on one device")
    return Inside("runtime.experts.moe", tuple(op.inputs), dict(root.kwargs))


KINDS: Dict[str, Callable[[IRFwOperation, Dict[int, IROperator], int, PieceLayout], Optional[Inside]]] = {
    "halo": _halo, "stats": _stats, "ring": _ring,
    "halo_transposed": _transposed, "halo_linear": _linear, "group_stats": _group_stats,
    "vocab_lookup": _vocab_lookup, "vocab_loss": _vocab_loss, "experts": _experts, "gather_kv": _gather_kv,
    "scan": _scan,
}


def plan_inside(op: IRFwOperation, by: Dict[int, IROperator], r: int, layout: PieceLayout) -> Optional[Inside]:
    """The communicating call of rank ``r``'s piece ``op`` (``by``: the pieces of its op by rank), or
    None when the piece is an ordinary call.

    Raises:
        CubeInternalError: the op splits a ``~`` factor but has no ``OpInfo.inside`` kind.
    """
    if not isinstance(op, IRFwOperation) or op.anno is None:
        return None
    if not _inside_splits(op):
        return _experts_whole(op) if op.name == EXPERTS else None
    kind = op_info(op.name).inside
    if kind not in KINDS:
        raise CubeInternalError(f"{op.name} ({op.root.where()}): split along a '~' factor without a planner "
                                f"(OpInfo.inside={kind!r})")
    return KINDS[kind](op, by, r, layout)
