"""Searching plans: data x tensor x pipeline degrees, micro-batches, recompute and ZeRO, simulated.

Every candidate is a ``cube.policies.auto`` configuration (the grid of ``PASData``,
``PASMegatronTP``, ``PASHybrid`` and the pipeline policies, with stages balanced
by ``cube.sim.stages``) at the same global batch, one step each: a pipeline
of ``m`` micro-batches plans the trace of a micro-batch of ``batch / m``
samples and its step runs all ``m`` (what ``cube.compile`` runs for it). Each is planned,
simulated, and ranked by predicted step time; plans over the memory cap rank
after those within it, and plans cube cannot build are listed with the reason.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import torch

from cube.compiler import Traced, batch_structure, trace_model
from cube.ir.graph import IRGraph
from cube.passes.program import build_program
from cube.sim import stages
from cube.sim.host import Host
from cube.sim.simulate import SimResult, simulate

EQUIVALENT = {(True, False, False): "PASData", (False, True, False): "PASMegatronTP",
              (True, True, False): "PASHybrid", (False, False, True): "pipeline"}


class Predicted:
    """A searched plan's step time and peak memory from its ``result`` (None: not planned)."""

    result: Optional[SimResult]

    @property
    def step_time(self) -> float:
        return self.result.step_time if self.result is not None else math.inf

    @property
    def peak(self) -> int:
        return self.result.peak_memory if self.result is not None else 0


@dataclass
class Candidate(Predicted):
    """One plan of the search and its prediction (``result`` None when it could not be planned)."""

    config: dict
    result: Optional[SimResult] = None
    error: str = ""
    feasible: bool = True

    @property
    def name(self) -> str:
        return describe(self.config)


