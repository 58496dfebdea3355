"""Partition annotations per op: the registry and the built-in rules.

A rule maps an op (its tensor inputs/outputs with shapes, and its constant
arguments) to an annotation string (see ``cube.ir.annotation``). Rules are
looked up by op name (``linear``, ``view``, ...). An op without a rule still
runs, replicated; splitting it raises an error that explains how to add one.
"""
from __future__ import annotations

import string

import torch
from typing import Callable, Dict, List, Sequence, Union

from cube.ir import ops
from cube.ir.annotation import OpAnno, parse
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor
from cube.runtime import functions as fn_ops

Rule = Union[str, Callable[[IRFwOperation], str]]

# letters rules use by name (b c e f h k l m n o s v) stay out of the pool of fresh ones
_POOL = [c for c in string.ascii_lowercase if c not in "bcefhklmnosv"]
_LETTERS = _POOL + [f"{c}{i}" for i in range(1, 10) for c in _POOL]


class _Names:
    """Hands out fresh dimension letters for one annotation."""

    def __init__(self):
        self.i = 0

    def __call__(self, frozen: bool = False) -> str:
        name = _LETTERS[self.i]
        self.i += 1
        return name + ("^" if frozen else "")

    def many(self, n: int, frozen: bool = False) -> List[str]:
        return [self(frozen) for _ in range(n)]


def _anno(ins: List[List[str]], outs: List[List[str]]) -> str:
    return ", ".join(" ".join(g) for g in ins) + " -> " + ", ".join(" ".join(g) for g in outs)


def _arg(op: IRFwOperation, i: int, name: str, default=None):
    if len(op.args) > i:
        return op.args[i]
    return op.kwargs.get(name, default)


def _dim(d: int, n: int) -> int:
    return d % n if n else 0


# ----------------------------------------------------------------------------- elementwise
def elementwise(op: IRFwOperation) -> str:
    """Output shape is the broadcast of the inputs; equal dims share a letter."""
    out = op.outputs[0].shape
    names = _Names()
    oletters = names.many(len(out))
    ins = []
    for t in op.inputs:
        g = []
        off = len(out) - t.ndim
        for k, s in enumerate(t.shape):
            o = k + off
            if s == out[o]:
                g.append("1" if s == 1 else oletters[o])
            elif s == 1:
                g.append("1")
            else:
                raise ValueError(f"shape {t.shape} does not broadcast to {out}")
        ins.append(g)
    outs = [["1" if s == 1 else oletters[k] for k, s in enumerate(out)]]
    for extra in op.outputs[1:]:
        if extra.shape != out:
            raise ValueError("outputs of different shapes")
        outs.append(outs[0])
    return _anno(ins, outs)


def _frozen_dims(dims_of: Callable[[IRFwOperation], Sequence[int]]) -> Callable[[IRFwOperation], str]:
    """Elementwise over the first input, except the given dims may not be split."""
    def rule(op: IRFwOperation) -> str:
        x = op.inputs[0]
        frozen = {_dim(d, x.ndim) for d in dims_of(op)}
        names = _Names()
        g = [names(k in frozen) if s != 1 else "1" for k, s in enumerate(x.shape)]
        return _anno([g] + [g] * (len(op.inputs) - 1), [g] * len(op.outputs))
    return rule


def scan(op: IRFwOperation) -> str:
    """``cumsum(x, dim)``: elementwise, and its ``dim`` splits too as a scan across the pieces
    (``~``, ``OpInfo.inside="scan"``): each piece sums its block and adds the totals of the
    blocks before it, exchanged inside its call (``cube.runtime.scan``)."""
    x = op.inputs[0]
    d = _dim(_arg(op, 1, "dim"), x.ndim)
    names = _Names()
    g = ["1" if s == 1 else names() + ("~" if k == d else "") for k, s in enumerate(x.shape)]
    return _anno([g], [g])


# ----------------------------------------------------------------------------- matmul family
def linear(op: IRFwOperation) -> str:
    x = op.inputs[0]
    names = _Names()
    lead = names.many(x.ndim - 1)
    ins = [lead + ["k+"], ["n", "k+"]]
    if len(op.inputs) == 3:
        ins.append(["n"])
    return _anno(ins, [lead + ["n"]])


def addmm(op: IRFwOperation) -> str:
    bias = op.inputs[0]
    bg = ["m", "n"][2 - bias.ndim:] if bias.ndim else []
    bg = ["1" if s == 1 else l for s, l in zip(bias.shape, bg)]
    return _anno([bg, ["m", "k+"], ["k+", "n"]], [["m", "n"]])


def baddbmm(op: IRFwOperation) -> str:
    """``beta * input + alpha * (batch1 @ batch2)``, ``(b, m, k) @ (b, k, n)``: the batch, rows and columns
    split, ``input`` broadcasting as an elementwise operand; the reduced ``k`` is whole (a split of it would
    add ``input`` once per piece)."""
    bias = op.inputs[0]
    out = ["b", "m", "n"]
    bg = [("1" if s == 1 else l) for s, l in zip(bias.shape, out[3 - bias.ndim:])]
    return _anno([bg, ["b", "m", "k^"], ["b", "k^", "n"]], [out])


def matmul(op: IRFwOperation) -> str:
    a, b = op.inputs
    out = op.outputs[0]
    if a.ndim < 2 or b.ndim < 2:
        raise ValueError("1-D matmul operands have no rule")
    names = _Names()
    batch = names.many(out.ndim - 2)
    def batch_of(t):
        g = []
        off = len(batch) - (t.ndim - 2)
        for k, s in enumerate(t.shape[:-2]):
            o = k + off
            g.append(batch[o] if s == out.shape[o] and s != 1 else "1")
        return g
    return _anno([batch_of(a) + ["m", "k+"], batch_of(b) + ["k+", "n"]],
                 [[l if s != 1 else "1" for l, s in zip(batch, out.shape)] + ["m", "n"]])


