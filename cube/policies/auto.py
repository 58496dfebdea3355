"""PASAuto: the plan ``python -m cube.sim --search`` chose, as a policy.

A plan is a small configuration (JSON)::

    {"dp": 2, "tp": 1, "pp": 2, "nmicros": 4, "schedule": "1f1b", "starts": [0, 41],
     "recompute": false, "zero": 1, "micro_batch": 4, "world": 4}

Devices form a ``(pp, dp, tp)`` ``DeviceMesh`` (``cube.toolkit.grid_plan``
applies it): stage ``s`` runs on the mesh's ``pp = s`` devices, data parallel
over ``dp`` and Megatron tensor parallel over ``tp`` (as ``PASHybrid``).
``starts`` lists the index (among the forward ops) of the first op of each
stage; with ``pp > 1`` a step takes the global batch (the dataloader's, as
for any plan) and cuts it into ``nmicros`` micro-batches of ``micro_batch``
samples that run through the ``schedule`` (``1f1b`` or ``gpipe``).
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

from cube import config
from cube.ir import IRGraph
from cube.toolkit import grid_plan as plan   # the policy of a configuration (cube.sim.search applies it too)

DEFAULT_FILE = "cube_auto_plan.json"


def plan_path() -> str:
    """The configuration file ``PASAuto`` reads: ``CUBE_AUTO_PLAN``, else ``./cube_auto_plan.json``."""
    return config.auto_plan_path(DEFAULT_FILE)


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
