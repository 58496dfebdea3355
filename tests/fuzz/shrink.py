"""Shrinking a failing plan to a smaller one that fails the same way.

Greedy, like Hypothesis's shrinker on a structured value: try each
simplification (drop an op override, a recompute group or a stage cut; fewer
micro-batches; a replicated base or data op; devices in order) and keep it
when the plan still has the same outcome. Every try runs in a worker under
the time limit, so hangs shrink too.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional

from tests.fuzz.plan import Place, Plan
from tests.fuzz.pool import Worker


def candidates(plan: Plan) -> Iterator[Plan]:
    """Plans one simplification smaller than ``plan``."""
    rep = dataclasses.replace
    for i in sorted(plan.ops):
        yield rep(plan, ops={k: v for k, v in plan.ops.items() if k != i})
    for k in range(len(plan.recompute)):
        yield rep(plan, recompute=plan.recompute[:k] + plan.recompute[k + 1:])
    for m in range(1, plan.nmicros):
        if plan.schedule != "interleaved" or m % len(plan.groups) == 0:
            yield rep(plan, nmicros=m)
    for k, base in enumerate(plan.base):
        if base != "rep":
            yield rep(plan, base=plan.base[:k] + ("rep",) + plan.base[k + 1:])
    for k, d in enumerate(plan.data):
        if d.factors and d.factors[0][0] is not None:
            yield rep(plan, data=plan.data[:k] + (Place(d.devices, ((None, None, len(d.devices)),)),) +
                      plan.data[k + 1:])
    if plan.schedule and plan.schedule != "interleaved" and len(plan.groups) == 1 and plan.nstages > 1:
        yield rep(plan, cuts=(0,))
    ordered = {i: Place(tuple(sorted(p.devices)), p.factors) for i, p in plan.ops.items()}
    if ordered != plan.ops:
        yield rep(plan, ops=ordered)
    data = tuple(Place(tuple(sorted(p.devices)), p.factors) for p in plan.data)
    if data != plan.data:
        yield rep(plan, data=data)


def shrink(model: str, plan: Plan, outcome: str, limit: float = 120.0,
           log: Optional[Callable[[str], None]] = None) -> Plan:
    """The smallest plan found that still ends in ``outcome`` (``plan`` itself if none)."""
    worker = Worker()
    try:
        changed = True
        while changed:
            changed = False
            for cand in candidates(plan):
                res = worker.ask({"model": model, "plan": cand.literal()}, limit)
                if res["outcome"] == outcome:
                    plan, changed = cand, True
                    if log:
                        log(f"kept: {cand.literal()}")
                    break
    finally:
        worker.stop()
    return plan