def einsum(op: IRFwOperation) -> str:
    """``einsum(equation, operands)``: a letter of the output splits every operand holding it (and the
    output) alike; a letter summed away (in the operands only) splits as a matmul's inner dim does,
    into partial sums (``+``). A letter of size 1 in an operand where another has it larger is that
    operand's broadcast (``1``). Mamba-2's chunked scan, ``bclhn,bcshn->bclsh``, splits its batch ``b``,
    chunks ``c`` and heads ``h``."""
    eq = str(op.args[0]).replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(op.inputs):
        raise ValueError(f"einsum: {len(terms)} operand terms in {eq!r} for {len(op.inputs)} tensors")
    if "." in eq:   # ``...``: the broadcast dims, spelled out as letters the equation does not use
        spare = [c for c in _EINSUM_LETTERS if c not in eq]
        out_nd = max(t.ndim - (len(term) - 3) for t, term in zip(op.inputs, terms) if "..." in term)
        extra = spare[:out_nd]
        terms = [term.replace("...", "".join(extra[out_nd - (t.ndim - (len(term) - 3)):])) if "..." in term else term
                 for t, term in zip(op.inputs, terms)]
        rhs = rhs.replace("...", "".join(extra))
    if not arrow:   # implicit output: the letters that appear once, in alphabetical order
        joined = "".join(terms)
        rhs = "".join(sorted(c for c in set(joined) if joined.count(c) == 1))
    sizes: Dict[str, int] = {}
    for t, term in zip(op.inputs, terms):
        if len(term) != t.ndim or len(set(term)) != len(term):
            raise ValueError(f"einsum: term {term!r} of {eq!r} for a {t.ndim}-D operand (or a repeated letter: "
                             f"a diagonal) has no rule")
        for c, n in zip(term, t.shape):
            sizes[c] = max(sizes.get(c, 1), int(n))
    names = _Names()
    order = "".join(terms) + rhs
    letter = {c: names() + ("" if c in rhs else "+") for c in sorted(sizes, key=order.index)}

    def group(term: str, shape) -> List[str]:
        return ["1" if int(n) == 1 else letter[c] for c, n in zip(term, shape)]
    return _anno([group(term, t.shape) for t, term in zip(op.inputs, terms)], [group(rhs, op.outputs[0].shape)])


_EINSUM_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def sdpa(op: IRFwOperation) -> str:
    """Batch and heads split freely (heads not under grouped-query attention, except with one key/value
    head: multi-query attention splits its query heads). With queries and
    keys of one length and no dropout, the sequence ``l~`` splits q, k and v alike and a piece runs
    ring attention (``OpInfo.inside="ring"``), an attention mask split along its rows (each rank
    keeps its queries' rows over every key) and its heads with the heads (a per-head additive bias,
    T5's, learned: the ring returns its rows' gradient); otherwise (cross-attention, dropout) a split
    of the queries (``l``, frozen under ``is_causal``) reads the keys whole."""
    q, k, v = op.inputs[:3]
    causal = bool(_arg(op, 5, "is_causal", False))
    gqa = bool(op.kwargs.get("enable_gqa", False)) or q.shape[:-2] != k.shape[:-2]
    # one key/value head for every query head (multi-query attention): the query heads split, each
    # piece reading that head whole; with more, a piece of the query heads would map onto other ones
    mqa = gqa and q.ndim >= 3 and k.shape[-3] == 1 and v.shape[-3] == 1 and q.shape[-3] != 1
    names = _Names()
    batch = names.many(q.ndim - 3)
    h = "h" if mqa or not gqa else "h^"
    kh = "1" if mqa else h
    masked = len(op.inputs) > 3
    ring = q.shape[-2] == k.shape[-2] and not _arg(op, 4, "dropout_p", 0.0)
    rows = "l~" if ring else "l^" if causal else "l"
    keys = "l~" if ring else "s^"
    ins = [batch + [h, rows, "e^"], batch + [kh, keys, "e^"], batch + [kh, keys, "f"]]
    if masked:  # attention mask: broadcastable to (..., h, l, s), split along with them
        mask = op.inputs[3]
        full = batch + [h, rows, names(True) if ring else "s^"]   # a ring's mask keeps every key
        sizes = list(q.shape[:-1]) + [k.shape[-2]]
        off = len(full) - mask.ndim
        ins.append(["1" if s == 1 else full[off + i] if s == sizes[off + i] else names(True)
                    for i, s in enumerate(mask.shape)])
    return _anno(ins, [batch + [h, rows, "f"]])


