"""The IR graph and the primitives a policy uses on it."""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterable, List, Optional, Sequence, Union

from cube.ir.blocks import rerun_hazard
from cube.ir.operator import IRDataOperation, IRFwOperation, IROperator
from cube.ir.tensor import IRTensor, TensorKind


class IRGraph:
    """A traced training step: the data operation, then forward ops in order.

    Backward is not in the graph: the generated code runs autograd over the
    forward. Attributes are plain data; a graph belongs to one compile.

    Attributes:
        ops: operators in program order (pieces replace their op in place).
        attrs: parameters, buffers and constants in the model's order.
        loss: the scalar the forward returns.
        name: the user's model class name.
    """

    def __init__(self, ops: List[IROperator], attrs: List[IRTensor], loss: IRTensor,
                 name: str = "Model"):
        self.ops = list(ops)
        self.attrs = list(attrs)
        self.loss = loss
        self.name = name
        self.recompute_groups: List[List[IROperator]] = []
        self.stages: List[List[IROperator]] = []
        self.schedule = None   # a cube.schedule.Schedule, set by cube.schedule.sched_*
        self.zero = 0   # ZeRO stage of the plan (cube.compile(zero=)); 3 shards parameters in the plan
        self.precision = None   # None, "bf16", "fp16", "fp8", "bf16-autocast", "fp16-autocast" (cube.compile(precision=))
        self.tp_reduce_dtype = None   # partial products summed in this dtype (cube.compile(tp_reduce_dtype=))
        self.exact_rng = False   # random ops draw the single device's numbers (cube.compile(exact_rng=))
        # a pipeline plan's graph traced on one micro-batch of the global batch: how a step cuts the
        # batch and what each micro-batch's loss is a share of (cube.passes.micro.MicroBatches)
        self.micro = None
        # splits the policy asked for that the plan does not keep (cube.ir.lost.LostSplit), recorded
        # by cube.toolkit.place
        self.lost: list = []
        self._pos: Dict[int, int] = {}   # op id -> position in ops (checked on use, see _find)
        self._next = 0                    # where the op after the latest replaced one is

    # ------------------------------------------------------------------ queries
    def nodes(self) -> List[IROperator]:
        """All operators (pieces included) in program order."""
        return list(self.ops)

    def select(self, name: Optional[str] = None, ntype: Optional[type] = None) -> List[IROperator]:
        """Operators whose op name is ``name`` and/or that are instances of ``ntype``.

        Without ``ntype`` only forward operators are considered when ``name`` is given.
        """
        out = []
        for op in self.ops:
            if ntype is not None and not isinstance(op, ntype):
                continue
            if name is not None and op.name != name:
                continue
            out.append(op)
        return out

    # --------------------------------------------------------------- primitives
    def _check_member(self, op: IROperator, what: str) -> int:
        if not isinstance(op, IROperator):
            raise TypeError(f"graph.{what} expects an op of this graph, got {type(op).__name__}: {op!r}")
        i = self._find(op)
        if i is not None:
            return i
        raise ValueError(f"graph.{what}: {op!r} is not in the graph (already partitioned or replicated? "
                         f"use the pieces it returned)")

    def _find(self, op: IROperator) -> Optional[int]:
        """The position of ``op`` in ``ops``, or None.

        Positions are cached and checked before use; a replacement records its
        pieces' positions and where the next op now is, so a policy walking the
        graph in program order finds each op in constant time (no scan per op).
        """
        ops = self.ops
        for i in (self._pos.get(id(op)), self._next):
            if i is not None and i < len(ops) and ops[i] is op:
                return i
        self._pos = {id(o): k for k, o in enumerate(ops)}
        return self._pos.get(id(op))

    def _replace(self, op: IROperator, pieces: Sequence[IROperator]) -> None:
        i = self._check_member(op, "replace")
        pieces = list(pieces)
        self.ops[i:i + 1] = pieces
        self._pos.pop(id(op), None)
        self._pos.update((id(p), i + k) for k, p in enumerate(pieces))
        self._next = i + len(pieces)

    def partition(self, node: IROperator, algo, idx: Optional[int] = None, dim: Optional[int] = None,
                  num: Optional[int] = None, *, over=None) -> List[IROperator]:
        """Splits ``node`` into ``num`` pieces along input ``idx``'s dimension ``dim``.

        Two forms: ``graph.partition(node, node.algorithms("dim"), idx=1, dim=0, num=2)``,
        or by a letter of ``node.anno``: ``graph.partition(node, "h", over=mesh["tp"])``
        (``over``: a mesh dimension, one piece per coordinate; or ``num=``).

        Returns:
            The pieces in order; each still needs a device.

        Raises:
            ValueError: the split is illegal or uneven (the message lists the legal pairs
                or letters).
            TypeError: neither a letter nor ``idx``/``dim`` given, or no ``num``/``over``.
        """
        self._check_member(node, "partition")
        if over is not None:
            size = getattr(over, "size", None)
            if not isinstance(size, int):
                raise TypeError(f"graph.partition: over= takes a mesh dimension such as mesh['tp'], got {over!r}")
            if num is not None and num != size:
                raise ValueError(f"graph.partition({node!r}): num={num} disagrees with over={over!r}; give one")
            num = size
        if num is None:
            raise TypeError(f"graph.partition({node!r}) needs the number of pieces: num=n or over=mesh['dim']")
        if isinstance(algo, str) and algo != "dim":
            if idx is not None or dim is not None:
                raise TypeError(f"graph.partition({node!r}, {algo!r}): name the dimension by its letter or by "
                                f"idx=/dim=, not both")
            idx, dim = _by_letter(node, algo)
        elif idx is None or dim is None:
            raise TypeError(f"graph.partition({node!r}) needs idx= and dim= (or a letter of its annotation "
                            f"in place of the algorithm, e.g. graph.partition(node, 'h', num=2))")
        if isinstance(algo, str) and isinstance(node, IRFwOperation):
            algo = node.algorithms("dim")
        if isinstance(node, IRDataOperation):
            return self._partition_data(node, idx, dim, num)
        if algo is None or getattr(algo, "op", None) is not node:
            raise ValueError(f"graph.partition: algo must come from node.algorithms('dim') of the same op {node!r}")
        ident = algo.check(idx, dim, num)
        if isinstance(node, IRFwOperation):
            _same_tensor_cut_alike(node, ident.name)
        pieces = [_copy(node, splits=node.splits + ((ident.name, i, num),)) for i in range(num)]
        self._replace(node, pieces)
        return pieces

    def _partition_data(self, node: IRDataOperation, idx: int, dim: int, num: int) -> List[IROperator]:
        t = node.outputs[idx] if 0 <= idx < len(node.outputs) else None
        if t is None or not -t.ndim <= dim < t.ndim:
            raise ValueError(f"illegal split of the data operation at idx={idx}, dim={dim}: "
                             f"the batch tensors are {node.outputs}")
        dim = dim % t.ndim
        size = t.shape[dim]
        for o in node.outputs:
            if o.ndim <= dim or o.shape[dim] != size:
                raise ValueError(f"the data operation splits every batch tensor along dim {dim}, but {o!r} "
                                 f"does not have size {size} there")
        for factor, _, n in node.splits:   # a piece of a piece splits what is left
            if factor == str(dim):
                size //= n
        if size % num:
            raise ValueError(f"uneven split of the data operation: dim {dim} has size {size} here, which {num} "
                             f"does not divide. Use a global batch size divisible by the number of pieces.")
        pieces = [_copy(node, splits=node.splits + ((str(dim), i, num),)) for i in range(num)]
        self._replace(node, pieces)
        return pieces

    def replicate(self, node: IROperator, times: int = 1) -> List[IROperator]:
        """Makes ``times`` full copies of ``node`` (each needs a device)."""
        self._check_member(node, "replicate")
        if not isinstance(times, int) or times < 1:
            raise ValueError(f"graph.replicate({node!r}): times must be a positive int, got {times!r}")
        pieces = [_copy(node, replicas=node.replicas + ((i, times),)) for i in range(times)]
        self._replace(node, pieces)
        return pieces

    def assign(self, node: Union[IROperator, Iterable[IROperator]], device: Union[int, Sequence[int]]) -> None:
        """Places an op (or each op of a list, e.g. a stage) on a device."""
        if isinstance(node, IROperator):
            nodes = [node]
        else:
            nodes = list(node)
        devs = (device,) if isinstance(device, int) else tuple(device)
        if not devs or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in devs):
            raise ValueError(f"graph.assign: device must be a non-negative int, got {device!r}")
        for n in nodes:
            self._check_member(n, "assign")
            n.device = devs

    def staging(self, starts: Sequence[IROperator]) -> List[List[IROperator]]:
        """Groups the forward ops into pipeline stages.

        Args:
            starts: the first op of each stage, in program order. Ops before the
                first start belong to the first stage.

        Returns:
            The stages in order, each a list of ops (``graph.assign(stage, dev)``
            places a whole stage; its ops may be partitioned first).

        Raises:
            ValueError: an op is not a forward op of the graph, or the starts are
                not in program order.
        """
        starts = list(starts)
        if not starts:
            raise ValueError("graph.staging needs the first op of each stage, got an empty list")
        where = []
        for n in starts:
            i = self._check_member(n, "staging")
            if not isinstance(n, IRFwOperation):
                raise ValueError(f"graph.staging: stages start at forward ops, got {n!r}")
            where.append(i)
        for k in range(1, len(where)):
            if where[k] <= where[k - 1]:
                a, b = starts[k - 1], starts[k]
                raise ValueError(
                    f"graph.staging: stage {k} starts at op {b.name!r} ({b.where()}), which is not after the start "
                    f"of stage {k - 1}, op {a.name!r} ({a.where()}); list the first op of each stage in program "
                    f"order (positions {where})")
        fw = [i for i, op in enumerate(self.ops) if isinstance(op, IRFwOperation)]
        bounds = [fw[0]] + where[1:] + [len(self.ops)]
        self.stages = [[op for op in self.ops[bounds[k]:bounds[k + 1]] if isinstance(op, IRFwOperation)]
                       for k in range(len(starts))]
        return [list(st) for st in self.stages]

    def recompute(self, nodes: Sequence[IROperator]) -> int:
        """Marks ``nodes`` as one recompute group: their activations are dropped after
        forward and made again in backward (``torch.utils.checkpoint``).

        Pieces that ``graph.partition``/``graph.replicate`` make later join the
        group of their op. Each rank runs every stretch of consecutive calls of
        one group as one checkpointed function (see ``cube.passes.recompute``).

        Returns:
            The group's id.

        Raises:
            ValueError: no ops, an op not in the graph or not a forward op, or an
                op that must not run twice (``cube.ir.blocks.rerun_hazard``).
        """
        nodes = list(nodes)
        if not nodes:
            raise ValueError("graph.recompute needs the ops of the group, got an empty list")
        for n in nodes:
            self._check_member(n, "recompute")
            if not isinstance(n, IRFwOperation):
                raise ValueError(f"graph.recompute: only forward ops can be recomputed, got {n!r}")
            why = rerun_hazard(n)
            if why:
                raise ValueError(f"graph.recompute: op {n.name!r} ({n.where()}) must not run twice: {why}. "
                                 f"Leave it out of the group (e.g. [op for op in ops if not "
                                 f"cube.ir.blocks.rerun_hazard(op)]; cube.ir.blocks.recompute_blocks does this)")
        gid = len(self.recompute_groups)
        for n in nodes:
            n.recompute = gid
        self.recompute_groups.append(nodes)
        return gid

    # ------------------------------------------------------------------ display
    def copy(self) -> "IRGraph":
        """A copy a policy may change without touching this graph: its own ops (own input and
        output lists, own placement, stages, schedule and recompute marks), the same tensors
        (plain data no policy changes). One trace then serves many plans (``cube.plan``, the
        search).
        """
        ops = [_copy(op, origin=op.origin, device=op.device) for op in self.ops]
        twin = {id(a): b for a, b in zip(self.ops, ops)}
        out = IRGraph(ops, self.attrs, self.loss, self.name)
        for op in ops:   # pieces point at the copies of what they were cut from
            if op.origin is not None:
                op.origin = twin.get(id(op.origin), op.origin)
        out.recompute_groups = [[twin.get(id(o), o) for o in g] for g in self.recompute_groups]
        out.stages = [[twin.get(id(o), o) for o in st] for st in self.stages]
        out.schedule, out.zero, out.precision = self.schedule, self.zero, self.precision
        out.tp_reduce_dtype = getattr(self, "tp_reduce_dtype", None)
        out.exact_rng = getattr(self, "exact_rng", False)
        out.micro = getattr(self, "micro", None)
        out.lost = [replace(r, node=twin.get(id(r.node), r.node)) for r in self.lost]
        return out

    def __repr__(self) -> str:
        lines = [f"IRGraph({self.name}, {len(self.ops)} ops, loss={self.loss!r})"]
        for op in self.ops:
            lines.append(f"  {op!r}")
        return "\n".join(lines)


