"""Simulating one training step of a placed graph: step time, memory per rank, a trace.

``simulate(graph, world)`` lays out every rank's program as code generation
does (``cube.passes.program.build_program``: plans, the schedule's actions,
recompute runs), adds the reducer's buckets and builds each rank's instructions
(``cube.sim.program``), runs them together
(``cube.sim.engine``) and returns a ``SimResult``: the predicted step time (the
last rank to finish, optimizer included), per-rank compute, exposed
communication and peak memory with its breakdown, a Chrome trace (one process
per rank, compute and communication threads; open it in Perfetto) and the
memory of each rank over time.
"""
from __future__ import annotations

import csv
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph
from cube.passes.program import Program, build_program
from cube.sim import engine
from cube.sim.comm import CommModel
from cube.sim.costs import Estimator
from cube.sim.host import Host
from cube.sim.memory import KINDS, peak
from cube.sim.precision import run_precision
from cube.sim.instructions import message_pair
from cube.sim.program import ACCUMULATE, Builder, Ins


MICRO_WORK = ("forward", "backward", "recompute")   # instruction categories each micro-batch repeats


@dataclass
class RankStats:
    """One rank's share of the step.

    Attributes:
        end: seconds until its step (optimizer included) ends.
        compute: seconds of compute.
        comm: seconds its compute stream waited on blocking communication and peers.
        peak: peak bytes; ``breakdown``: bytes per kind at the peak.
        waiting: the part of ``comm`` spent waiting for peers' messages (pipeline bubbles).
        repeat_compute, repeat_comm: seconds of the work every micro-batch repeats (forward, backward
            and recompute compute; the collectives they block on).
        repeat_accumulate: the part of ``repeat_compute`` adding gradients to those the parameters
            hold (``cube.sim.program.ACCUMULATE``), which every micro-batch but the first pays.
    """

    end: float
    compute: float
    comm: float
    peak: int
    breakdown: Dict[str, int]
    waiting: float = 0.0
    repeat_compute: float = 0.0
    repeat_comm: float = 0.0
    repeat_accumulate: float = 0.0

    @property
    def pipeline(self) -> float:
        return self.repeat_compute + self.repeat_comm


