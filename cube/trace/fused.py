"""Fused projections cut into one matmul per block (Megatron-LM's tensor parallel on fused QKV).

Many models compute several projections with one weight and cut the output's features into
blocks: Hugging Face GPT-2's ``c_attn`` (a ``Conv1D``: ``addmm(bias, x, W)``, ``W`` of shape
``(E, 3E)``, then ``split(E, dim=2)`` into q, k and v), Phi-3's ``qkv_proj`` (a linear whose
output is sliced into q, k and v of different widths under grouped-query attention) and its
``gate_up_proj`` (``chunk(2, -1)``). The blocks are contiguous ranges of the output features, so
a contiguous split of the fused weight along them would give a rank all of q and part of k
rather than its heads of each; and the op that cuts the blocks must keep its cut dim whole. A
policy following the features from the projection stops there, so the weight stays whole on
every rank, and so does the attention output projection after it.

This pass, run once on the traced graph before any policy, replaces such a projection by one
matmul per block. Each reads a *sub-parameter*: an ``IRTensor`` standing for a box of the
user's parameter (``IRTensor.region``: the block's range along the feature dim, the whole of
the other dims; ``IRTensor.full``: the user's shape), with the user's names. Each block is then
an ordinary projection that a policy splits by heads like a separate q, k or v projection, and
the attention output projection becomes row-split. The values are the model's: each block's
output is the same matmul over the same reduced dim, only computed in several calls.

Everything that maps IR parameters to the user's tensors composes a piece's box with the
sub-parameter's region (``IRTensor.user_box``): the generated module's ``PARAMS`` table holds
boxes of the user's tensor, so loading, checkpoints, ZeRO and gradient sums see the user's names
and shapes as before, each rank holding one piece per block.

The pass is exact or does nothing. A projection is cut only when:

- its weight (2-D) and bias (1-D, optional) are parameters no other op reads;
- its output, or one reshape of it that keeps the features as the trailing dims (``(B*T, F)``
  viewed as ``(B, T, F)`` or ``(B, T, n, F/n)``), is read only by ops cutting one dim of the
  features into blocks: ``split``, ``split_with_sizes``, ``chunk``, ``slice`` and ``narrow``
  with step 1, ``unbind``, ``select``;
- the blocks are disjoint, cover the dim, number at least two, and each is read.

Between the reshape and the cuts, a chain of ops that only move the block dim or add and drop
dims of size 1 (``unsqueeze``, ``squeeze``, ``transpose``, ``permute``, ``contiguous``) is
followed too, when every block is one unit wide: ``nn.MultiheadAttention``'s packed in-projection
(``linear(x, in_proj_weight)`` to ``3E`` features, ``unflatten(-1, (3, E))``, the 3 moved to the
front, then ``select`` of q, k and v) is cut into three projections like Llama's. Each block's
elements are then in the order of its matmul's output, so a ``view`` makes the cut's tensor.

The chain may also scale the features by a parameter or buffer broadcast to them (Falcon-H1's
``in_proj(h) * mup_vector``, one multiplier per feature): each block is scaled by its own range of it,
a ``slice`` of the scale beside the block's matmul. A chain replayed per block runs where the chain
ended, after every tensor its ops read.

A parameter the model itself cuts into blocks before its matmuls (``nn.MultiheadAttention``'s
cross-attention: ``w_q, w_kv = in_proj_weight.split([E, 2 * E])``, the bias likewise) is read
as one sub-parameter per block first (``split_params``), so each block is an ordinary projection
(and ``w_kv``'s packed output is cut again as above).

A per-head interleaved layout (GPT-NeoX's ``query_key_value``, viewed as ``(B, T, H, 3D)``
and sliced inside each head) is not cut: its blocks are not contiguous ranges of the features,
and a split by heads already works on it.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph, constant, makers as graph_makers, readers as graph_readers
from cube.ir.operator import IRFwOperation
from cube.ir.ops import op_info
from cube.ir.tensor import IRTensor, TensorKind
from cube.trace.inplace import draws
from cube.trace.rules import Registry

# op name -> (argument holding the weight, the weight's output-feature dim, argument holding the bias)
_MATMULS = {
    "linear": (1, 0, 2),      # linear(x, W (out, in), b)
    "addmm": (2, 1, 0),       # addmm(b, x, W (in, out)): Hugging Face's Conv1D
    "mm": (1, 1, None),       # x @ W (in, out)
    "matmul": (1, 1, None),
}
_RESHAPES = {"view", "_unsafe_view", "reshape", "unflatten"}
_MOVES = {"unsqueeze", "squeeze", "transpose", "permute", "contiguous"}   # ops of the chain (module docstring)
_SCALES = ("mul", "div", "add", "sub")   # a block's values scaled by a parameter or buffer (``_scale``)


@dataclass
class _Block:
    """One block of the cut dim: ``[start, stop)`` along it, the tensor the cut made of it and
    whether the cut dropped the dim (``unbind``, ``select``)."""
    start: int
    stop: int
    out: IRTensor
    drops: bool
    cut: IRFwOperation


@dataclass
class _Fused:
    """A projection to cut: the matmul, its weight and bias, the reshape between it and the cuts
    (or None), the cut ops and the blocks in order, the features per unit of the cut dim, and the
    transpose between the weight and the matmul (or None)."""
    op: IRFwOperation
    weight: IRTensor
    feature_dim: int
    bias: Optional[IRTensor]
    view: Optional[IRFwOperation]
    cuts: List[IRFwOperation]
    blocks: List[_Block]
    unit: int
    transpose: Optional[IRFwOperation] = None   # ``x @ W.t()`` (Falcon's linear): the transpose of the weight
    chain: Tuple[IRFwOperation, ...] = ()       # the ops moving the block dim between the reshape and the cuts
    # per depthwise conv of the chain: (conv, its weight parameter, the moves from it to the conv, its bias or None)
    convs: Tuple[Tuple[IRFwOperation, IRTensor, Tuple[IRFwOperation, ...], Optional[IRTensor]], ...] = ()


def split_fused(graph: IRGraph, registry: Registry, consts: Optional[Dict[str, torch.Tensor]] = None) -> IRGraph:
    """The graph with every fused projection (module docstring) replaced by one matmul per block.

    Args:
        consts: the values of the graph's lifted constants (index lists cutting blocks).

    Returns:
        ``graph`` itself when nothing is cut, else a new graph of the same model.
    """
    graph = split_params(graph, registry)
    while True:   # a block may be a fused projection of its own (Mamba-2's x, B and C, cut after their conv)
        readers, makers = graph_readers(graph.ops), graph_makers(graph.ops)
        replace: Dict[int, List[IRFwOperation]] = {}
        subs: Dict[int, List[IRTensor]] = {}
        found = [] if _uncat(graph, readers, makers, registry, replace, subs) else \
            [f for op in graph.ops if isinstance(op, IRFwOperation) and op.name in _MATMULS
             for f in [_find(op, readers, makers, graph.loss, consts or {})] if f is not None]
        if not found and not replace:
            return graph
        for f in found:
            ops, weights, biases, conv_subs = _cut(f, registry)
            for op in ([f.view] if f.view is not None else []) + ([f.transpose] if f.transpose is not None else []) \
                    + list(f.chain) + f.cuts + [m for _, _, moves, _ in f.convs for m in moves]:
                replace[id(op)] = []
            if f.chain and f.view is None:
                # the chain again per block where the chain ended, after every tensor its ops read (a
                # scale an earlier cut sliced per block is made after this block's matmul)
                replace[id(f.op)], replace[id(f.chain[-1])] = ops
            else:
                replace[id(f.op)] = ops[0] + ops[1]
            subs[id(f.weight)] = weights
            if f.bias is not None:
                subs[id(f.bias)] = biases
            subs.update(conv_subs)
        ops = [new for op in graph.ops for new in replace.get(id(op), [op])]
        attrs = [new for t in graph.attrs for new in subs.get(id(t), [t])]
        graph = IRGraph(ops, attrs, graph.loss, graph.name)


_SPLITS = {"split", "split_with_sizes", "chunk", "unsafe_split"}


def _uncat(graph: IRGraph, readers, makers, registry: Registry, replace: Dict[int, List[IRFwOperation]],
           subs: Dict[int, List[IRTensor]]) -> bool:
    """Adds to ``replace`` (op id -> the ops replacing it) and ``subs`` (parameter id -> its sub-parameters)
    the first ``cat`` whose blocks a chain of ops keeping their dims (``_chain``: a depthwise conv among
    them) carries to a cut into the same blocks, replaced by the chain once per block, each conv on its
    block's channels; False when there is none. Qwen3-Next's gated delta rule
    concatenates its q, k and v, runs one causal conv over the channels and splits them again: per
    block, each is an ordinary head-split value, not a piece of a concatenation that no contiguous
    split of the channels holds a rank's heads of."""
    for op in graph.ops:
        if not isinstance(op, IRFwOperation) or op.name != "cat" or len(op.outputs) != 1 or len(op.inputs) < 2:
            continue
        z = op.outputs[0]
        parts = op.args[0] if op.args else ()
        if list(parts) != list(op.inputs) or len(set(map(id, parts))) != len(parts):
            continue
        d = _arg(op, 1, "dim", 0) % z.ndim
        chain, moved, convs = _chain(z, readers, makers, graph.loss)
        if not chain or any(c.name in _MOVES and c.name != "transpose" and c.name != "contiguous" for c in chain):
            continue   # moves other than transposes could change which dim the blocks are along
        cut_of = moved[-1][0]
        cuts = readers.get(id(cut_of), [])
        if len(cuts) != 1:
            continue
        got = _blocks(cuts[0], cut_of)
        if got is None or len({c for c, _ in got}) != 1:
            continue
        c = got[0][0]
        label = moved[-1][1][c]
        if label != d or not _along(chain, moved, d, z.ndim, convs):
            continue
        starts = [0]
        for t in parts:
            starts.append(starts[-1] + t.shape[d])
        if [(b.start, b.stop) for _, b in got] != list(zip(starts, starts[1:])) or any(b.drops for _, b in got):
            continue
        new_ops: List[IRFwOperation] = []
        for t, (_, blk), (lo, hi) in zip(parts, got, zip(starts, starts[1:])):
            name = blk.out.hint if blk.out.hint and blk.out.hint.isidentifier() else f"{lo}_{hi}"
            conv_ops, conv_inputs = _conv_blocks(convs, lo, hi, name, registry, subs)
            new_ops += conv_ops + _replay(tuple(chain), t, blk.out, registry, conv_inputs, (lo, hi))
        replace[id(op)] = new_ops
        for gone in [cuts[0], *chain, *(m for _, _, moves, _ in convs for m in moves)]:
            replace[id(gone)] = []
        return True
    return False