def flex_attention(op: IRFwOperation) -> str:
    """``cube.trace.flex``'s op: the batch and the heads split as for sdpa (heads not under grouped-query
    attention, except with one key/value head), where neither the score nor the mask function reads
    that index (on a piece it would number other rows of what they capture); the block mask's tensors
    (batch, heads, query blocks, ...) split with the batch and heads where they have them (a dim of
    size one is broadcast), what the functions capture is read whole. Self-attention (queries and keys
    of one length) splits the sequence ``l~`` of q, k and v alike: a piece keeps its block of queries
    and gathers the keys and values inside its call, reading its rows of the whole block mask
    (``OpInfo.inside="gather_kv"``, ``cube.runtime.flex``); cross-attention keeps both whole."""
    import json
    spec = json.loads(op.args[1])
    q, k = op.inputs[:2]
    gqa = spec["gqa"]
    mqa = gqa and k.shape[-3] == 1 and q.shape[-3] != 1
    names = _Names()
    bufs = op.inputs[3 + len(spec["given"]):]
    rows = spec["batch_rows"]   # the captured tensors the functions pick the batch's rows of
    whole = rows is None or any(bufs[i].shape[0] != q.shape[0] for i in rows)
    b = "b^" if whole else "b"
    frozen = "^" if spec["heads_read"] else ""
    if mqa:   # one key/value head: the query heads split, each piece reading it whole
        h, kh = "h" + frozen, "1"
    elif gqa and q.shape[-3] % k.shape[-3] == 0:
        # query head i reads key/value head i // g: the query heads are (key/value heads, g), split along
        # the key/value heads (each piece its groups)
        kh = "h" + frozen
        h = f"(h{frozen} g^)"
    else:
        h = kh = "h" + (frozen if not gqa else "^")
    seq = "l~" if q.shape[-2] == k.shape[-2] else None   # self-attention: the sequence splits (keys gathered)
    qs, ks = (seq, seq) if seq else ("l^", "s^")
    ins = [[b, h, qs, "e^"], [b, kh, ks, "e^"], [b, kh, ks, "f"]]
    for t in op.inputs[3:3 + len(spec["given"])]:   # (batch, heads, query blocks[, key blocks])
        lead = ["1" if t.shape[0] == 1 else b if t.shape[0] == q.shape[0] else names(True),
                "1" if t.shape[1] == 1 else h if t.shape[1] == q.shape[1] else names(True)]
        ins.append(lead + ["1" if n == 1 else names(True) for n in t.shape[2:]])
    for i, t in enumerate(bufs):
        ins.append([b if not whole and i in rows else "1" if t.shape[0] == 1 else names(True)]
                   + ["1" if n == 1 else names(True) for n in t.shape[1:]])
    return _anno(ins, [[b, h, qs, "f"], [b, h, qs]])


def block_mask(op: IRFwOperation) -> str:
    """``cube.trace.flex``'s block-mask op: made per piece of the batch from the rows of the captured
    tensors the mask function indexes by the batch (``rows``); everything else whole."""
    import json
    spec = json.loads(op.args[1])
    rows, outs = spec["rows"], op.outputs
    names = _Names()
    split = spec["batch"] == "rows"   # one mask per row of the tensors in ``rows`` (cube.trace.flex._mask_spec)
    ins = [["b" if split and i in rows else "1" if t.shape[0] == 1 else names(True)]
           + ["1" if n == 1 else names(True) for n in t.shape[1:]] for i, t in enumerate(op.inputs)]
    return _anno(ins, [["b" if split else "1" if t.shape[0] == 1 else names(True)]
                       + ["1" if n == 1 else names(True) for n in t.shape[1:]] for t in outs])


def embedding(op: IRFwOperation) -> str:
    """The table's rows (the vocabulary) split with each piece looking up the ids in its range and
    the pieces summed inside the call (``v~``, ``OpInfo.inside="vocab_lookup"``: Megatron's
    vocabulary-parallel embedding); not under ``scale_grad_by_freq`` or ``sparse``, whose gradients
    a piece cannot make alone."""
    idx = op.inputs[1]
    names = _Names()
    lead = ["1" if s == 1 else names() for s in idx.shape]
    alone = not _arg(op, 3, "scale_grad_by_freq", False) and not _arg(op, 4, "sparse", False)
    return _anno([["v~" if alone else "v^", "h"], lead], [lead + ["h"]])


# ----------------------------------------------------------------------------- normalization / conv / pool
def layer_norm(op: IRFwOperation) -> str:
    x = op.inputs[0]
    nnorm = len(_arg(op, 1, "normalized_shape"))
    names = _Names()
    lead = ["1" if s == 1 else names() for s in x.shape[:x.ndim - nnorm]]
    norm = names.many(nnorm, frozen=True)
    ins = [lead + norm] + [norm] * (len(op.inputs) - 1)
    return _anno(ins, [lead + norm] + [lead + ["1"] * nnorm] * (len(op.outputs) - 1))


def rms_norm(op: IRFwOperation) -> str:
    return layer_norm(op)


def _inside(names: "_Names", n: int) -> List[str]:
    """``n`` fresh letters marked ``~``: a piece split along one communicates inside its call."""
    return [names() + "~" for _ in range(n)]


def batch_norm(op: IRFwOperation) -> str:
    """Batch and spatial dims split with statistics summed over the pieces (``OpInfo.inside``)."""
    x = op.inputs[0]
    names = _Names()
    g = _inside(names, 1) + ["c"] + _inside(names, x.ndim - 2)
    return _anno([g] + [["c"]] * (len(op.inputs) - 1), [g])


def group_norm(op: IRFwOperation) -> str:
    """group_norm / instance_norm: statistics per sample (and group) over the channels of a group and
    the spatial dims. Spatial dims split with the statistics summed over the pieces
    (``OpInfo.inside``); the batch splits freely, except under an instance norm updating running
    statistics (they average over the whole batch: summed too). A channel split would cut a group."""
    x = op.inputs[0]
    names = _Names()
    running = op.name == "instance_norm" and bool(_arg(op, 5, "use_input_stats", False)) and \
        _arg(op, 3, "running_mean") is not None
    g = ["b~" if running else "b", "c^"] + _inside(names, x.ndim - 2)
    ins = [g] + [["c^"] if t.ndim == 1 and t.shape[0] == x.shape[1] else names.many(t.ndim, frozen=True)
                 for t in op.inputs[1:]]
    return _anno(ins, [g] + [["b"] + names.many(o.ndim - 1, frozen=True) for o in op.outputs[1:]])