def describe(cfg: dict) -> str:
    """A one-line name of a configuration, with the shipped policy it corresponds to."""
    dp, tp, pp = cfg["dp"], cfg["tp"], cfg["pp"]
    like = EQUIVALENT.get((dp > 1, tp > 1, pp > 1), "hybrid pipeline" if pp > 1 else "single")
    parts = [f"dp{dp} tp{tp} pp{pp}"]
    if pp > 1:
        parts.append(f"{cfg['schedule']} m{cfg['nmicros']}")
    parts.append(f"zero{cfg.get('zero', 0)}")
    if cfg.get("recompute"):
        parts.append("recompute")
    if cfg.get("sp"):
        parts.append("sp")
    return " ".join(parts) + f"  ({like})"


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configs(world: int, batch: int, micros: Sequence[int] = (1, 2, 4), recompute: Sequence[bool] = (False, True),
            zero: Sequence[int] = (0, 1, 2, 3), schedules: Sequence[str] = ("1f1b", "gpipe", "zb-h1", "zbv"),
            sequence: Sequence[bool] = (False, True),
            max_pp: Optional[int] = None) -> List[dict]:
    """Every configuration for ``world`` devices and a global ``batch`` (micro-batch counts: ``micros``
    times the pipeline depth; ``sequence``: tensor-parallel plans with and without sequence parallel)."""
    out = []
    for pp in _divisors(world):
        if max_pp is not None and pp > max_pp:
            continue
        for tp in _divisors(world // pp):
            dp = world // (pp * tp)
            ms = sorted({pp * k for k in micros}) if pp > 1 else [1]
            for m in ms:
                if batch % m or (batch // m) % dp:
                    continue
                for sched in (schedules if pp > 1 else ("1f1b",)):
                    for rc in recompute:
                        for z in (zero if dp > 1 else (0,)):
                            if z == 3 and rc:
                                continue   # not supported together yet (cube.passes.recompute)
                            for sp in (sequence if tp > 1 else (False,)):
                                out.append({"dp": dp, "tp": tp, "pp": pp, "nmicros": m, "schedule": sched,
                                            "recompute": bool(rc), "zero": z, "micro_batch": batch // m,
                                            "world": world, **({"sp": True} if sp else {})})
    return out


class _Tracer:
    """Traces the model once on the global batch; a pipeline of ``m`` micro-batches plans the trace
    of one micro-batch that ``Traced.micro(m)`` makes (once per ``m``), as ``cube.compile`` does.
    Every plan runs its policy on a copy."""

    def __init__(self, model: torch.nn.Module, batch):
        self.model = model
        self.structure, self.sample = batch_structure(batch)
        self.full: Optional[Traced] = None

    def whole(self) -> Traced:
        """The trace of the global batch."""
        if self.full is None:
            self.full = trace_model(self.model, self.sample, structure=self.structure)
        return self.full

    def trace(self, micro_batch: int) -> Traced:
        """The trace a step of ``micro_batch`` samples per micro-batch plans (the global one for all)."""
        batch = self.sample[0].shape[0]
        return self.whole() if micro_batch == batch else self.whole().micro(batch // micro_batch)

    def graph(self, micro_batch: int) -> IRGraph:
        """The unplaced graph of a micro-batch (not to be changed: it is the shared trace)."""
        return self.trace(micro_batch).graph


def planned(tracer: _Tracer, cfg: dict) -> IRGraph:
    """The graph of ``cfg`` after ``cube.policies.auto.plan``: the policy on the global batch's trace, and
    for a pipeline again on its micro-batch's (``Traced.place``); a step is one global batch."""
    from cube.toolkit import grid_plan as plan
    return tracer.whole().place(lambda g, r: plan(g, r, cfg), cfg["world"], zero=3 if cfg.get("zero") == 3 else 0)


def balance(tracer: _Tracer, cfg: dict, costs, comm) -> List[int]:
    """Stage starts for ``cfg`` from the op costs of its ``dp x tp`` layout on one micro-batch
    (``cube.sim.stages``)."""
    from cube.toolkit import grid_plan as plan, stage_count
    flat = dict(cfg, pp=1, world=cfg["dp"] * cfg["tp"], recompute=False, zero=0, starts=None)
    graph = tracer.trace(cfg["micro_batch"]).place(lambda g, r: plan(g, r, flat), flat["world"], zero=0)
    per_op = stages.op_costs(graph, build_program(graph, flat["world"], ranks=[0])[0].plan, costs, comm)
    n = stage_count(cfg["pp"], cfg.get("schedule", "1f1b"))
    return stages.balanced_starts(tracer.graph(cfg["micro_batch"]), n, per_op, comm)


def search(model: torch.nn.Module, batch, world: int, costs, comm, mem_cap: Optional[float] = None,
           host: Optional[Host] = None, candidates: Optional[List[dict]] = None,
           progress: Optional[Callable[[str], None]] = None, **space) -> List[Candidate]:
    """Simulates every configuration and returns them ranked (best first).

    Args:
        model, batch: the single-device model and one global batch.
        world: devices.
        costs, comm: the compute and communication models (see ``simulate``).
        mem_cap: bytes per device; plans above it rank last, marked infeasible.
        host: CPU ranks sharing one host (see ``simulate``).
        candidates: configurations to try (default: ``configs(world, batch, **space)``).
        progress: called with one line per plan (default: print to stderr).
    """
    progress = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    tracer = _Tracer(model, batch)
    cands = candidates if candidates is not None else configs(world, tracer.sample[0].shape[0], **space)
    starts: Dict[tuple, List[int]] = {}
    out: List[Candidate] = []
    for k, cfg in enumerate(cands, 1):
        cfg = dict(cfg)
        t0 = time.perf_counter()
        cand = Candidate(cfg)
        try:
            if cfg["pp"] > 1 and not cfg.get("starts"):
                key = (cfg["dp"], cfg["tp"], cfg["pp"], cfg["micro_batch"], cfg.get("schedule") == "zbv")
                if key not in starts:
                    starts[key] = balance(tracer, cfg, costs, comm)
                cfg["starts"] = starts[key]
            graph = planned(tracer, cfg)
            cand.result = simulate(graph, world, costs=costs, comm=comm, zero=cfg.get("zero", 0), host=host,
                                   coarse=True)
            cand.feasible = mem_cap is None or cand.peak <= mem_cap
        except (ValueError, TypeError, NotImplementedError) as e:
            cand.error, cand.feasible = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}", False
        out.append(cand)
        what = cand.error or f"{cand.step_time * 1e3:9.2f} ms  {cand.peak / 2**20:9.1f} MiB" + \
            ("" if cand.feasible else "  over the memory cap")
        progress(f"[{k}/{len(cands)}] {cand.name:<44} {what}  ({time.perf_counter() - t0:.1f}s)")
    if hasattr(costs, "save"):
        costs.save()
    return rank(out)


def rank(cands: List[Candidate]) -> List[Candidate]:
    """Feasible plans by predicted step time, then plans over the cap, then plans that failed."""
    return sorted(cands, key=lambda c: (c.result is None, not c.feasible, c.step_time))


def table(cands: List[Candidate], top: Optional[int] = None) -> str:
    """The ranked plans as a text table."""
    shown = cands[:top] if top else cands
    w = max([len("plan")] + [len(c.name) for c in shown])   # the plan column fits its longest name
    lines = [f"{'#':>3}  {'plan':<{w}} {'step ms':>9} {'peak MiB':>9}  note"]
    for i, c in enumerate(shown, 1):
        if c.result is None:
            lines.append(f"{i:>3}  {c.name:<{w}} {'-':>9} {'-':>9}  {c.error}")
            continue
        note = "" if c.feasible else "over the memory cap"
        lines.append(f"{i:>3}  {c.name:<{w}} {c.step_time * 1e3:>9.2f} {c.peak / 2**20:>9.1f}  {note}")
    return "\n".join(lines)


def write_plan(cand: Candidate, path: str) -> str:
    """Writes the configuration ``cube.policies.auto.PASAuto`` reads (with the prediction); returns the path."""
    cfg = dict(cand.config, predicted_step_ms=round(cand.step_time * 1e3, 3),
               predicted_peak_mib=round(cand.peak / 2**20, 1))
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path