def split_params(graph: IRGraph, registry: Registry) -> IRGraph:
    """``graph`` with each parameter that only a ``split`` reads, cut into blocks along one dim, read
    as one sub-parameter per block (module docstring); the graph itself when there is none."""
    readers: Dict[int, List[IRFwOperation]] = {}
    for op in graph.ops:
        for t in op.inputs:
            readers.setdefault(id(t), []).append(op)
    subs: Dict[int, IRTensor] = {}          # a split's output -> its sub-parameter
    params: Dict[int, List[IRTensor]] = {}  # a parameter -> its sub-parameters
    gone = set()
    for op in graph.ops:
        if not isinstance(op, IRFwOperation) or op.name not in _SPLITS or len(op.inputs) != 1 or not op.args:
            continue
        p = op.inputs[0]
        if op.args[0] is not p or p.kind is not TensorKind.PARAM or readers.get(id(p)) != [op] or not p.ndim or \
                any(o is graph.loss or o.ndim != p.ndim for o in op.outputs) or len(op.outputs) < 2:
            continue
        d = _arg(op, 2, "dim", 0) % p.ndim
        starts = [0]
        for o in op.outputs:
            starts.append(starts[-1] + o.shape[d])
        if starts[-1] != p.shape[d]:
            continue
        labels = _assigned(op.source[2] if op.source else "")
        if len(labels) != len(op.outputs) or len(set(labels)) != len(labels):
            labels = [f"{a}_{b}" for a, b in zip(starts, starts[1:])]
        params[id(p)] = []
        for o, a, b, label in zip(op.outputs, starts, starts[1:], labels):
            sub = _sub(p, d, a, b, label)
            subs[id(o)] = sub
            params[id(p)].append(sub)
        gone.add(id(op))
    if not subs:
        return graph
    ops = []
    for op in graph.ops:
        if id(op) in gone:
            continue
        if any(id(t) in subs for t in op.inputs):
            op = _reread(op, subs, registry)
        ops.append(op)
    attrs = [new for t in graph.attrs for new in params.get(id(t), [t])]
    return IRGraph(ops, attrs, graph.loss, graph.name)