def _conv(op: IRFwOperation, transposed: bool) -> str:
    x, w = op.inputs[:2]
    groups = _arg(op, 6, "groups", 1)   # the 7th argument of conv and conv_transpose alike
    nsp = w.ndim - 2
    c = "c+" if groups == 1 else "c^"
    o = "o" if groups == 1 else "o^"
    names = _Names()
    sp = _inside(names, nsp)
    lead = ["b", c] if x.ndim == nsp + 2 else [c]   # unbatched input: (c, spatial...)
    olead = ["b", o] if x.ndim == nsp + 2 else [o]
    ins = [lead + sp, ([c, o] if transposed else [o, c]) + names.many(nsp, True)]
    if groups > 1 and groups == x.shape[x.ndim - nsp - 1] == w.shape[0] and w.shape[1] == 1:
        # depthwise (one channel a group, Mamba's causal conv1d): the channels split like an elementwise op's,
        # each piece calls the conv with its own channel count as groups (cube.codegen.local)
        lead, olead = lead[:-1] + ["c"], olead[:-1] + ["c"]
        ins = [lead + sp, ["c", names(True)] + names.many(nsp, True)]
        if len(op.inputs) == 3:
            ins.append(["c"])
        return _anno(ins, [olead + sp])
    if len(op.inputs) == 3:
        ins.append([o])
    return _anno(ins, [olead + sp])


def conv_transpose(op: IRFwOperation) -> str:
    """Transposed convolution: weight ``(in, out / groups, kernel...)``; spatial dims split with a
    halo exchange and a crop inside the piece's call (``cube.ir.halo``)."""
    return _conv(op, True)


def conv(op: IRFwOperation) -> str:
    """Spatial dims split with a halo exchange inside the piece's call (``cube.ir.halo``)."""
    return _conv(op, False)


def pool(op: IRFwOperation) -> str:
    """Pooling and upsampling: spatial dims split with a halo exchange when the op returns one tensor."""
    x = op.inputs[0]
    nsp = _spatial(op)
    names = _Names()
    lead = names.many(x.ndim - nsp)
    if len(op.outputs) == 1 and op.outputs[0].ndim == x.ndim:
        sp = _inside(names, nsp)
        return _anno([lead + sp], [lead + sp])
    outs = [lead + names.many(o.ndim - len(lead), True) for o in op.outputs]
    return _anno([lead + names.many(nsp, True)], outs)


def _spatial(op: IRFwOperation) -> int:
    """The number of spatial dims of a conv/pool/upsampling (``max_pool2d`` -> 2)."""
    for n in (1, 2, 3):
        if f"{n}d" in op.name:
            return n
    return 2


# ----------------------------------------------------------------------------- reductions and losses
def _reduce(op: IRFwOperation, dims, keepdim: bool, mark: str) -> str:
    x = op.inputs[0]
    dims = [dims] if isinstance(dims, int) else dims   # argmax(x, dim), amax(x, [dims])
    dims = set(range(x.ndim)) if dims is None or len(dims) == 0 else {_dim(d, x.ndim) for d in dims}
    names = _Names()
    ig, og = [], []
    for k, s in enumerate(x.shape):
        if s == 1:
            ig.append("1")
            if k not in dims or keepdim:
                og.append("1")
            continue
        letter = names()
        if k in dims:
            ig.append(letter + mark)
            if keepdim:
                og.append("1")
        else:
            ig.append(letter)
            og.append(letter)
    return _anno([ig], [og] * len(op.outputs))


def sum_rule(op: IRFwOperation) -> str:
    return _reduce(op, _arg(op, 1, "dim"), bool(_arg(op, 2, "keepdim", False)), "+")


def max_rule(op: IRFwOperation) -> str:
    if op.name in ("max", "min") and len(op.inputs) == 2:   # max(a, b): the elementwise maximum (max.other)
        return elementwise(op)
    return _reduce(op, _arg(op, 1, "dim"), bool(_arg(op, 2, "keepdim", False)), "^")


def norm_rule(op: IRFwOperation) -> str:
    """``linalg_vector_norm(x, ord, dim, keepdim)`` (what ``x.norm(...)`` and ``torch.norm`` trace to)
    and ``norm(x, p, dim, keepdim)``: a reduction over ``dim`` (every dim when none is given), the
    reduced dims whole; the dims after the order, not the order itself."""
    return _reduce(op, _arg(op, 2, "dim"), bool(_arg(op, 3, "keepdim", False)), "^")


def loss(op: IRFwOperation) -> str:
    """cross_entropy_loss / nll_loss over ``(n, c, ...)``. A cross entropy of class-index targets
    without class weights may split its classes (``c~``, ``OpInfo.inside="vocab_loss"``: Megatron's
    vocabulary-parallel cross entropy, the logits staying split, their statistics summed inside
    the call); otherwise the classes are whole."""
    logits, target = op.inputs[:2]
    reduction = _arg(op, 3, "reduction", 1)
    names = _Names()
    n = "n" if reduction == 0 else "n+"
    # the dims after the classes (a (batch, classes, sequence) loss) are rows as the batch is: summed
    # into a reduced loss, like n
    extra = [e if reduction == 0 else e + "+" for e in names.many(logits.ndim - 2)]
    split = op.name == "cross_entropy_loss" and len(op.inputs) == 2 and target.ndim == logits.ndim - 1 \
        and not target.dtype.is_floating_point
    c = "c~" if split else "c^"
    ins = [[n, c] + extra, [n] + extra]
    if len(op.inputs) > 2:
        ins.append([c])
    return _anno(ins, [[n] + extra] if reduction == 0 else [[]])


