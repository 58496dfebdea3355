"""Calls a policy is made of: place ops over a ``DeviceMesh``, feed every stage the batch, recompute.

A whole plan reads as a few calls; device numbers come from the mesh::

    mesh = grid(resource.ngpus, tp=2)                      # ("pp", 1), ("dp", n // 2), ("tp", 2)
    place_all(graph, mesh, dp=data_parallel(graph, mesh["dp"]), tp=tensor_parallel(graph, mesh["tp"]))
    apply_recompute(graph, recompute)

A split for a mesh dimension is an ``(idx, dim)`` pair, a letter of the op's
annotation (``"h"``), a ``Flow`` (``data_parallel``/``tensor_parallel``: the
split each op gets from the graph's structure) or None (the op is whole on
every coordinate of that dimension).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

from cube import schedule
from cube.ir import lost
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import Flow, batch_flow, context_flow, cut, expert_flow, sequence_flow
from cube.ir.heads import head_parallel
from cube.ir.megatron import megatron_flow
from cube.ir.graph import IRGraph
from cube.ir.operator import IRDataOperation, IRFwOperation, IROperator
from cube.mesh import DeviceMesh, MeshDim

Split = Union[None, Tuple[int, int], str, Flow]
Recompute = Union[None, bool, int, str, Sequence[int]]


def _size(over: Union[MeshDim, int]) -> int:
    return over.size if isinstance(over, MeshDim) else int(over)


def data_parallel(graph: IRGraph, over: Union[MeshDim, int], fuse: bool = True) -> Flow:
    """Where the batch goes when split over ``over`` (a mesh dimension or a count): per op, its
    ``(idx, dim)``; the data operation splits its tensors along dim 0.

    Before a split (``over`` > 1) of a graph not yet staged, each MoE layer that sorts its tokens
    by expert and that cube proves token-local becomes one ``moe_experts`` op
    (``cube.ir.experts.fuse_local``): each rank runs it on its own tokens with every expert, no
    token gathered. A layer not proved stays as it is and runs whole on the tokens gathered
    (reported, ``cube.ir.lost``). Policies that stage a pipeline fuse before ``graph.staging``;
    ``fuse=False`` keeps the layers as they are (a plan whose stage starts count the unfused ops).
    A fused layer and the row-wise ops around it (its router) run on the tokens' own dims, ``(B, S,
    H)`` where the model merged them (``cube.ir.experts.unflatten``): a split of the sequence keeps
    them too (fuse with the tokens' whole split, ``fuse_local(graph, dp * cp)``, before it)."""
    from cube.ir.experts import fuse_local
    n = _size(over)
    if fuse:
        fuse_local(graph, n)
    return batch_flow(graph, n) if n > 1 else Flow(batch=True)


def context_parallel(graph: IRGraph, over: Union[MeshDim, int], heads: bool = True,
                     tp: Union[MeshDim, int] = 1) -> Flow:
    """The sequence split over ``over`` (``cube.ir.follow.context_flow``): activations along their
    token dim, attention as ring attention. With ``heads``, a recurrence along the sequence (a
    state-space mixer, a delta rule) runs split by heads between two all-to-all exchanges, as
    Megatron-LM's context parallel for state-space layers does (``cube.ir.heads``); without, it
    runs whole on its inputs gathered (a lost split). ``tp``: the tensor-parallel mesh dim (or
    degree) placed after ``over`` that splits those heads further: the heads must divide among
    both (else the recurrence's ops stay whole, reported)."""
    n = _size(over)
    if n == 1:
        return Flow()
    flow = context_flow(graph, n)
    return head_parallel(graph, flow, n, within=_size(tp)) if heads else flow


def tensor_parallel(graph: IRGraph, over: Union[MeshDim, int], vocab: bool = False) -> Flow:
    """Megatron's tensor parallel plan over ``over`` (column/row linear pairs, attention heads),
    found from the graph's structure (``cube.ir.megatron.megatron_flow``). With ``vocab``, also
    Megatron's vocabulary parallelism: the LM head split over the vocabulary up to a
    vocabulary-parallel cross entropy (the logits stay split), the input embedding split by rows."""
    n = _size(over)
    return megatron_flow(graph, n, vocab=vocab) if n > 1 else Flow()


def sequence_parallel(graph: IRGraph, tensor: Flow, over: Union[MeshDim, int], dim: int = 1) -> Flow:
    """Megatron's sequence parallel over ``over``: ``tensor`` (``tensor_parallel(graph, over)``)
    plus the split of the sequence (``dim`` of the batch tensors) for the norms, dropout and
    residual adds between its regions (``cube.ir.follow.sequence_flow``): each transition is one
    reduce-scatter (a row linear's partial sums into sequence pieces) or one all-gather (the
    pieces into the whole sequence before a column linear)."""
    n = _size(over)
    return sequence_flow(graph, tensor, n, dim) if n > 1 else tensor


def expert_parallel(graph: IRGraph, data: Flow, over: Union[MeshDim, int]) -> Flow:
    """``data`` (a data parallel plan over devices that include ``over``) with the experts of
    every MoE layer split over ``over`` (``cube.ir.follow.expert_flow``): the batch-split tokens
    reach their experts by one all-to-all and come back by another.

    Raises:
        ValueError: the graph has no expert weights.
    """
    return expert_flow(graph, data, _size(over))


def fuse_moe(graph: IRGraph, dp: int, capacity_factor: Optional[float] = None) -> list:
    """Turns each MoE layer that sorts its tokens by expert (Hugging Face's grouped_mm experts:
    Mixtral, Qwen2-MoE, Qwen3-MoE) into one ``moe_experts`` op that ``expert_parallel`` splits
    by experts, dropless, tokens exchanged by all-to-all (``cube.ir.experts``). A graph without
    a sort of the tokens is left as it is (experts as one batched ``(E, ...)`` weight).
    ``capacity_factor``: None (dropless) or ``c``: each expert takes at most
    ``ceil(c * tokens * top_k / experts)`` of the batch's (token, expert) pairs, first come first
    kept in the batch's token order, the rest dropped (``cube.runtime.experts.dropped`` counts them).

    Returns:
        The fused ops.

    Raises:
        ValueError: a sort-dispatch layer cube cannot split by experts, naming the op and why.
    """
    from cube.ir.experts import fuse_experts, has_sort
    if not has_sort(graph):
        if capacity_factor is not None:
            raise ValueError(f"fuse_moe: capacity_factor={capacity_factor!r} applies to MoE layers that sort their "
                             f"tokens by expert (Hugging Face's grouped_mm experts), and the model has none; "
                             f"leave capacity_factor out")
        return []
    return fuse_experts(graph, dp, capacity_factor)


def grid(ngpus: int, *, tp: int = 1, pp: int = 1, policy: str = "policy") -> DeviceMesh:
    """The ``("pp", pp), ("dp", dp), ("tp", tp)`` mesh of ``ngpus`` devices, ``dp = ngpus // (tp * pp)``.

    Raises:
        ValueError: ``tp * pp`` does not divide ``ngpus`` (named after ``policy``).
    """
    if tp < 1 or pp < 1 or ngpus % (tp * pp):
        if pp == 1:
            raise ValueError(f"{policy}: {ngpus} devices do not split into tensor parallel groups of tp={tp}; "
                             f"pass tp= (or set CUBE_TP) dividing the device count (the data parallel degree "
                             f"is devices / tp)")
        raise ValueError(f"{policy}: {ngpus} devices do not split into tensor parallel tp={tp} x pipeline "
                         f"pp={pp} groups ({tp * pp} devices each); pass tp= and pp= (or set CUBE_TP and CUBE_PP) "
                         f"so that their product divides the device count (the data parallel degree is "
                         f"devices / (tp * pp))")
    return DeviceMesh(("pp", pp), ("dp", ngpus // (tp * pp)), ("tp", tp))


def place(graph: IRGraph, node: IROperator, mesh: DeviceMesh, /, **splits: Split) -> List[IROperator]:
    """Splits ``node`` over ``mesh``, one split per mesh dimension (outermost first), and puts each
    piece on the device at its coordinates. A dimension without a split (or None) holds the op whole
    on each of its coordinates; dimensions of size 1 do nothing.

    Args:
        splits: mesh dimension name -> ``(idx, dim)``, a letter of ``node.anno``, a ``Flow``, or None.

    A ``Flow`` that reaches ``node`` but cannot split it (``Flow.losses``), or that splits nothing at
    all, is recorded on ``graph.lost`` (``cube.ir.lost``): cube.compile reports it, and refuses it
    under ``strict=True``.

    Returns:
        The pieces in the mesh's device order.

    Raises:
        ValueError: a split names no dimension of ``mesh``, or is illegal for the op.
    """
    unknown = [k for k in splits if k not in mesh]
    if unknown:
        raise ValueError(f"place({node!r}): the mesh has dimensions {list(mesh.names)}, not {unknown}")
    _note_lost(graph, node, mesh, splits)
    return _place(graph, node, mesh, splits)


def _note_lost(graph: IRGraph, node: IROperator, mesh: DeviceMesh, splits: dict) -> None:
    """Records on ``graph`` the splits the flows among ``splits`` ask of ``node`` but cannot keep."""
    for name, split in splits.items():
        n = mesh[name].size
        if not isinstance(split, Flow) or n == 1:
            continue
        if split.empty and not split.splits and not split.batch:
            alone = all(size == 1 for other, size in mesh.dims if other != name)
            lost.note_nothing(graph, split.empty, name, n, alone)
        loss = split.losses.get(id(node.root))
        if loss is not None and split.split_of(node) is None:
            lost.note(graph, loss, name, n)


def _place(graph: IRGraph, node: IROperator, mesh: DeviceMesh, splits: dict) -> List[IROperator]:
    if mesh.size == 1:
        graph.assign(node, mesh.devices[0])
        return [node]
    name, n = next((name, n) for name, n in mesh.dims if n > 1)
    split = splits.get(name)
    if isinstance(split, Flow):
        split = split.split_of(node)
    out: List[IROperator] = []
    for piece, sub in zip(cut(graph, node, split, n), mesh.slices(name)):
        out += _place(graph, piece, sub, splits)
    return out


def place_all(graph: IRGraph, mesh: DeviceMesh, ops: Optional[Sequence[IROperator]] = None, /,
              **splits: Split) -> None:
    """``place`` for each of ``ops`` (default: every op of the graph, the data operation included)."""
    for op in list(graph.nodes() if ops is None else ops):
        place(graph, op, mesh, **splits)


def place_data(graph: IRGraph, meshes: Union[DeviceMesh, Sequence[DeviceMesh]],
               batch: Union[str, Sequence[str]] = "dp") -> None:
    """Every pipeline stage reads the batch: each data operation is copied once per stage mesh and
    split along the batch over the stage's ``batch`` dimensions (whole on its other dimensions).

    Args:
        meshes: the stages' meshes (``mesh.slices("pp")``), or one mesh.
        batch: the data parallel dimension, or several (a factored one: ``("edp", "ep")``); a
            stage without them reads the whole batch.
    """
    meshes = [meshes] if isinstance(meshes, DeviceMesh) else list(meshes)
    names = (batch,) if isinstance(batch, str) else tuple(batch)
    for node in graph.select(ntype=IRDataOperation):
        copies = graph.replicate(node, times=len(meshes)) if len(meshes) > 1 else [node]
        for mesh, piece in zip(meshes, copies):
            place(graph, piece, mesh, **{name: (0, 0) for name in names if name in mesh})


def place_stages(graph: IRGraph, stages: Sequence[Sequence[IROperator]], meshes: Sequence[DeviceMesh],
                 **splits: Split) -> None:
    """Stage ``k``'s ops on ``meshes[k % len(meshes)]`` (more stages than meshes: interleaved, each
    pipeline rank holds several), placed as ``place`` does."""
    for k, stage in enumerate(stages):
        place_all(graph, meshes[k % len(meshes)], stage, **splits)


def apply_recompute(graph: IRGraph, recompute: Recompute = None) -> list:
    """Recomputes transformer blocks (``cube.ir.blocks.recompute_blocks``) as a policy's
    ``recompute`` option says.

    Args:
        recompute: None: what ``CUBE_RECOMPUTE`` says; False (or ``"none"``): nothing; True or
            ``"all"``: every block; block indices (an int, a sequence, or ``"0,2"``).

    Returns:
        The groups marked.

    Raises:
        ValueError: anything else, or blocks the model does not have.
    """
    if recompute is None:
        return recompute_blocks(graph)
    which = recompute
    if isinstance(which, str):
        text = which.strip().lower()
        parts = [p.strip() for p in text.split(",")]
        which = (False if text in ("", "none", "off", "false") else "all" if text in ("all", "true") else
                 tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else which)
    elif isinstance(which, bool):
        which = "all" if which else False
    elif isinstance(which, int):
        which = (which,)
    elif isinstance(which, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in which):
        which = tuple(which)
    if which is False:
        return []
    if which != "all" and not isinstance(which, tuple):
        raise ValueError(f"recompute={recompute!r}: use True or 'all' (every block), False (none), or block "
                         f"indices such as (0, 2)")
    return recompute_blocks(graph, which, source=f"recompute={recompute!r}")


def whole(graph: IRGraph, resource) -> IRGraph:
    """The trivial plan: every op whole on every device (the single-device step on each)."""
    place_all(graph, DeviceMesh(("dp", resource.ngpus)))
    return graph


SCHEDULES = {"1f1b": schedule.sched_1f1b, "gpipe": schedule.sched_gpipe, "zb-h1": schedule.sched_zb_h1,
             "zbv": schedule.sched_zbv, "dualpipev": schedule.sched_dualpipev}
V_SCHEDULES = ("zbv", "dualpipev")   # two stages per pipeline rank, in a V


def grid_plan(graph: IRGraph, resource, config: dict) -> IRGraph:
    """Applies a ``pp x dp x tp`` plan (what ``python -m cube.sim --search`` writes) to ``graph``.

    ``config`` holds ``dp``, ``tp``, ``pp`` and optionally ``starts`` (the index among the forward
    ops of each stage's first op; default: equal op counts), ``nmicros``, ``schedule`` (``1f1b``,
    ``gpipe``, ``zb-h1``, ``zbv`` or ``dualpipev``), ``recompute`` (True, ``"all"`` or block indices), ``sp`` (sequence parallel inside
    the tensor-parallel groups) and ``zero``.
    Stage ``s`` runs on the mesh's ``pp = s`` devices, data parallel over ``dp`` and tensor parallel
    over ``tp``; ``zbv`` and ``dualpipev`` cut ``2 pp`` stages instead, stage ``s`` on ``pp = min(s, 2 pp - 1 - s)``.

    Raises:
        ValueError: the grid does not match the devices, a stage start is out of range or out of
            order, an unknown schedule, or ZeRO-3 asked for but not compiled for.
    """
    dp, tp, pp = int(config["dp"]), int(config["tp"]), int(config.get("pp", 1))
    if dp * tp * pp != resource.ngpus:
        raise ValueError(f"PASAuto: the plan is for dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} devices but "
                         f"{resource.ngpus} are launched; launch {dp * tp * pp} processes or search again")
    if config.get("zero", 0) == 3 and getattr(graph, "zero", 0) != 3:
        raise ValueError("PASAuto: the plan uses ZeRO-3; compile with cube.compile(..., zero=3)")
    mesh = DeviceMesh(("pp", pp), ("dp", dp), ("tp", tp))
    data, tensor = data_parallel(graph, mesh["dp"], fuse=pp == 1), tensor_parallel(graph, mesh["tp"])
    if config.get("sp") and tp > 1:   # Megatron-SP: the memory-bound ops between tp regions along the sequence
        tensor = sequence_parallel(graph, tensor, mesh["tp"])
    if pp == 1:
        place_all(graph, mesh, dp=data, tp=tensor)
    name = config.get("schedule", "1f1b")
    if pp > 1 and name not in SCHEDULES:
        raise ValueError(f"PASAuto: unknown schedule {name!r}; use one of {sorted(SCHEDULES)}")
    if pp > 1:
        n = stage_count(pp, name)
        fw = graph.select(ntype=IRFwOperation)
        starts = list(config.get("starts") or [k * len(fw) // n for k in range(n)])
        if len(starts) != n or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
                or starts[-1] >= len(fw):
            raise ValueError(f"PASAuto: stage starts {starts} must be {n} increasing forward-op indices "
                             f"from 0 below {len(fw)}; search again for this model")
        meshes = mesh.slices("pp")
        stages = graph.staging([fw[i] for i in starts])
        place_data(graph, meshes)
        if n > pp:   # ZB-V's and DualPipeV's V
            meshes = [meshes[r] for r in schedule.v_placement(n)]
        place_stages(graph, stages, meshes, dp=data, tp=tensor)
    apply_recompute(graph, config.get("recompute") or False)
    if pp > 1:
        SCHEDULES[name](graph, int(config.get("nmicros", pp)), stage_count(pp, name))
    return graph


def stage_count(pp: int, schedule_name: str) -> int:
    """Stages of a ``pp``-deep pipeline under ``schedule_name`` (ZB-V, DualPipeV: two per pipeline rank)."""
    return 2 * pp if schedule_name in V_SCHEDULES else pp