def readers(ops: Iterable[IROperator]) -> Dict[int, List[IROperator]]:
    """Tensor id -> the ops of ``ops`` reading it, each once, in program order."""
    out: Dict[int, List[IROperator]] = {}
    for op in ops:
        for t in op.inputs:
            at = out.setdefault(id(t), [])
            if not at or at[-1] is not op:
                at.append(op)
    return out


def makers(ops: Iterable[IROperator]) -> Dict[int, IROperator]:
    """Tensor id -> the op of ``ops`` making it."""
    return {id(t): op for op in ops for t in op.outputs}


def constant(t: IRTensor, made: Dict[int, IROperator]) -> bool:
    """Whether ``t`` is a parameter, buffer or constant, or made of one by ``slice`` ops alone (``made``:
    ``makers`` of the graph)."""
    while t.kind is TensorKind.ACTIVATION:
        m = made.get(id(t))
        if m is None or m.name != "slice" or len(m.inputs) != 1:
            return False
        t = m.inputs[0]
    return t.kind in (TensorKind.PARAM, TensorKind.BUFFER, TensorKind.CONST)


def _by_letter(node: IROperator, letter: str) -> tuple:
    """The legal (idx, dim) whose dimension is ``letter`` in ``node.anno``.

    Raises:
        ValueError: the op has no annotation, or ``letter`` is absent, marked ``^`` or only
            an inner factor of a merged dimension; the message lists the letters that may be split.
    """
    if not isinstance(node, IRFwOperation):
        raise ValueError(f"graph.partition: the data operation has no annotation; split the batch with "
                         f"graph.partition(data, None, idx=0, dim=0, num=n), got letter {letter!r}")
    algo = node.algorithms("dim")
    if node.anno is None:
        algo.ident(0, 0)   # raises: no partition rule, and how to register one
    legal = algo.legal()
    for idx, dim in legal:
        if node.anno.inputs[idx][dim].head.name == letter:
            return idx, dim
    letters = list(dict.fromkeys(node.anno.inputs[i][d].head.name for i, d in legal))
    try:
        ident = node.anno.ident(letter)
    except KeyError:
        ident = None
    why = (f"its annotation has no dimension {letter!r}" if ident is None else
           f"'{ident}' may not be split" if ident.frozen else
           f"{letter!r} is not a splittable dimension of an input (an inner factor of a merged dimension, "
           f"or on outputs only)")
    raise ValueError(f"graph.partition: cannot split op {node.name!r} ({node.where()}) along {letter!r}: {why}. "
                     f"Annotation: '{node.anno}'. Letters that may be split: {', '.join(letters) or 'none'}.")