@dataclass
class SimResult:
    """What ``simulate`` predicts; see the module docstring."""

    step_time: float
    ranks: Dict[int, RankStats]
    events: List[engine.Event] = field(repr=False, default_factory=list)
    memory: Dict[int, List[tuple]] = field(repr=False, default_factory=dict)
    fold: Optional[object] = field(repr=False, default=None)   # cube.sim.symmetry.Fold of a symmetric run
    micro: Optional[tuple] = None   # (simulated, real) micro-batches when extrapolated (cube.sim.symmetry)
    model_flops: float = 0.0        # FLOPs of one step of the model (forward x 3), as MFU counts them

    @property
    def peak_memory(self) -> int:
        """The largest per-rank peak, in bytes."""
        return max(s.peak for s in self.ranks.values())

    def real_rank(self, r: int) -> int:
        """The rank ``r`` of this result is in the real world (itself, unless the world was folded)."""
        return self.fold.real_rank(r) if self.fold is not None else r

    def summary(self) -> str:
        lines = [f"predicted step time {self.step_time * 1e3:.2f} ms, peak memory "
                 f"{self.peak_memory / 2**20:.1f} MiB"]
        fold = self.fold
        if fold is not None:
            mesh = " x ".join(f"{n}{k}" for n, k in zip(fold.names, fold.real))
            sim = " x ".join(f"{n}{k}" for n, k in zip(fold.names, fold.shape))
            lines.append(f"symmetric: {mesh} simulated as {sim}, {len(self.ranks)} rank(s), one per class"
                         + (f"; {self.micro[1]} micro-batches extrapolated from {self.micro[0]}" if self.micro else ""))
        lines.append(f"{'rank':>4} {'end ms':>9} {'compute':>9} {'blocked':>9} {'peak MiB':>9}  breakdown at peak (MiB)")
        for r, s in sorted(self.ranks.items()):
            parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in s.breakdown.items() if v)
            lines.append(f"{self.real_rank(r):>4} {s.end * 1e3:>9.2f} {s.compute * 1e3:>9.2f} {s.comm * 1e3:>9.2f} "
                         f"{s.peak / 2**20:>9.1f}  {parts}")
        return "\n".join(lines)

    def chrome_trace(self, path) -> str:
        """Writes a Chrome trace JSON (``chrome://tracing`` or ui.perfetto.dev); returns the path."""
        out = []
        for r in sorted(self.ranks):
            out.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {self.real_rank(r)}"}})
            for tid, name in ((0, "compute"), (1, "communication")):
                out.append({"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}})
        for e in self.events:
            args = {"MiB": round(e.nbytes / 2**20, 3)} if e.nbytes else {}
            out.append({"name": e.name, "cat": e.cat, "ph": "X", "pid": e.rank, "tid": 0 if e.thread == "compute" else 1,
                        "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6, "args": args})
        for r, points in self.memory.items():
            for t, total in points:
                out.append({"name": "memory", "ph": "C", "pid": r, "ts": t * 1e6, "args": {"MiB": total / 2**20}})
        with open(path, "w") as f:
            json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
        return str(path)

    def memory_plot(self, path) -> str:
        """Memory of each rank over the step: a PNG when matplotlib is installed, else a CSV
        (``rank,seconds,bytes``) next to ``path``. Returns the file written."""
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            path = os.path.splitext(str(path))[0] + ".csv"
            with open(path, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["rank", "seconds", "bytes"])
                for r, points in sorted(self.memory.items()):
                    w.writerows([r, t, b] for t, b in points)
            return path
        fig, ax = plt.subplots(figsize=(8, 4))
        for r, points in sorted(self.memory.items()):
            ax.step([t * 1e3 for t, _ in points], [b / 2**20 for _, b in points], where="post", label=f"rank {r}")
        ax.set_xlabel("ms")
        ax.set_ylabel("MiB")
        ax.legend()
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        return str(path)


def build_programs(graph: IRGraph, world: int, costs=None, comm: Optional[CommModel] = None, zero: Optional[int] = None,
                   optimizer: bool = True, program: Optional[Program] = None,
                   ranks: Optional[Sequence[int]] = None) -> dict:
    """Every rank's instructions (``cube.sim.program``) for the placed ``graph`` (``program``: its
    ranks' programs when already built, e.g. ``cube.plan(...).program``).

    ``ranks``: only these ranks' (one per symmetric class, ``cube.sim.symmetry``), and the ranks
    they receive messages from, found by building and looking."""
    if zero is None:
        zero = getattr(graph, "zero", 0)
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"simulate: zero must be 0, 1, 2 or 3, got {zero!r}")
    if getattr(graph, "zero", 0) == 3 and zero != 3:
        raise ValueError("simulate: the graph was planned for zero=3; simulate it with zero=3")
    if zero == 3 and getattr(graph, "zero", 0) != 3:
        raise ValueError("simulate: zero=3 needs a graph planned for it (trace_and_plan(..., zero=3))")
    costs = _PerCall(costs if costs is not None else Estimator())
    comm = comm if comm is not None else CommModel()
    precision = getattr(graph, "precision", None)
    dtypes, casts, float8 = run_precision(graph, precision)   # the same for every rank
    bind = getattr(costs.inner, "bind_dtypes", None)
    if bind is not None:   # a cost model reading bytes from dtypes: this graph's, as its ranks run it
        bind(dtypes if precision else None, casts, float8=float8, precision=precision)
    if ranks is None:
        if program is None or sorted(program.ranks) != list(range(world)):
            program = build_program(graph, world)
        return {r: Builder(graph, program[r], costs, comm, zero, dtypes).build(optimizer) for r in range(world)}
    wanted, programs = set(ranks), {}
    while True:
        todo = sorted(wanted - set(programs))
        if not todo:
            return programs
        program = build_program(graph, world, todo)
        for r in todo:
            programs[r] = Builder(graph, program[r], costs, comm, zero, dtypes).build(optimizer)
        wanted |= _senders(programs)


class _PerCall:
    """A cost model asked once per op piece: every micro-batch and recompute of a piece costs the same."""

    def __init__(self, inner):
        self.inner = inner
        self.memo: Dict[int, tuple] = {}

    def op_cost(self, call):
        got = self.memo.get(id(call))
        if got is None or got[0] is not call:
            got = self.memo[id(call)] = (call, self.inner.op_cost(call))
        return got[1]

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _senders(programs: dict) -> set:
    """Ranks that send what the given programs receive (a message key names its sender: the first
    of its rank pair, or the rank of a loss message)."""
    sent = {i.key for prog in programs.values() for i in prog.ins if i.op == "send"}
    out = set()
    for prog in programs.values():
        for i in prog.ins:
            if i.op != "recv" or i.key in sent:
                continue
            key, pair = i.key, message_pair(i.key)
            if isinstance(key, tuple) and key and key[0] == "loss":
                out.add(key[1])
            elif pair is not None:   # activations go forward, gradients ("b") come back
                out.add(pair[1] if key[-1] == "b" else pair[0])
            else:
                raise CubeInternalError(f"simulate: cannot tell who sends message {key!r}")
    return out


def simulate(graph: IRGraph, world: int, costs=None, comm: Optional[CommModel] = None, zero: Optional[int] = None,
             host: Optional[Host] = None, optimizer: bool = True, coarse: bool = False,
             program: Optional[Program] = None, ranks: Optional[Sequence[int]] = None) -> SimResult:
    """Predicts one training step of the placed ``graph`` on ``world`` ranks.

    Args:
        graph: a graph after its policy (every op placed).
        world: the number of ranks.
        costs: the compute cost model: a ``Profiler`` (measured), ``Estimator``
            (default) or ``FixedCosts``.
        comm: the communication model (default: the backend's uncalibrated defaults).
        zero: the ZeRO stage of the optimizer (default: the graph's, 0 unless planned for 3).
        host: CPU ranks sharing one host's cores (``cube.sim.host.Host``, e.g. ``this_host()``);
            None: each rank has a device of its own (GPUs).
        optimizer: include the optimizer step (and ZeRO's gathers after it).
        coarse: merge consecutive compute instructions (faster; coarser trace and memory curve).
        program: the ranks' programs, when already built (``cube.plan(...).program``).
        ranks: simulate only these (one rank of each symmetric class, see ``cube.sim.symmetry``)
            and those they receive from; a collective waits for its simulated members only.

    Raises:
        ValueError: a plan that cannot run (see ``build_program``) or inconsistent ZeRO settings.
    """
    programs = build_programs(graph, world, costs, comm, zero, optimizer, program, ranks)
    stats: Dict[int, tuple] = {}
    work: Dict[int, list] = {}
    solo: Dict[int, float] = {}
    for r, prog in programs.items():
        top, at, totals = peak(prog.base, [i.mem for i in prog.ins])
        stats[r] = (top, {k: at.get(k, 0) for k in KINDS}, totals)
        work[r] = [sum(i.dur for i in prog.ins if i.op == op and i.cat in MICRO_WORK) for op in ("compute", "coll")]
        work[r].append(sum(i.dur for i in prog.ins if i.label == ACCUMULATE))
        solo[r] = _solo_collectives(r, prog, programs) if ranks is not None else 0.0
        if coarse:
            prog.ins = _merge(prog.ins)
    ends, events, times = engine.run(programs, host)
    blocked: Dict[int, float] = {r: solo[r] for r in programs}
    waiting: Dict[int, float] = {r: 0.0 for r in programs}
    for e in events:
        if e.thread == "compute" and e.cat in ("comm", "wait"):
            blocked[e.rank] += e.end - e.start
            if e.cat == "wait":
                waiting[e.rank] += e.end - e.start
    ranks, memory = {}, {}
    for r, prog in programs.items():
        compute = sum(i.dur for i in prog.ins if i.op == "compute") - solo[r]
        top, at, totals = stats[r]
        ranks[r] = RankStats(ends[r], compute, blocked[r], top, at, waiting[r], *work[r])
        if not coarse:
            start = sum(prog.base.values())
            memory[r] = [(0.0, start)] + list(zip(times[r], totals))
    return SimResult(max(ends.values()) if ends else 0.0, ranks, events, memory)


def _solo_collectives(r: int, prog, programs: dict) -> float:
    """Turns the blocking collectives whose other members are all symmetric copies (not simulated)
    into plain delays of the rank's program (so they merge with the compute around them); returns
    their seconds. Only those before the rank's first asynchronous collective: a later one may
    queue behind it on the communication stream."""
    total = 0.0
    for i in prog.ins:
        if i.op == "launch":
            break
        if i.op == "coll" and all(m == r or m not in programs for m in i.group):
            i.op = "compute"
            total += i.dur
    return total


def _merge(ins: List[Ins]) -> List[Ins]:
    out: List[Ins] = []
    for i in ins:
        if out and i.op == "compute" and out[-1].op == "compute" and out[-1].cat == i.cat:
            out[-1].dur += i.dur
            out[-1].host += i.host
            for k, v in i.mem.items():
                out[-1].mem[k] = out[-1].mem.get(k, 0) + v
            continue
        out.append(Ins(i.op, i.dur, i.key, i.group, i.label, i.cat, i.nbytes, dict(i.mem), i.host))
    return out