def pointwise_loss(op: IRFwOperation) -> str:
    x = op.inputs[0]
    reduction = _arg(op, 2, "reduction", 1)
    names = _Names()
    g = names.many(x.ndim, frozen=False)
    if reduction == 0:
        return _anno([g, g], [g])
    return _anno([[l + "+" for l in g]] * 2, [[]])


# ----------------------------------------------------------------------------- shape ops
def reshape(op: IRFwOperation) -> str:
    """view/reshape/flatten/unsqueeze/squeeze: dims grouped by equal products.

    One input dim becoming several output dims is ``(x y) -> x y`` (and the
    reverse for merges), so a split of the outer factor survives the reshape.
    """
    src, dst = op.inputs[0].shape, op.outputs[0].shape
    names = _Names()
    ins = ["1" if s == 1 else None for s in src]
    outs = ["1" if s == 1 else None for s in dst]
    si = [k for k, s in enumerate(src) if s != 1]
    di = [k for k, s in enumerate(dst) if s != 1]
    i = j = 0
    while i < len(si) or j < len(di):
        gi, gj = [si[i]], [di[j]]
        pi, pj = src[si[i]], dst[di[j]]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                gi.append(si[i]); pi *= src[si[i]]; i += 1
            else:
                gj.append(di[j]); pj *= dst[di[j]]; j += 1
        if len(gi) == 1 and len(gj) == 1:
            letter = names()
            ins[gi[0]] = outs[gj[0]] = letter
        elif len(gi) == 1:
            letters = names.many(len(gj))
            ins[gi[0]] = "(" + " ".join(letters) + ")"
            for k, l in zip(gj, letters):
                outs[k] = l
        elif len(gj) == 1:
            letters = names.many(len(gi))
            outs[gj[0]] = "(" + " ".join(letters) + ")"
            for k, l in zip(gi, letters):
                ins[k] = l
        else:
            _refine(src, dst, gi, gj, ins, outs, names)
    return _anno([ins], [outs])


def _refine(src, dst, gi: List[int], gj: List[int], ins: list, outs: list, names: "_Names") -> None:
    """Dims ``gi`` of ``src`` reshaped into dims ``gj`` of ``dst`` (same product, neither one dim):
    both written over their common factors, ``(l b e) -> (l b h) d`` style, where every dim's
    extent is a product of consecutive factors (``(B, H*D) -> (B*H, D)``: factors ``b h d``, so the
    batch split survives); dims that share no such factors are whole."""
    def bounds(shape, dims):
        out, p = [], 1
        for k in reversed(dims):
            p *= shape[k]
            out.append(p)
        return out
    cuts = sorted(set(bounds(src, gi)) | set(bounds(dst, gj)))
    if any(b % a for a, b in zip(cuts, cuts[1:])):
        for k in gi:
            ins[k] = names(True)
        for k in gj:
            outs[k] = names(True)
        return
    inner = [1] + cuts[:-1]
    letters = {c: names() for c in cuts}   # the factor between a cut and the one below it

    def write(shape, dims, group):
        below = 1
        for k in reversed(dims):
            top = below * shape[k]
            fs = [letters[c] for c, lo in zip(cuts, inner) if below < c <= top]
            group[k] = fs[0] if len(fs) == 1 else "(" + " ".join(reversed(fs)) + ")"
            below = top
    write(src, gi, ins)
    write(dst, gj, outs)


def permute(op: IRFwOperation) -> str:
    x = op.inputs[0]
    if op.name in ("transpose", "swapaxes"):
        d0, d1 = _dim(op.args[1], x.ndim), _dim(op.args[2], x.ndim)
        perm = list(range(x.ndim))
        perm[d0], perm[d1] = perm[d1], perm[d0]
    elif op.name in ("t", "numpy_T"):
        perm = list(range(x.ndim))[::-1]
    else:
        perm = [_dim(d, x.ndim) for d in op.args[1]]
    names = _Names()
    g = ["1" if s == 1 else names() for s in x.shape]
    return _anno([g], [[g[p] for p in perm]])


def expand(op: IRFwOperation) -> str:
    x, out = op.inputs[0], op.outputs[0]
    names = _Names()
    off = out.ndim - x.ndim
    og = [names(True) for _ in range(off)]
    ig = []
    for k, s in enumerate(x.shape):
        o = out.shape[k + off]
        if s == o:
            letter = "1" if s == 1 else names()
            ig.append(letter)
            og.append(letter)
        else:
            ig.append("1")
            og.append(names(True))
    return _anno([ig], [og])


def select(op: IRFwOperation) -> str:
    x = op.inputs[0]
    d = _dim(op.args[1], x.ndim)
    names = _Names()
    g = ["1" if s == 1 else names(k == d) for k, s in enumerate(x.shape)]
    return _anno([g], [g[:d] + g[d + 1:]])


def slice_rule(op: IRFwOperation) -> str:
    x, out = op.inputs[0], op.outputs[0]
    d = _dim(_arg(op, 1, "dim", 0), x.ndim)
    names = _Names()
    g = ["1" if s == 1 else names() for s in x.shape]
    og = list(g)
    if x.shape[d] != out.shape[d]:
        g[d] = "1" if x.shape[d] == 1 else g[d] + "^"
        og[d] = "1" if out.shape[d] == 1 else names(True)
    return _anno([g], [og])