def _reread(op: IRFwOperation, subs: Dict[int, IRTensor], registry: Registry) -> IRFwOperation:
    """``op`` reading ``subs[id(t)]`` wherever it read ``t``."""
    def swap(a):
        if isinstance(a, IRTensor):
            return subs.get(id(a), a)
        if isinstance(a, (list, tuple)):
            return type(a)(swap(x) for x in a)
        return a
    new = IRFwOperation(name=op.name, inputs=[swap(t) for t in op.inputs], outputs=list(op.outputs),
                        target=op.target, args=swap(tuple(op.args)), kwargs={k: swap(v) for k, v in op.kwargs.items()},
                        module_path=op.module_path, source=op.source, grad_enabled=op.grad_enabled)
    registry.annotate(new)
    return new


def _own_param(t, op: IRFwOperation, readers) -> bool:
    """``t`` is a parameter that only ``op`` reads, once."""
    return isinstance(t, IRTensor) and t.kind is TensorKind.PARAM and readers.get(id(t)) == [op] and \
        sum(x is t for x in op.inputs) == 1


def _find(op: IRFwOperation, readers, makers, loss: IRTensor, consts) -> Optional[_Fused]:
    """The fused projection ``op`` is, or None (see the module docstring for when)."""
    w_at, fdim, b_at = _MATMULS[op.name]
    if op.name == "addmm":
        if any(op.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")) or set(op.kwargs) - {"beta", "alpha"}:
            return None
    elif op.kwargs:
        return None
    args = op.args
    w = args[w_at] if len(args) > w_at else None
    transpose = _transposed_param(w, op, readers, makers)
    if transpose is not None:   # x @ W.t() (Falcon), linear(x, W.t(), b) (Conv1D's rows, cube.trace.rows)
        w, fdim = transpose.inputs[0], 1 - fdim
        if not _own_param(w, transpose, readers) or len(op.outputs) != 1:
            return None
    elif not _own_param(w, op, readers) or w.ndim != 2 or len(op.outputs) != 1:
        return None
    features = w.shape[fdim]
    b = args[b_at] if b_at is not None and len(args) > b_at else None
    if b is not None and not (_own_param(b, op, readers) and b.shape == (features,)):
        return None
    y = op.outputs[0]
    if not y.ndim or y.shape[-1] != features or y is loss:
        return None
    view, z, dims = None, y, {y.ndim - 1}
    after = readers.get(id(y), [])
    if len(after) == 1 and after[0].name in _RESHAPES and after[0].inputs == [y] and len(after[0].outputs) == 1:
        view, z = after[0], after[0].outputs[0]
        dims = {c for c in range(z.ndim) if math.prod(z.shape[c:]) == features}
    chain, moved, convs = _chain(z, readers, makers, loss)
    cut_of = moved[-1][0] if chain else z
    cuts = readers.get(id(cut_of), [])
    if not cuts or cut_of is loss:
        return None
    blocks: List[_Block] = []
    for cut in cuts:
        got = _blocks(cut, cut_of, consts, makers)
        if got is None:
            return None
        blocks += got
    dim = {d for d, _ in blocks}
    if len(dim) != 1:
        return None
    c = dim.pop()
    if chain:   # the cut dim of the chain's last tensor back to ``z``'s, the others in their order
        last = c
        c = _through(moved[-1][1], c, z.ndim)
        # a view makes each cut's tensor of unit blocks after moves alone; otherwise (Mamba's
        # ``in_proj(x).transpose(1, 2).chunk(2, dim=1)``, Mamba-2's x, B and C cut after their conv) each
        # block's matmul output goes through the chain itself (``_replay``)
        moves_only = all(op.name in _MOVES for op in chain)
        if c is None or ((any(blk.stop - blk.start != 1 for _, blk in blocks) or not moves_only) and
                         (view is not None or any(blk.drops for _, blk in blocks))):
            return None
        if not moves_only and not _along(chain, moved, moved[-1][1][last], z.ndim, convs):
            return None
    if c not in dims:
        return None
    blocks = sorted((blk for _, blk in blocks), key=lambda blk: blk.start)
    edge = 0
    for blk in blocks:
        if blk.start != edge or blk.stop <= blk.start or not readers.get(id(blk.out)) or blk.out is loss:
            return None
        edge = blk.stop
    if edge != z.shape[c] or len(blocks) < 2:
        return None
    return _Fused(op, w, fdim, b, view, cuts, blocks, math.prod(z.shape[c + 1:]), transpose, tuple(chain),
                  tuple(convs))


def _chain(z: IRTensor, readers, makers, loss) -> Tuple[List[IRFwOperation], List[Tuple[IRTensor, List[Optional[int]]]],
                                                      list]:
    """The ops after ``z``, each its tensor's only reader, that move dims or add and drop dims of size
    1, or keep every dim where it is (``_keeps_dims``: elementwise ops of one tensor, slices, depthwise
    convolutions); with, per op, its output and the dim of ``z`` each of the output's dims is (None: a
    new dim of size 1), and the depthwise convolutions (``_Fused.convs``). Empty when the next op is
    none of them."""
    ops: List[IRFwOperation] = []
    moved: List[Tuple[IRTensor, List[Optional[int]]]] = []
    convs = []
    t, labels = z, list(range(z.ndim))
    while True:
        after = readers.get(id(t), [])
        if len(after) != 1 or t is loss:
            break
        op = after[0]
        if len(op.outputs) != 1 or not op.args or op.args[0] is not t:
            break
        if op.name in _MOVES:
            if op.inputs != [t] or op.kwargs:
                break
            labels = _moved(op, t, labels)
            if labels is None or len(labels) != op.outputs[0].ndim:
                break
        else:
            conv = _depthwise(op, t, readers, makers)
            if conv is None and not _keeps_dims(op, t) and _scale(op, t, makers) is None:
                break
            if conv is not None:
                convs.append(conv)
        ops.append(op)
        t = op.outputs[0]
        moved.append((t, labels))
    return ops, moved, convs


def _keeps_dims(op: IRFwOperation, t: IRTensor) -> bool:
    """``op`` reads ``t`` alone and keeps each of its dims where it is: an elementwise op drawing no
    random numbers (a cast, an activation) or a slice with step 1 (a causal conv's output cut to the
    sequence); ``_along`` checks that a slice cuts no block dim."""
    out = op.outputs[0]
    if op.inputs != [t] or out.ndim != t.ndim:
        return False
    if op.name in ("slice", "narrow"):
        return op.name == "narrow" or _arg(op, 4, "step", 1) == 1
    return op_info(op.name).rule == "elementwise" and tuple(out.shape) == tuple(t.shape) and \
        not draws(op.target, op.args, op.kwargs)


def _scale(op: IRFwOperation, t: IRTensor, makers) -> Optional[IRTensor]:
    """The other operand when ``op`` is ``t * c`` (or ``/``, ``+``, ``-``) with ``c`` a parameter, buffer
    or constant (or a slice of one: a block's range, cut again) broadcast to ``t`` that keeps its dims
    (Falcon-H1's ``in_proj(h) * mup_vector``, a scale per feature); else None. Each block reads its own
    range of ``c`` (``_replay``)."""
    if op.name not in _SCALES or len(op.inputs) != 2 or len(op.args) < 2 or \
            op.args[0] is not t or op.kwargs or op_info(op.name).rule != "elementwise":
        return None
    c = op.args[1]
    if not isinstance(c, IRTensor) or c is not op.inputs[1]:
        return None
    if not constant(c, makers):
        return None
    lead = t.ndim - c.ndim
    if lead < 0 or any(s not in (1, t.shape[lead + d]) for d, s in enumerate(c.shape)) or \
            tuple(op.outputs[0].shape) != tuple(t.shape):
        return None
    return c


def _depthwise(op: IRFwOperation, t: IRTensor, readers, makers):
    """``(op, weight parameter, moves from it to the conv, bias parameter or None)`` when ``op`` is a
    depthwise convolution of ``t`` (one channel a group, Mamba's causal ``conv1d``) whose weight (through
    moves: ``weight.squeeze(1)`` then ``unsqueeze(1)``) and bias only it reads; else None."""
    if op.name not in ("conv1d", "conv2d", "conv3d") or op.inputs[0] is not t or len(op.inputs) not in (2, 3):
        return None
    w = op.inputs[1]
    channels = t.shape[1] if t.ndim == w.ndim else None
    if channels is None or _arg(op, 6, "groups", 1) != channels or w.shape[0] != channels or w.shape[1] != 1 or \
            op.outputs[0].shape[1] != channels or readers.get(id(w)) != [op]:
        return None
    moves: List[IRFwOperation] = []
    while w.kind is not TensorKind.PARAM:
        m = makers.get(id(w))
        if m is None or m.name not in _MOVES or len(m.inputs) != 1 or len(m.outputs) != 1 or m.kwargs:
            return None
        moves.insert(0, m)
        w = m.inputs[0]
        if readers.get(id(w)) != [m]:
            return None
    labels: Optional[List[Optional[int]]] = list(range(w.ndim))
    for m in moves:
        labels = _moved(m, m.inputs[0], labels) if labels is not None else None
    if labels is None or labels[0] != 0 or readers.get(id(w)) != ([moves[0]] if moves else [op]):
        return None   # the conv's output channels must be the parameter's dim 0
    b = op.inputs[2] if len(op.inputs) == 3 else None
    if b is not None and not (b.kind is TensorKind.PARAM and readers.get(id(b)) == [op] and b.shape == (channels,)):
        return None
    return op, w, tuple(moves), b


def _along(chain, moved, label: Optional[int], n: int, convs) -> bool:
    """Whether the block dim (``label``: the dim of ``z`` it is) is where each depthwise conv of the chain
    has its channels (dim 1) and no slice of the chain cuts it."""
    conv_ops = {id(c[0]) for c in convs}
    for k, op in enumerate(chain):
        labels = moved[k - 1][1] if k else list(range(n))
        if label not in labels:
            return False
        at = labels.index(label)
        if id(op) in conv_ops and at != 1:
            return False
        if op.name in ("slice", "narrow") and _arg(op, 1, "dim", 0) % op.inputs[0].ndim == at:
            return False
    return True


def _moved(op: IRFwOperation, t: IRTensor, labels: List[Optional[int]]) -> Optional[List[Optional[int]]]:
    """``labels`` (per dim of ``t``, the dim of ``z`` it is) after ``op``, or None: not a move."""
    n, args = t.ndim, op.args[1:]
    if op.name == "contiguous":
        return None if args else list(labels)
    if op.name == "unsqueeze" and len(args) == 1 and isinstance(args[0], int):
        d = args[0] % (n + 1)
        return labels[:d] + [None] + labels[d:]
    if op.name == "squeeze":
        dims = [a % n for a in (args[0] if args and isinstance(args[0], (list, tuple)) else args)] \
            if args else [d for d in range(n) if t.shape[d] == 1]
        if any(not isinstance(d, int) or t.shape[d] != 1 for d in dims):
            return None
        return [lab for d, lab in enumerate(labels) if d not in dims or t.shape[d] != 1]
    if op.name == "transpose" and len(args) == 2 and all(isinstance(a, int) for a in args):
        a, b = args[0] % n, args[1] % n
        out = list(labels)
        out[a], out[b] = out[b], out[a]
        return out
    if op.name == "permute" and len(args) == 1 and len(args[0]) == n:
        return [labels[d % n] for d in args[0]]
    return None


def _through(labels: List[Optional[int]], c: int, n: int) -> Optional[int]:
    """The dim of ``z`` (of ``n`` dims) that the chain's dim ``c`` is, when the chain kept every other
    dim of ``z`` of more than one element in its order (size-1 dims may come and go); else None."""
    if c >= len(labels) or labels[c] is None:
        return None
    rest = [lab for d, lab in enumerate(labels) if d != c and lab is not None]
    return labels[c] if rest == sorted(rest) else None


def _transposed_param(w, op: IRFwOperation, readers, makers) -> Optional[IRFwOperation]:
    """The ``t``/``transpose`` of a 2-D parameter that makes ``w``, read only by ``op``, or None."""
    maker = makers.get(id(w)) if isinstance(w, IRTensor) else None
    if maker is None or maker.name not in ("t", "transpose", "numpy_T") or w.ndim != 2 or \
            readers.get(id(w)) != [op] or len(maker.inputs) != 1 or maker.inputs[0].ndim != 2:
        return None
    return maker if maker.inputs[0].kind is TensorKind.PARAM else None


def _arg(op: IRFwOperation, i: int, name: str, default=None):
    return op.args[i] if len(op.args) > i else op.kwargs.get(name, default)


def _blocks(cut: IRFwOperation, z: IRTensor, consts=None, makers=None) -> Optional[List[Tuple[int, _Block]]]:
    """``(dim, block)`` of each block ``cut`` makes of ``z``, or None: not a cut of one dim of ``z``."""
    if cut.name == "index":
        return _index_block(cut, z, consts or {}, makers or {})
    if cut.inputs != [z] or not cut.args or cut.args[0] is not z or not z.ndim:
        return None
    n = z.ndim
    if cut.name in ("split", "split_with_sizes", "chunk", "unsafe_split"):
        d = _arg(cut, 2, "dim", 0) % n
        out, start = [], 0
        for o in cut.outputs:
            if o.ndim != n:
                return None
            out.append((d, _Block(start, start + o.shape[d], o, False, cut)))
            start += o.shape[d]
        return out if start == z.shape[d] else None
    if cut.name in ("unbind", "select"):
        d = _arg(cut, 1, "dim", 0) % n
        if cut.name == "unbind":
            picks = list(range(z.shape[d]))
            if len(cut.outputs) != len(picks):
                return None
        else:
            picks = [_arg(cut, 2, "index") % z.shape[d]]
        return [(d, _Block(i, i + 1, o, True, cut)) for i, o in zip(picks, cut.outputs)]
    if cut.name in ("slice", "narrow") and len(cut.outputs) == 1:
        d = _arg(cut, 1, "dim", 0) % n
        size = z.shape[d]
        if cut.name == "narrow":
            start = _arg(cut, 2, "start") % size
            stop = start + _arg(cut, 3, "length")
        else:
            if _arg(cut, 4, "step", 1) != 1:
                return None
            start, stop = _arg(cut, 2, "start"), _arg(cut, 3, "end")
            start = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
            stop = size if stop is None else min(max(stop + size if stop < 0 else stop, start), size)
        o = cut.outputs[0]
        if o.ndim != n or o.shape[d] != stop - start:
            return None
        return [(d, _Block(start, stop, o, False, cut))]
    return None


def _index_block(cut: IRFwOperation, z: IRTensor, consts, makers) -> Optional[List[Tuple[int, _Block]]]:
    """``z[..., [i, i+1, ...], ...]`` with a constant list of consecutive indices (Falcon's
    ``fused_qkv[..., [-2], :]``): the block ``[i, i + len)`` of that dim, or None."""
    if len(cut.args) != 2 or cut.args[0] is not z or len(cut.outputs) != 1 or not z.ndim:
        return None
    index = list(cut.args[1])
    at = [d for d, i in enumerate(index) if i is not None]
    if len(at) != 1 or len(cut.inputs) != 2:
        return None
    d, c = at[0], index[at[0]]
    lift = makers.get(id(c)) if isinstance(c, IRTensor) else None
    if lift is not None and lift.name == "lift_fresh_copy":   # the constant list, copied as export writes it
        c = lift.inputs[0]
    value = consts.get(c.names[0]) if isinstance(c, IRTensor) and c.kind is TensorKind.CONST else None
    if value is None or value.ndim != 1 or value.dtype.is_floating_point or value.dtype == torch.bool or \
            not value.numel():
        return None
    picks = [int(v) % z.shape[d] for v in value]
    if picks != list(range(picks[0], picks[0] + len(picks))):
        return None
    o = cut.outputs[0]
    if o.ndim != z.ndim or o.shape[d] != len(picks):
        return None
    return [(d, _Block(picks[0], picks[0] + len(picks), o, False, cut))]


def _labels(f: _Fused) -> List[str]:
    """A name per block: the variable the model's line assigns it to (``query_states``), when
    every block has a distinct one; else its range of output features (``0_32``)."""
    names: Dict[int, str] = {}
    for cut in f.cuts:
        targets = _assigned(cut.source[2] if cut.source else "")
        outs = cut.outputs
        if len(targets) == len(outs):
            names.update((id(o), n) for o, n in zip(outs, targets))
    labels = [names.get(id(b.out)) for b in f.blocks]
    if None in labels or len(set(labels)) != len(labels):
        labels = [f"{b.start * f.unit}_{b.stop * f.unit}" for b in f.blocks]
    return labels


def _assigned(code: str) -> List[str]:
    """The names a one-line assignment binds, in order (``q, k, v = ...`` -> ``[q, k, v]``), or []."""
    try:
        tree = ast.parse(code.strip())
    except SyntaxError:
        return []
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assign) or len(tree.body[0].targets) != 1:
        return []
    target = tree.body[0].targets[0]
    items = target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]
    names = [t.id for t in items if isinstance(t, ast.Name)]
    return names if len(names) == len(items) else []


