"""PASAuto: the plan ``python -m cube.sim --search`` chose, as a policy.

A plan is a small configuration (JSON)::

    {"dp": 2, "tp": 1, "pp": 2, "nmicros": 4, "schedule": "1f1b", "starts": [0, 41],
     "recompute": false, "zero": 1, "micro_batch": 4, "world": 4}

Devices form a ``pp x dp x tp`` grid: stage ``s`` runs on devices
``s*dp*tp .. (s+1)*dp*tp - 1``; inside a stage, device ``s*dp*tp + i*tp + j``
holds batch part ``i`` and Megatron tensor-parallel piece ``j`` (as
``PASHybrid``). ``starts`` lists the index (among the forward ops) of the first
op of each stage; with ``pp > 1`` a step runs ``nmicros`` micro-batches through
the ``schedule`` (``1f1b`` or ``gpipe``), each of ``micro_batch`` samples.
``recompute: true`` recomputes every block. ``zero`` is the ZeRO stage: pass
``zero=3`` to ``cube.compile`` for stage 3 and ``zero=cfg["zero"]`` to
``cube.build_optimizer``.

``PASAuto`` reads the file named by ``CUBE_AUTO_PLAN`` (default
``cube_auto_plan.json`` in the working directory) each time it plans; the
configuration is part of the code cache key, so a new search result is never
served stale code. ``from_file(path)`` returns the same policy for a given file.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Optional

from cube import schedule
from cube.ir import IRDataOperation, IRFwOperation, IRGraph
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import batch_flow, megatron_flow, place

DEFAULT_FILE = "cube_auto_plan.json"
SCHEDULES = {"1f1b": schedule.sched_1f1b, "gpipe": schedule.sched_gpipe}


def plan_path() -> str:
    """The configuration file ``PASAuto`` reads: ``CUBE_AUTO_PLAN``, else ``./cube_auto_plan.json``."""
    return os.environ.get("CUBE_AUTO_PLAN") or DEFAULT_FILE


def load_config(path: Optional[str] = None) -> dict:
    """Reads a plan written by the search.

    Raises:
        ValueError: no such file, or not a plan.
    """
    path = path or plan_path()
    if not os.path.isfile(path):
        raise ValueError(f"PASAuto: no plan file {path!r}; run `python -m cube.sim <script> --ngpus N --search` "
                         f"(it writes {DEFAULT_FILE}), or set CUBE_AUTO_PLAN to the file it wrote")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except ValueError as e:
        raise ValueError(f"PASAuto: {path!r} is not valid JSON ({e}); rerun the search to write it again") from None
    missing = [k for k in ("dp", "tp", "pp") if k not in cfg]
    if missing:
        raise ValueError(f"PASAuto: {path!r} lacks {missing}; it must be a plan written by the search")
    return cfg


def plan(graph: IRGraph, resource, config: dict) -> IRGraph:
    """Applies a ``pp x dp x tp`` plan (see the module docstring) to ``graph``.

    Raises:
        ValueError: the grid does not match the devices, a stage start is out of
            range or out of order, an unknown schedule, or ZeRO-3 asked for but
            not compiled for.
    """
    dp, tp, pp = int(config["dp"]), int(config["tp"]), int(config.get("pp", 1))
    if dp * tp * pp != resource.ngpus:
        raise ValueError(f"PASAuto: the plan is for dp*tp*pp = {dp}*{tp}*{pp} = {dp * tp * pp} devices but "
                         f"{resource.ngpus} are launched; launch {dp * tp * pp} processes or search again")
    if config.get("zero", 0) == 3 and getattr(graph, "zero", 0) != 3:
        raise ValueError("PASAuto: the plan uses ZeRO-3; compile with cube.compile(..., zero=3)")
    data_flow = batch_flow(graph, dp) if dp > 1 else None
    tensor_flow = megatron_flow(graph, tp) if tp > 1 else None
    group = dp * tp

    def put(node, base: int) -> None:
        dsplit = (0, 0) if isinstance(node, IRDataOperation) else (data_flow.split_of(node) if data_flow else None)
        for i, piece in enumerate(place(graph, node, dsplit, [base + i * tp for i in range(dp)])):
            tsplit = tensor_flow.split_of(node) if tensor_flow and not isinstance(node, IRDataOperation) else None
            place(graph, piece, tsplit, [base + i * tp + j for j in range(tp)])

    if pp == 1:
        for node in graph.nodes():
            put(node, 0)
    else:
        fw = graph.select(ntype=IRFwOperation)
        starts = list(config.get("starts") or [k * len(fw) // pp for k in range(pp)])
        if len(starts) != pp or starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) \
                or starts[-1] >= len(fw):
            raise ValueError(f"PASAuto: stage starts {starts} must be {pp} increasing forward-op indices from 0 "
                             f"below {len(fw)}; search again for this model")
        stages = graph.staging([fw[i] for i in starts])
        for node in graph.select(ntype=IRDataOperation):
            for s, piece in enumerate(graph.replicate(node, times=pp)):
                put(piece, s * group)
        for s, stage in enumerate(stages):
            for op in stage:
                put(op, s * group)
    if config.get("recompute"):
        recompute_blocks(graph, config["recompute"] if isinstance(config["recompute"], (list, str)) else "all")
    if pp > 1:
        name = config.get("schedule", "1f1b")
        if name not in SCHEDULES:
            raise ValueError(f"PASAuto: unknown schedule {name!r}; use one of {sorted(SCHEDULES)}")
        SCHEDULES[name](graph, int(config.get("nmicros", pp)), pp)
    return graph


class _Auto:
    """``PASAuto``: ``plan`` with the configuration in ``plan_path()``.

    ``keywords`` exposes the configuration the way ``functools.partial`` does,
    so ``cube.policy.policy_source`` puts it into the code cache key.
    """

    __name__ = __qualname__ = "PASAuto"

    @property
    def func(self):
        return plan

    @property
    def keywords(self) -> dict:
        try:
            return {"config": load_config()}
        except ValueError:
            return {}

    def __call__(self, graph: IRGraph, resource) -> IRGraph:
        return plan(graph, resource, load_config())


PASAuto = _Auto()


def from_file(path: str):
    """The policy of the plan in ``path`` (a ``functools.partial`` of ``plan``)."""
    policy = functools.partial(plan, config=load_config(path))
    policy.__name__ = policy.__qualname__ = "PASAuto"
    return policy
