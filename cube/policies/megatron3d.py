"""PASMegatron: data x tensor x pipeline parallel (Megatron-LM's 3D plan) with 1F1B.

The forward ops are cut into ``pp`` balanced stages (``cube.schedule.balance``,
between transformer layers). Each stage runs on ``dp x tp`` devices: data
parallel over ``dp`` groups and, inside each group, tensor parallel over ``tp``
devices as ``PASMegatronTP`` plans it (column/row linear pairs, attention by
heads, found from the graph's structure). The devices form a ``(pp, dp, tp)``
``DeviceMesh``: tensor parallel innermost, pipeline outermost, as Megatron
orders ranks. A step takes ``nmicros`` micro-batches (``CUBE_MICROS``, default
4) through the 1F1B schedule. With ``nvirtual=v`` (``CUBE_VIRTUAL``, default 1)
the ops are cut into ``pp x v`` stages instead, stage ``k`` on the devices of
pipeline rank ``k % pp``, run by interleaved 1F1B (``nmicros`` then a multiple
of ``pp``). ``schedule="zb-h1"`` runs ZB-H1 over the ``pp`` stages and
``schedule="zbv"`` ZB-V over ``2 x pp`` stages in a V (``cube.schedule``: the
zero-bubble schedules, whose W fill the pipeline's waits).

Degrees: ``tp`` and ``pp`` (``CUBE_TP``, ``CUBE_PP``, default 2 each); ``dp =
ngpus // (tp * pp)``. With ``pp = 1`` it is ``PASHybrid`` with gradient
accumulation over the micro-batches. ``cp`` (context parallel) and ``ep``
(expert parallel) take their devices from ``dp``, as Megatron-LM's ranks do
(order ``pp, dp, cp, tp``: tp innermost, then cp).

``vocab_parallel`` (default True) splits the vocabulary over ``tp`` as Megatron-LM
does: the LM head by its output rows, its logits kept split up to a
vocabulary-parallel cross entropy (``cube.runtime.vocab``: all-reduces of each
row's maximum, sum of exponentials and target logit; backward local), and the
input embedding (tied or not) by rows. Without it the vocabulary's weights, the
largest single tensor of a language model, are whole on every tensor-parallel
rank; ``vocab_parallel=False`` keeps that plan (the loss then runs whole on
gathered logits), e.g. for a loss the vocabulary split cannot compute (class
weights, probability targets: those stay whole by themselves).
"""
from typing import Callable, Optional

from cube import config, schedule
from cube.ir import IRGraph
from cube.ir.experts import fuse_local
from cube.schedule.balance import stage_starts
from cube.toolkit import (Recompute, apply_recompute, context_parallel, data_parallel, expert_parallel, fuse_moe, grid,
                          place_data, place_stages, sequence_parallel, tensor_parallel)


def degrees(ngpus: int, tp: Optional[int] = None, pp: Optional[int] = None) -> tuple:
    """``(dp, tp, pp)`` for ``ngpus`` devices (``tp``/``pp`` from ``CUBE_TP``/``CUBE_PP`` when not given).

    Raises:
        ValueError: ``tp * pp`` does not divide ``ngpus``.
    """
    mesh = _mesh(ngpus, tp, pp)
    return mesh["dp"].size, mesh["tp"].size, mesh["pp"].size


def _mesh(ngpus: int, tp: Optional[int], pp: Optional[int]):
    return grid(ngpus, tp=tp or config.tensor_parallel_degree(), pp=pp or config.pipeline_degree(),
                policy="PASMegatron")