def _sub(p: IRTensor, dim: int, start: int, stop: int, label: str) -> IRTensor:
    """The sub-parameter of ``p`` holding ``[start, stop)`` along ``dim``."""
    shape = tuple(stop - start if d == dim else s for d, s in enumerate(p.shape))
    box = tuple((start, stop) if d == dim else (0, s) for d, s in enumerate(p.shape))
    return IRTensor(shape, p.dtype, p.requires_grad, TensorKind.PARAM, f"{p.names[0]}.{label}", p.names,
                    region=p.user_box(box), full=p.user_shape)


def _again(op: IRFwOperation, inputs: List[IRTensor], args: tuple, shape: tuple, registry: Registry,
           out: Optional[IRTensor] = None, kwargs: Optional[dict] = None) -> IRFwOperation:
    """``op`` called again on ``inputs`` (``args`` and ``kwargs`` laid out as its own), making ``out`` or
    a new tensor of ``shape``."""
    y = op.outputs[0]
    out = out if out is not None else IRTensor(shape, y.dtype, y.requires_grad, TensorKind.ACTIVATION, y.hint)
    new = IRFwOperation(name=op.name, inputs=inputs, outputs=[out], target=op.target, args=args,
                        kwargs=dict(op.kwargs if kwargs is None else kwargs), module_path=op.module_path,
                        source=op.source, grad_enabled=op.grad_enabled)
    registry.annotate(new)
    return new