def slice_scatter(op: IRFwOperation) -> str:
    """The written dim (``dim`` of ``slice_scatter``/``select_scatter``) is whole; the others
    split the tensor written into, the values written and the result alike."""
    base, src = op.inputs[:2]
    d = _dim(_arg(op, 2, "dim", 0), base.ndim)
    names = _Names()
    g = ["1" if s == 1 else names(k == d) for k, s in enumerate(base.shape)]
    if op.name == "select_scatter":
        sg = g[:d] + g[d + 1:]
    else:
        sg = list(g)
        sg[d] = "1" if src.shape[d] == 1 else names(True)
    sg = ["1" if s == 1 else l for s, l in zip(src.shape, sg)]
    return _anno([g, sg], [g])


def _cut_along(op: IRFwOperation, d: int) -> str:
    """One input whose dim ``d`` is whole, outputs like it with their own (whole) dim ``d``."""
    names = _Names()
    g = ["1" if s == 1 else names(k == d) for k, s in enumerate(op.inputs[0].shape)]
    outs = []
    for o in op.outputs:
        og = list(g)
        og[d] = "1" if o.shape[d] == 1 else names(True)
        outs.append(og)
    return _anno([g], outs)


def split(op: IRFwOperation) -> str:
    return _cut_along(op, _dim(_arg(op, 2, "dim", 0), op.inputs[0].ndim))


def unbind(op: IRFwOperation) -> str:
    x = op.inputs[0]
    d = _dim(_arg(op, 1, "dim", 0), x.ndim)
    names = _Names()
    g = ["1" if s == 1 else names(k == d) for k, s in enumerate(x.shape)]
    return _anno([g], [g[:d] + g[d + 1:]] * len(op.outputs))


def _along(op: IRFwOperation, d: int) -> str:
    """Tensors share every dim but ``d``, which no split may touch (cat, diff)."""
    names = _Names()
    base = ["1" if s == 1 else names() for s in op.outputs[0].shape]
    ins = []
    for t in op.inputs:
        g = list(base)
        g[d] = "1" if t.shape[d] == 1 else names(True)
        ins.append(g)
    og = list(base)
    og[d] = names(True)
    return _anno(ins, [og])


def cat(op: IRFwOperation) -> str:
    return _along(op, _dim(_arg(op, 1, "dim", 0), op.outputs[0].ndim))


def prelu(op: IRFwOperation) -> str:
    """``prelu(x, weight)``: one slope per channel (dim 1 of ``x``), or one for all; ``x`` splits freely,
    a channel split splits the slopes with it."""
    x, w = op.inputs[0], op.inputs[1]
    names = _Names()
    g = ["1" if s == 1 else names() for s in x.shape]
    wg = ["1" if s == 1 or x.ndim < 2 else g[1] for s in w.shape]
    return _anno([g, wg], [g])


def im2col(op: IRFwOperation) -> str:
    """``unfold(x, kernel, ...)`` (``(B, C, H, W) -> (B, C * kh * kw, L)``): the batch splits; the
    channels (merged with the kernel's offsets) and the positions are whole."""
    x = op.inputs[0]
    names = _Names()
    b = ["1" if x.shape[0] == 1 else names()] if x.ndim == 4 else []
    ins = b + [names(True) if s != 1 else "1" for s in x.shape[len(b):]]
    out = b + [names(True) if s != 1 else "1" for s in op.outputs[0].shape[len(b):]]
    return _anno([ins], [out])


def glu(op: IRFwOperation) -> str:
    """``glu(x, dim)``: the two halves of ``dim`` gate each other, so ``dim`` is whole; the others split."""
    return _along(op, _dim(_arg(op, 1, "dim", -1), op.outputs[0].ndim))


def stack(op: IRFwOperation) -> str:
    out = op.outputs[0]
    d = _dim(_arg(op, 1, "dim", 0), out.ndim)
    names = _Names()
    g = ["1" if s == 1 else names() for s in op.inputs[0].shape]
    return _anno([g] * len(op.inputs), [g[:d] + [names(True)] + g[d:]])


def pad(op: IRFwOperation) -> str:
    """``pad(x, [l_last, r_last, l_before, r_before, ...])``: a dim the list pads by 0 on both sides
    splits (Mamba-2's chunk padding names the batch dim's ``(0, 0)`` too). A dim padded with a constant
    splits too, with a halo exchange inside the piece's call (``~``, ``cube.ir.halo``): each block of
    the output reads the input rows it shifts in from its neighbours, the global borders filled with
    the constant (RWKV's time shift, ``ZeroPad2d((0, 0, 1, -1))``: each token reads the one before);
    padded otherwise (reflect, replicate, circular), it is whole."""
    x = op.inputs[0]
    sizes = list(op.args[1])
    padded = [x.ndim - 1 - k // 2 for k in range(0, len(sizes) - 1, 2)
              if not (isinstance(sizes[k], int) and isinstance(sizes[k + 1], int) and sizes[k] == sizes[k + 1] == 0)]
    if not padded:
        return elementwise(op)
    mode = _arg(op, 2, "mode", "constant") if op.name == "pad" else "constant"
    if mode != "constant" or not all(isinstance(v, int) for v in sizes):
        return _frozen_dims(lambda o: padded)(op)
    names = _Names()
    g = ["1" if s == 1 else (names() + "~" if d in padded else names()) for d, s in enumerate(x.shape)]
    return _anno([g], [g])


def diff(op: IRFwOperation) -> str:
    return _along(op, _dim(_arg(op, 2, "dim", -1), op.outputs[0].ndim))