def PASMegatron(graph: IRGraph, resource, tp: Optional[int] = None, pp: Optional[int] = None,
                nmicros: Optional[int] = None, cost: Optional[Callable] = None, nvirtual: Optional[int] = None,
                recompute: Recompute = None, sp: bool = False, ep: int = 1,
                schedule_name: Optional[str] = None, cp: int = 1, vocab_parallel: bool = True,
                capacity_factor: Optional[float] = None) -> IRGraph:
    """Plans ``graph`` on a ``pp x dp x tp`` mesh of ``resource.ngpus`` devices with 1F1B.

    Args:
        tp: tensor-parallel degree (default ``CUBE_TP``).
        pp: pipeline-parallel degree (default ``CUBE_PP``).
        nmicros: micro-batches per step (default ``CUBE_MICROS``).
        cost: an op's forward plus backward time, for balancing the stages
            (default: the FLOPs/bytes estimate of ``cube.schedule.balance``).
        nvirtual: stages per pipeline rank (default ``CUBE_VIRTUAL``, else 1); more than one
            runs interleaved 1F1B.
        recompute: blocks to recompute (``cube.toolkit.apply_recompute``; default ``CUBE_RECOMPUTE``).
        sp: sequence parallel: norms, dropout and residual adds between the tensor-parallel
            regions run on ``1/tp`` of the sequence (``cube.toolkit.sequence_parallel``).
        ep: expert parallel degree, dividing ``dp``: the experts (weights with a leading expert
            dim) are split over groups of ``ep`` data-parallel neighbours, the tokens reach them
            by all-to-all (``cube.toolkit.expert_parallel``). MoE layers that sort their tokens by
            expert (Hugging Face's grouped_mm experts: Mixtral, Qwen2-MoE, Qwen3-MoE) are first
            fused into one op each (``cube.toolkit.fuse_moe``): dropless, the all-to-all's split
            sizes exchanged at run time. With ``ep=1`` on a plan that splits the tokens (``dp``,
            ``cp`` or ``sp`` over more than one device) the proved ones are fused too
            (``cube.ir.experts.fuse_local``), before the stages are cut: each rank runs its own
            tokens (a block of the batch, of the sequence or both) through every expert.
        capacity_factor: with the fused MoE layers above, the GShard/Switch capacity rule instead
            of dropless: each expert takes at most ``ceil(capacity_factor * T * top_k / E)`` of the
            step's ``T * top_k`` (token, expert) pairs, ``T`` the tokens of the whole batch, kept
            in their tokens' order in the batch; the others are dropped (zero expert output, the
            residual carries the token) and counted (``cube.runtime.experts.dropped``). Needs
            ``tp == pp == nmicros == 1``, and ``ep > 1`` on more than one device (the ranks of
            the batch exchange their per-expert counts in the experts' call); ``ep=1`` on one
            device is the single-device run of the same rule.
        schedule_name: ``"1f1b"`` (default; interleaved with ``nvirtual > 1``), ``"zb-h1"``,
            ``"zbv"`` or ``"dualpipev"`` (the last two: two stages per pipeline rank in a V;
            ``nvirtual`` must be left out or 2).
        cp: context parallel degree, dividing ``dp``: activations split along the sequence over
            groups of ``cp`` neighbours (inside ``tp``'s), self-attention as ring attention
            (``cube.toolkit.context_parallel``).
        vocab_parallel: split the LM head, its cross entropy and the input embedding over the
            vocabulary across ``tp`` (module docstring); False keeps them whole on every tp rank.

    Raises:
        ValueError: the degrees do not fit the devices, ``ep`` or ``cp`` does not divide ``dp``, an
            MoE layer cube cannot split by experts (the op named),
            both ``ep`` and ``cp`` are asked for, an unknown schedule, or ZB-H1/ZB-V with another
            ``nvirtual``.
    """
    mesh = _mesh(resource.ngpus, tp, pp)
    pp, nmicros = mesh["pp"].size, nmicros or config.micro_batches()
    name = (schedule_name or "1f1b").lower()
    if name not in ("1f1b", "zb-h1", "zbv", "dualpipev"):
        raise ValueError(f"PASMegatron: unknown schedule_name {schedule_name!r}; use '1f1b', 'zb-h1', 'zbv' or "
                         f"'dualpipev'")
    want = {"zb-h1": 1, "zbv": 2, "dualpipev": 2}.get(name)
    if want is not None and nvirtual not in (None, want):
        raise ValueError(f"PASMegatron: schedule_name={name!r} runs {want} stage(s) per pipeline rank, "
                         f"but nvirtual={nvirtual}; leave nvirtual out")
    nvirtual = want or nvirtual or config.virtual_stages(default=1)
    if capacity_factor is not None and (mesh["tp"].size, pp, nmicros) != (1, 1, 1):
        raise ValueError(f"PASMegatron: capacity_factor={capacity_factor} counts each expert's pairs over the whole "
                         f"batch in one call; tp={mesh['tp'].size}, pp={pp}, nmicros={nmicros} are not planned with "
                         f"it yet: use tp=1, pp=1, nmicros=1 (or drop capacity_factor for dropless experts)")
    if ep != 1 or capacity_factor is not None:   # MoE layers that sort their tokens by expert become one op each
        fuse_moe(graph, mesh["dp"].size, capacity_factor)   # (cube.ir.experts)
    else:   # a split of the tokens: the proved ones become one op each, run on each rank's own tokens
        fuse_local(graph, mesh["dp"].size * (mesh["tp"].size if sp else 1))   # (mesh["dp"] still counts cp)
    stages = graph.staging(stage_starts(graph, pp * nvirtual, cost=cost))
    if cp != 1 and ep != 1:
        raise ValueError(f"PASMegatron: cp={cp} and ep={ep} both take devices from dp; context and expert "
                         f"parallel together are not planned yet: ask for one of them")
    if cp != 1:
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or mesh["dp"].size % cp:
            raise ValueError(f"PASMegatron: cp={cp!r} must divide the data parallel degree dp={mesh['dp'].size} "
                             f"(devices / (tp * pp)); the sequence is split over groups of cp ranks")
        mesh = mesh.factor("dp", dp=mesh["dp"].size // cp, cp=cp)
    data, tensor = data_parallel(graph, mesh["dp"]), tensor_parallel(graph, mesh["tp"], vocab=vocab_parallel)
    if sp:
        tensor = sequence_parallel(graph, tensor, mesh["tp"])
    # a recurrence's heads split over cp, and tp's heads inside each cp block (cube.ir.heads)
    context = {"cp": context_parallel(graph, mesh["cp"], tp=mesh["tp"])} if cp != 1 else {}
    splits = dict(dp=data, **context, tp=tensor)
    if ep != 1:
        if not isinstance(ep, int) or ep < 1 or mesh["dp"].size % ep:
            raise ValueError(f"PASMegatron: ep={ep!r} must divide the data parallel degree dp={mesh['dp'].size} "
                             f"(devices / (tp * pp)); the experts are split over groups of ep data-parallel ranks")
        mesh = mesh.factor("dp", edp=mesh["dp"].size // ep, ep=ep)
        splits = dict(edp=data, ep=expert_parallel(graph, data, mesh["ep"]), tp=tensor)
    meshes = mesh.slices("pp")
    place_data(graph, meshes, batch=("dp", "edp", "ep"))   # every stage reads the batch
    if name in ("zbv", "dualpipev"):
        meshes = [meshes[r] for r in schedule.v_placement(2 * pp)]
    place_stages(graph, stages, meshes, **splits)
    apply_recompute(graph, recompute)
    if name == "zb-h1":
        schedule.sched_zb_h1(graph, nmicros, pp)
    elif name == "zbv":
        schedule.sched_zbv(graph, nmicros, 2 * pp)
    elif name == "dualpipev":
        schedule.sched_dualpipev(graph, nmicros, 2 * pp)
    elif nvirtual > 1:
        schedule.sched_1f1b_interleaved(graph, nmicros, pp, nvirtual)
    else:
        schedule.sched_1f1b(graph, nmicros, pp)
    return graph