def _moved_shape(op: IRFwOperation, t: IRTensor) -> tuple:
    return tuple(1 if d is None else t.shape[d] for d in _moved(op, t, list(range(t.ndim))))


def _replay(chain: Tuple[IRFwOperation, ...], start: IRTensor, end: IRTensor, registry: Registry,
            conv_inputs: Dict[int, Tuple[IRTensor, Optional[IRTensor]]], span: Tuple[int, int]
            ) -> List[IRFwOperation]:
    """The ops of ``chain`` applied to one block's matmul output ``start``, the last making the cut's
    tensor ``end``: the same ops on a tensor narrower along the block dim; a depthwise conv on the
    block's channels (``conv_inputs``: conv id -> the block's weight and bias), one group each; a scale
    per feature (``_scale``) by its slice ``span`` (the block's ``[lo, hi)`` along the block dim)."""
    ops, t = [], start
    for k, op in enumerate(chain):
        if op.name in _MOVES:
            shape = _moved_shape(op, t)
        else:   # the dims stay: the block dim is the one ``t`` is narrower along
            at = [d for d in range(t.ndim) if t.shape[d] != op.inputs[0].shape[d]]
            if len(at) != 1:
                raise CubeInternalError(f"fused projection: block {end.hint!r} of shape {tuple(t.shape)} at op "
                                        f"{op.name!r} of {tuple(op.inputs[0].shape)}")
            shape = tuple(t.shape[d] if d == at[0] else s for d, s in enumerate(op.outputs[0].shape))
        last = k == len(chain) - 1
        if last and shape != tuple(end.shape):
            raise CubeInternalError(f"fused projection: the ops after block {end.hint!r} give {shape}, its cut "
                                    f"{tuple(end.shape)}")
        args, kwargs, inputs = [t] + list(op.args[1:]), dict(op.kwargs), [t]
        # the chain's only two-input op besides a conv: a scale (``_scale``)
        c = op.inputs[1] if op.name in _SCALES and len(op.inputs) == 2 and id(op) not in conv_inputs else None
        if c is not None:   # the block's range of a per-feature scale; a scale of size 1 there is read whole
            j = at[0] - (t.ndim - c.ndim)
            if j >= 0 and c.shape[j] > 1:
                c = _sliced(c, j, span, op, registry, ops)
            args[1], inputs = c, [t, c]
        if id(op) in conv_inputs:   # conv(input, weight, bias, stride, padding, dilation, groups)
            w, b = conv_inputs[id(op)]
            inputs = [t, w] + ([b] if b is not None else [])
            for i, name, value in ((1, "weight", w), (2, "bias", b), (6, "groups", t.shape[1])):
                if i < len(args):
                    args[i] = value
                elif name in kwargs or value is not None:
                    kwargs[name] = value
        new = _again(op, inputs, tuple(args), shape, registry, end if last else None, kwargs)
        ops.append(new)
        t = new.outputs[0]
    return ops