def view_as_complex(op: IRFwOperation) -> str:
    """``(..., 2)`` real pairs -> ``(...)`` complex (and ``view_as_real`` back): every other dim
    splits; the pair is whole."""
    x = op.inputs[0]
    names = _Names()
    lead = ["1" if s == 1 else names() for s in (x.shape[:-1] if op.name == "view_as_complex" else x.shape)]
    pair = names(True)
    if op.name == "view_as_complex":
        return _anno([lead + [pair]], [lead])
    return _anno([lead], [lead + [pair]])


def _whole(names: "_Names", t) -> List[str]:
    return ["1" if s == 1 else names(True) for s in t.shape]


def index(op: IRFwOperation) -> str:
    """``x[..., idx, ...]`` (advanced indexing): the dims no tensor indexes split, and so do the
    index tensors' dims (a split of the indices picks a split of the output; an index tensor of size
    1 there is broadcast); the indexed dims of ``x`` are whole. Indexed dims next to each other are
    replaced in place by the indices' broadcast shape; apart, the indices' dims come first (torch's
    rule)."""
    x, out = op.inputs[0], op.outputs[0]
    idx = list(op.args[1])
    if any(isinstance(i, IRTensor) and i.dtype == torch.bool for i in idx):
        raise ValueError("boolean masks index a data-dependent number of elements")
    pos = [k for k, i in enumerate(idx) if i is not None]
    names = _Names()
    xg = ["1" if s == 1 else names(k in pos) for k, s in enumerate(x.shape)]
    keep = [xg[k] for k in range(x.ndim) if k not in pos]
    nidx = out.ndim - len(keep)
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    start = pos[0] if adjacent else 0
    mid_shape = out.shape[start:start + nidx]
    # the index tensors broadcast to the output's middle dims: each has a dim there at full size or 1
    mid = ["1" if size == 1 else names() for size in mid_shape]
    og = ([xg[k] for k in range(pos[0])] + mid + [xg[k] for k in range(pos[-1] + 1, x.ndim)]) if adjacent \
        else mid + keep
    og = ["1" if s == 1 else g for g, s in zip(og, out.shape)]

    def index_group(t):
        off = nidx - t.ndim
        return ["1" if s == 1 else (mid[off + j] if s == mid_shape[off + j] else names(True))
                for j, s in enumerate(t.shape)]
    return _anno([xg] + [index_group(t) for t in op.inputs[1:]], [og])


def index_select(op: IRFwOperation) -> str:
    """``index_select(x, dim, idx)``: the other dims split; ``dim`` of ``x`` is whole, and the indices
    split with the output's ``dim`` (each piece picks its own rows: a token's expert weights)."""
    x, i = op.inputs[:2]
    d = _dim(op.args[1], x.ndim)
    names = _Names()
    g = ["1" if s == 1 else names(k == d) for k, s in enumerate(x.shape)]
    og = list(g)
    og[d] = "1" if op.outputs[0].shape[d] == 1 else names()
    return _anno([g, [og[d]] if i.ndim == 1 else _whole(names, i)], [og])


def scatter(op: IRFwOperation) -> str:
    """``scatter(x, dim, idx, src)`` (and ``scatter_add``/``scatter_reduce``): a dim other than ``dim``
    where x, the indices and the source have one size splits all alike (each row written only from its
    own row: torchtitan's per-sample document ends); ``dim`` is whole."""
    x = op.inputs[0]
    d = _dim(op.args[1], x.ndim)
    names = _Names()
    groups = [[] for _ in op.inputs]
    for k in range(x.ndim):
        sizes = {t.shape[k] for t in op.inputs if t.ndim == x.ndim}
        same = k != d and len(sizes) == 1 and x.shape[k] != 1 and all(t.ndim == x.ndim for t in op.inputs)
        letter = names() if same else None
        for g, t in zip(groups, op.inputs):
            g.append(letter if same else "1" if t.ndim == x.ndim and t.shape[k] == 1 else names(True))
    return _anno(groups, [groups[0]])


def gather(op: IRFwOperation) -> str:
    """``gather(x, dim, idx)``: the output has the indices' shape; a dim other than ``dim`` where x
    and the indices have one size splits all three alike; the indices' ``dim`` splits with the
    output's (``x`` is then whole along it)."""
    x, i = op.inputs[:2]
    d = _dim(op.args[1], x.ndim)
    names = _Names()
    xg, ig = [], []
    for k, (a, b) in enumerate(zip(x.shape, i.shape)):
        if k != d and a == b and a != 1:
            letter = names()
            xg.append(letter)
            ig.append(letter)
        else:
            xg.append("1" if a == 1 else names(True))
            ig.append("1" if b == 1 else names(k != d))
    return _anno([xg, ig], [ig])


def repeat_interleave(op: IRFwOperation) -> str:
    """``repeat_interleave(x, k, dim)`` with a number ``k``: each element of ``dim`` repeated ``k``
    times in place, so ``dim`` becomes ``(d r)``, a split of ``d`` the outer factor (each token's
    copies for its top-k experts stay with the token); otherwise (repeats given by a tensor, no
    ``dim``) nothing splits."""
    x = op.inputs[0]
    d = _arg(op, 2, "dim")
    if len(op.inputs) != 1 or not isinstance(_arg(op, 1, "repeats"), int) or d is None:
        return opaque(op)
    d = _dim(d, x.ndim)
    names = _Names()
    g = ["1" if s == 1 else names() for s in x.shape]
    og = list(g)
    og[d] = f"({g[d]} {names(True)})" if x.shape[d] != 1 else names(True)
    return _anno([g], [og])


def topk(op: IRFwOperation) -> str:
    """``topk``/``sort``/``argsort``: the dim it ranks along is whole, the others split."""
    d = _arg(op, 2, "dim", -1) if op.name == "topk" else _arg(op, 1, "dim", -1)
    return _cut_along(op, _dim(d if isinstance(d, int) else -1, op.inputs[0].ndim))