def _copy(node: IROperator, **changes) -> IROperator:
    """A piece of ``node``: same op, own lists, no device yet.

    A shallow copy with the changed fields set: what ``dataclasses.replace``
    makes, without re-running ``__init__`` (this runs once per piece, so it is
    kept to a few dictionary updates).
    """
    piece = object.__new__(type(node))
    fields = piece.__dict__
    fields.update(node.__dict__)
    fields.update(origin=node.root, device=None, inputs=list(node.inputs), outputs=list(node.outputs))
    fields.update(changes)
    return piece


def _same_tensor_cut_alike(op: IRFwOperation, letter: str) -> None:
    """Refuses a split of ``op`` along ``letter`` that would cut one tensor it reads at two inputs
    differently (``einsum("bshd,bthd->bhst", h, h)`` split along ``t``: one piece of ``h`` as the
    second operand, all of it as the first). A piece reads one layout of each tensor.

    Raises:
        ValueError: naming the op, its model line, the inputs and the fix.
    """
    if op.anno is None:
        return
    dims: Dict[int, set] = {}
    slots: Dict[int, List[int]] = {}
    for i, t in enumerate(op.inputs):
        if i >= len(op.anno.inputs):
            continue
        at = tuple(d for d, g in enumerate(op.anno.inputs[i]) if any(x.name == letter for x in g.idents))
        dims.setdefault(id(t), set()).add(at)
        slots.setdefault(id(t), []).append(i)
    for key, found in dims.items():
        if len(found) > 1:
            raise ValueError(f"op {op.name!r} ({op.where()}) reads one tensor as inputs {slots[key]}, and a split along "
                             f"'{letter}' ({op.anno}) would cut them differently; a piece reads one layout of each "
                             f"tensor. Split the op along another letter, or give it a copy for one of them "
                             f"(x.clone()).")