def _sliced(c: IRTensor, dim: int, span: Tuple[int, int], op: IRFwOperation, registry: Registry,
            ops: List[IRFwOperation]) -> IRTensor:
    """``c[..., lo:hi, ...]`` along ``dim``, its slice op appended to ``ops``."""
    lo, hi = span
    out = IRTensor(tuple(hi - lo if d == dim else s for d, s in enumerate(c.shape)), c.dtype, c.requires_grad,
                   TensorKind.ACTIVATION, c.hint)
    sl = IRFwOperation(name="slice", inputs=[c], outputs=[out], target=torch.ops.aten.slice.Tensor,
                       args=(c, dim, lo, hi, 1), kwargs={}, module_path=op.module_path, source=op.source,
                       grad_enabled=op.grad_enabled)
    registry.annotate(sl)
    ops.append(sl)
    return out


def _conv_blocks(convs, lo: int, hi: int, label: str, registry: Registry, subs: Dict[int, List[IRTensor]]
                 ) -> Tuple[List[IRFwOperation], Dict[int, Tuple[IRTensor, Optional[IRTensor]]]]:
    """For one block (channels ``[lo, hi)``), each depthwise conv's weight and bias pieces (sub-parameters,
    added to ``subs``) and the moves making the conv's weight of the weight's piece."""
    ops: List[IRFwOperation] = []
    inputs: Dict[int, Tuple[IRTensor, Optional[IRTensor]]] = {}
    for conv, w, moves, b in convs:
        wt = _sub(w, 0, lo, hi, label)
        subs.setdefault(id(w), []).append(wt)
        for m in moves:
            new = _again(m, [wt], (wt,) + tuple(m.args[1:]), _moved_shape(m, wt), registry)
            ops.append(new)
            wt = new.outputs[0]
        bt = None
        if b is not None:
            bt = _sub(b, 0, lo, hi, label)
            subs.setdefault(id(b), []).append(bt)
        inputs[id(conv)] = (wt, bt)
    return ops, inputs