def count(op: IRFwOperation) -> str:
    """``histc``/``bincount``: counts (or summed weights) of the values of every element; a piece's
    counts are a partial sum of the whole's."""
    x = op.inputs[0]
    names = _Names()
    g = ["1" if s == 1 else names() + "+" for s in x.shape]
    ins = [g] + [g if tuple(t.shape) == tuple(x.shape) else _whole(names, t) for t in op.inputs[1:]]
    return _anno(ins, [_whole(names, o) for o in op.outputs])


def opaque(op: IRFwOperation) -> str:
    """Nothing of this op may be split (gathers, scatters, data-dependent indexing)."""
    names = _Names()
    def group(t):
        return ["1" if s == 1 else names(True) for s in t.shape]
    return _anno([group(t) for t in op.inputs], [group(t) for t in op.outputs])


def creation(op: IRFwOperation) -> str:
    names = _Names()
    return _anno([], [["1" if s == 1 else names(True) for s in o.shape] for o in op.outputs])


def drawn(op: IRFwOperation) -> str:
    """A random op that reads tensors (``normal(mean, std)``) is elementwise over them; one that reads
    none makes a tensor of the size it is given (``normal(0., 1., size)``), as ``creation``."""
    return elementwise(op) if op.inputs else creation(op)


# ----------------------------------------------------------------------------- registry
# rule name (``OpInfo.rule`` in cube.ir.ops, where each op names its rule) -> the rule
RULES: Dict[str, Rule] = {
    "elementwise": elementwise, "linear": linear, "addmm": addmm, "baddbmm": baddbmm, "matmul": matmul,
    "einsum": einsum, "sdpa": sdpa,
    "flex_attention": flex_attention, "block_mask": block_mask,
    "embedding": embedding, "layer_norm": layer_norm, "rms_norm": rms_norm, "batch_norm": batch_norm,
    "group_norm": group_norm, "conv_transpose": conv_transpose,
    "conv": conv, "pool": pool, "sum_rule": sum_rule, "max_rule": max_rule, "norm_rule": norm_rule, "loss": loss,
    "glu": glu, "prelu": prelu, "im2col": im2col,
    "pointwise_loss": pointwise_loss,
    "along_dim": _frozen_dims(lambda op: [_arg(op, 1, "dim")]),   # softmax: dim is whole
    "scan": scan,                                                 # cumsum: dim split, a scan inside the call
    "along_last_two": _frozen_dims(lambda op: [-2, -1]),         # triu, tril
    "reshape": reshape, "permute": permute, "expand": expand, "select": select, "slice_rule": slice_rule,
    "split": split, "unbind": unbind, "scatter": scatter, "slice_scatter": slice_scatter, "cat": cat, "stack": stack, "pad": pad,
    "creation": creation, "drawn": drawn, "diff": diff, "opaque": opaque, "view_as_complex": view_as_complex,
    "index": index, "repeat_interleave": repeat_interleave,
    "index_select": index_select, "gather": gather, "topk": topk, "count": count,
}
_BUILTIN: Dict[str, Rule] = {name: RULES[info.rule] for name, info in ops.rows().items() if info.rule}


class Registry:
    """Annotation rules by op name: built-ins plus what ``cube.register_op`` added."""

    def __init__(self):
        self.rules: Dict[str, Rule] = dict(_BUILTIN)
        self.builtin = frozenset(_BUILTIN)

    def register(self, name: str, rule: Rule) -> None:
        if isinstance(rule, str):
            parse(rule)  # fail early on a malformed annotation
        self.rules[name] = rule

    def annotate(self, op: IRFwOperation) -> None:
        """Sets ``op.anno`` (or ``op.anno_error``) from the rule for ``op.name``."""
        rule = self.rules.get(op.name)
        if rule is None or rule is opaque:   # opaque: split nothing, the hand rule's placeholder
            from cube.trace import derived   # from DTensor's strategies or the op's own runs, each split checked
            function = getattr(op.target, "namespace", None) == fn_ops.NAMESPACE
            text = derived.derive_function(op) if function else derived.derive(op)
            if text is not None:
                rule = text
                op.anno_derived = True
            elif function:
                module, qualname, _ = fn_ops.described(op.name)
                op.anno_error = (f"{module}.{qualname}, a torch.autograd.Function run as written, splits along "
                                 f"no dim: its pieces do not give the halves of its output and gradients")
                return
            elif rule is None:
                op.anno_error = f"cube has no partition rule for {op.name!r}"
                return
        try:
            text = rule if isinstance(rule, str) else rule(op)
            anno = parse(text, len(op.inputs))
        except Exception as e:  # a rule that does not apply to this call: stays replicated
            op.anno_error = f"the rule for {op.name!r} does not apply to this call ({e})"
            return
        problem = _mismatch(anno, op)
        if problem:
            op.anno_error = f"annotation '{anno}' does not match the op's tensors: {problem}"
            return
        op.anno = anno


def _mismatch(anno: OpAnno, op: IRFwOperation) -> str:
    for what, groups, tensors in (("input", anno.inputs, op.inputs), ("output", anno.outputs, op.outputs)):
        if len(groups) != len(tensors):
            return f"{len(groups)} {what} group(s) for {len(tensors)} tensor {what}(s)"
        for k, (g, t) in enumerate(zip(groups, tensors)):
            if len(g) != t.ndim:
                return f"{what} {k} has {t.ndim} dims, annotation gives {len(g)}"
    return ""


REGISTRY = Registry()