def _cut(f: _Fused, registry: Registry) -> Tuple[Tuple[List[IRFwOperation], List[IRFwOperation]], List[IRTensor],
                                                 List[IRTensor], Dict[int, List[IRTensor]]]:
    """The ops replacing ``f.op`` (a matmul per block; then the reshapes to the cuts' shapes, or the
    chain again per block), the weight's and bias's sub-parameters, and the sub-parameters of each
    depthwise conv's weight and bias in the chain (parameter id -> one per block)."""
    op, y = f.op, f.op.outputs[0]
    matmuls, reshapes, weights, biases = [], [], [], []
    conv_subs: Dict[int, List[IRTensor]] = {}
    for blk, label in zip(f.blocks, _labels(f)):
        lo, hi = blk.start * f.unit, blk.stop * f.unit
        w = _sub(f.weight, f.feature_dim, lo, hi, label)
        b = _sub(f.bias, 0, lo, hi, label) if f.bias is not None else None
        weights.append(w)
        if b is not None:
            biases.append(b)
        swap = {id(f.weight): w, id(f.bias): b}
        if f.transpose is not None:   # the block's own transpose of its piece of the weight
            tr = f.transpose
            wt = IRTensor(tuple(reversed(w.shape)), w.dtype, w.requires_grad, TensorKind.ACTIVATION,
                          tr.outputs[0].hint)
            top = IRFwOperation(name=tr.name, inputs=[w], outputs=[wt], target=tr.target,
                                args=(w,) + tuple(tr.args[1:]), kwargs=dict(tr.kwargs), module_path=tr.module_path,
                                source=tr.source, grad_enabled=tr.grad_enabled)
            registry.annotate(top)
            matmuls.append(top)
            swap[id(tr.outputs[0])] = wt
        shape = y.shape[:-1] + (hi - lo,)
        if label.isidentifier():
            blk.out.hint = label
        replay = bool(f.chain) and f.view is None and not blk.drops
        direct = f.view is None and not blk.drops and not f.chain   # the matmul makes the cut's tensor itself
        out = blk.out if direct else IRTensor(shape, y.dtype, y.requires_grad, TensorKind.ACTIVATION,
                                              label if label.isidentifier() else y.hint)
        args = tuple(swap.get(id(a), a) if isinstance(a, IRTensor) else a for a in op.args)
        mm = IRFwOperation(name=op.name, inputs=[swap.get(id(t), t) for t in op.inputs], outputs=[out],
                           target=op.target, args=args, kwargs=dict(op.kwargs), module_path=op.module_path,
                           source=op.source, grad_enabled=op.grad_enabled)
        registry.annotate(mm)
        matmuls.append(mm)
        if replay:
            conv_ops, conv_inputs = _conv_blocks(f.convs, lo, hi, label, registry, conv_subs)
            reshapes += conv_ops + _replay(f.chain, out, blk.out, registry, conv_inputs, (lo, hi))
        elif not direct:
            target = f.view.target if f.view is not None and f.view.name != "unflatten" else \
                torch.ops.aten.view.default
            cut = blk.cut
            rs = IRFwOperation(name=target._schema.name.split("::")[-1], inputs=[out], outputs=[blk.out],
                               target=target, args=(out, list(blk.out.shape)), kwargs={},
                               module_path=cut.module_path, source=cut.source, grad_enabled=cut.grad_enabled)
            registry.annotate(rs)
            reshapes.append(rs)
    return (matmuls, reshapes), weights, biases, conv_subs
