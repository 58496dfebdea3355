"""Searching plans for a cluster (a hardware profile), at thousands of devices.

Each candidate is a ``PASMegatron`` plan (``Plan``): tensor parallel over
``tp`` devices inside a node (consecutive ranks tiling a node, at most 8),
``pp`` pipeline ranks holding ``nvirtual`` stages each (one, or two
interleaved; ``pp * nvirtual`` at most the model's blocks) under one of the
schedules 1F1B, ZB-H1, ZB-V or DualPipeV (the last two: two stages per rank in
a V; every one runs on NCCL, ``cube.runtime.p2p.ordered``), data parallel
over the rest (``dp``), of which groups of ``cp`` neighbours may share their
samples cut along the sequence (context parallel) or, for a model with experts
(weights with a leading expert dim), ``ep`` neighbours hold a share of the
experts each (expert parallel), micro-batches of ``micro_batch`` samples
(``nmicros = batch / (dp / cp * micro_batch)`` per step), every block
recomputed or none, ZeRO 0-3 (1: the distributed optimizer; 2: and the
gradients; 3: fully sharded, the parameters too), and sequence parallel or
not. Each is simulated by the symmetric simulator (``cube.sim.symmetry``, one
rank per class) on the profile's costs and ranked by predicted step time; a
plan whose peak memory exceeds the cap (the device's memory,
``Hardware.memory_bytes``, unless given) ranks after every plan within it. Each
simulated plan reports its tokens/s and MFU per device and the backend it runs
on (every plan here runs on NCCL).

The whole space is too large to simulate (hundreds of plans of seconds each at
thousands of devices), so the search is a climb, ``budget`` plans at most
(and, given ``budget_s``, no plan started that the wall-clock budget would
not see finish, the slowest so far being the guess):

- a plan whose static memory alone (parameters, gradients and AdamW state per
  rank, ``static_bytes``: a lower bound of what the simulator counts) exceeds
  the cap is skipped without simulating it;
- the plans given (``include``: a policy's plan, to be beaten) and two seeds
  (the fewest model parallel devices, and the largest ``tp`` with the fewest
  pipeline ranks, whose static memory leaves half the cap free; interleaved,
  recompute, micro-batches of one sample; on a MoE model a third, the fewest
  model parallel devices with the experts cut over the most ``ep`` neighbours)
  are simulated first;
- from the best plan so far it simulates the neighbours (one knob changed:
  the ZeRO stage, sequence parallel, interleaving, the schedule, the pipeline depth, the
  tensor parallel degree, the micro-batch size, recompute, context and expert parallel
  (first on a MoE model); ``moves``; the knob that
  last helped first) and moves to the first that is better: within the cap
  and faster, or, among plans over the cap, needing less memory;
- when none is, a plan over the cap (by at most half of it) but faster than
  the best is given less memory (only the moves that do not add memory) and
  the climb goes on from it if that fits and is faster.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from cube.compiler import batch_structure, trace_model
from cube.ir.blocks import blocks
from cube.sim.hardware import Hardware, mfu_precision
from cube.sim.search import Predicted
from cube.sim.simulate import SimResult
from cube.sim.step_end import ADAM_STATE_BYTES

POLICY = "PASMegatron"
MAX_TP = 8                # tensor parallel degrees searched, at most (inside a node)
SEED_STATIC_SHARE = 0.5   # a seed's static memory leaves half the cap to activations and buffers
MICRO_BATCHES = (1, 2, 4, 8, 16)   # micro-batch sizes searched
REPAIR_OVER = 1.5         # a plan over the cap is given less memory when it needs at most this much of it
SCHEDULES = ("1f1b", "zb-h1", "zbv", "dualpipev")   # PASMegatron's schedule_name values searched
V_SCHEDULES = ("zbv", "dualpipev")                  # two stages per pipeline rank, in a V
ZERO_STAGES = (0, 1, 2, 3)   # 1: the distributed optimizer; 2: and gradients; 3: fully sharded (and parameters)
MAX_CP = 8                   # context parallel degrees searched, at most


@dataclass(frozen=True)
class Plan:
    """One candidate: ``PASMegatron``'s options (``options()``) and the ZeRO stage."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    nmicros: int
    nvirtual: int = 1
    recompute: bool = True
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    cp: int = 1
    ep: int = 1

    def options(self) -> dict:
        """The keyword options of ``PASMegatron``."""
        out = {"tp": self.tp, "pp": self.pp, "nmicros": self.nmicros,
               "recompute": "all" if self.recompute else False}
        if self.nvirtual > 1:
            out["nvirtual"] = self.nvirtual
        if self.schedule != "1f1b":
            out["schedule_name"] = self.schedule
        if self.sp:
            out["sp"] = True
        if self.cp > 1:
            out["cp"] = self.cp
        if self.ep > 1:
            out["ep"] = self.ep
        return out

    @property
    def name(self) -> str:
        parts = [f"tp{self.tp} pp{self.pp} dp{self.dp} b{self.micro_batch} m{self.nmicros}"]
        if self.nvirtual > 1:
            parts.append(f"v{self.nvirtual}")
        if self.schedule != "1f1b":
            parts.append(self.schedule)
        parts.append("recompute" if self.recompute else "no-recompute")
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.sp:
            parts.append("sp")
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return " ".join(parts)

    def command(self) -> str:
        """The ``python -m cube.sim`` arguments that simulate this plan alone."""
        opts = " ".join(f"--option {k}={str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in self.options().items())
        return f"--policy {POLICY} {opts}" + (f" --zero {self.zero}" if self.zero else "")


@dataclass(frozen=True)
class Space:
    """What a plan may be: ``world`` devices in nodes of ``node``, a global ``batch`` of samples, a
    model of ``layers`` blocks, micro-batches of ``micro_batches`` samples."""

    world: int
    batch: int
    layers: int
    node: int
    micro_batches: Tuple[int, ...] = MICRO_BATCHES
    seq: int = 1       # tokens per sample (context parallel cuts them)
    experts: int = 0   # experts per MoE layer (0: none; expert parallel cuts them)

    def plan(self, tp: int, pp: int, micro_batch: int, nvirtual: int = 1, recompute: bool = True,
             zero: int = 0, sp: bool = False, schedule: str = "1f1b", cp: int = 1, ep: int = 1) -> Optional[Plan]:
        """The plan of these choices, None when they do not fit the devices, the batch or the model."""
        if tp not in self.tps() or pp < 1 or self.world % (tp * pp) or micro_batch not in self.micro_batches:
            return None
        dp = self.world // (tp * pp)
        # context and expert parallel take groups of data parallel neighbours (PASMegatron: not both);
        # a context parallel group shares its samples (cut along the sequence)
        if cp < 1 or ep < 1 or dp % cp or dp % ep or (cp > 1 and ep > 1):
            return None
        replicas = dp // cp   # data parallel groups that each take their own samples
        if self.batch % replicas or (self.batch // replicas) % micro_batch:
            return None
        nmicros = self.batch // (replicas * micro_batch)
        if pp * nvirtual > max(self.layers, 1) or (pp > 1 and nmicros < pp):
            return None
        if nvirtual > 1 and (pp == 1 or nmicros % pp):
            return None
        if (zero and dp == 1) or (sp and tp == 1) or zero not in ZERO_STAGES:
            return None
        if cp > 1 and self.seq % (2 * cp):   # ring attention cuts the sequence in 2 cp chunks
            return None
        if ep > 1 and (not self.experts or self.experts % ep):
            return None
        if schedule != "1f1b":   # ZB-H1 one stage per rank; ZB-V and DualPipeV two, in a V
            v = 2 if schedule in V_SCHEDULES else 1
            if pp == 1 or nvirtual > 1 or pp * v > max(self.layers, 1) or \
                    (schedule == "dualpipev" and nmicros < 2 * pp):
                return None
        return Plan(tp, pp, dp, micro_batch, nmicros, nvirtual if pp > 1 else 1, recompute, zero, sp,
                    schedule if pp > 1 else "1f1b", cp, ep)

    def tps(self) -> List[int]:
        """Tensor parallel degrees: groups of consecutive ranks that tile a node, at most ``MAX_TP``."""
        return [d for d in _divisors(self.world) if self.node % d == 0 and d <= MAX_TP]

    def pps(self, tp: int) -> List[int]:
        return [d for d in _divisors(self.world // tp) if d <= max(self.layers, 1)] if self.world % tp == 0 else []


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def static_bytes(params: int, itemsize: int, plan: Plan, experts: int = 0) -> float:
    """A lower bound of a rank's static memory under ``plan``: its share of the ``params`` elements
    (each held by at least one of the ``tp * pp`` ranks of a replica; the ``experts`` among them,
    MoE expert weights, cut over ``ep`` too) with their gradients and AdamW state, the state cut over
    ``dp`` by ZeRO (``cube.sim.step_end`` counts the same)."""
    share = (params - experts) / (plan.tp * plan.pp) + experts / (plan.tp * plan.pp * plan.ep)
    state = ADAM_STATE_BYTES / (plan.dp if plan.zero else 1)
    # ZeRO-2/3 cut gradients and parameters at rest, but a step holds each bucket's whole gradient
    # until it is reduced and (ZeRO-3) every gathered parameter until then: not cut here
    return share * (2 * itemsize + state)


def moves(space: Space, p: Plan) -> Iterator[Tuple[str, Optional[Plan], bool]]:
    """The neighbours of ``p``: ``(what changed, the plan or None, whether it only adds memory)``."""
    def at(**kw):
        merged = dict(tp=p.tp, pp=p.pp, micro_batch=p.micro_batch, nvirtual=p.nvirtual, recompute=p.recompute,
                      zero=p.zero, sp=p.sp, schedule=p.schedule, cp=p.cp, ep=p.ep)
        merged.update(kw)
        return space.plan(**merged)

    pps = space.pps(p.tp)
    k = pps.index(p.pp) if p.pp in pps else -1
    if space.experts:   # expert parallel first on a MoE model: experts cut over data parallel neighbours
        yield "more expert parallel", at(ep=p.ep * 2), False
        yield "less expert parallel", at(ep=p.ep // 2) if p.ep > 1 else None, True
    for z in ZERO_STAGES:   # fully sharded data parallel (2, 3) against the distributed optimizer (1) or none
        if z != p.zero:
            yield f"zero {z}", at(zero=z), z < p.zero
    yield "sequence parallel", at(sp=not p.sp), p.sp
    yield "interleave", at(nvirtual=1 if p.nvirtual > 1 else 2, schedule="1f1b"), p.nvirtual == 1
    for name in SCHEDULES:   # the schedule (ZB-V and DualPipeV hold more activations than 1F1B)
        if name != p.schedule:
            yield f"schedule {name}", at(schedule=name, nvirtual=1), name in V_SCHEDULES
    if k > 0:
        yield "fewer stages", at(pp=pps[k - 1]), True
    if 0 <= k < len(pps) - 1:
        yield "more stages", at(pp=pps[k + 1]), False
    yield "smaller tp", at(tp=p.tp // 2) if p.tp % 2 == 0 else None, True
    yield "smaller tp, more stages", at(tp=p.tp // 2, pp=p.pp * 2) if p.tp % 2 == 0 else None, False
    yield "larger tp", at(tp=p.tp * 2), False
    yield "larger tp, fewer stages", at(tp=p.tp * 2, pp=p.pp // 2) if p.pp % 2 == 0 else None, False
    yield "larger micro-batch", at(micro_batch=p.micro_batch * 2), True
    yield "smaller micro-batch", at(micro_batch=p.micro_batch // 2) if p.micro_batch % 2 == 0 else None, False
    yield "recompute", at(recompute=not p.recompute), p.recompute
    if space.seq > 1:   # context parallel: activations cut along the sequence
        yield "more context parallel", at(cp=p.cp * 2) if p.cp * 2 <= MAX_CP else None, False
        yield "less context parallel", at(cp=p.cp // 2) if p.cp > 1 else None, True


@dataclass
class Tried(Predicted):
    """A simulated plan: its prediction (``result`` None when it could not be planned), whether
    it fits the memory cap, the simulator's wall seconds, and how the search reached it."""

    plan: Plan
    result: Optional[SimResult] = None
    error: str = ""
    feasible: bool = False
    seconds: float = 0.0
    origin: str = ""
    tokens_per_s: float = 0.0   # per device
    mfu: float = 0.0            # the model's FLOPs (forward x 3) per second against the device's peak
    runs_on: str = ""           # the backend the plan runs on, "" where it does not run there

    def rank_key(self) -> tuple:
        """Within the cap by step time, then over it by memory, then failed."""
        if self.result is None:
            return (2, 0.0)
        return (0, self.step_time) if self.feasible else (1, float(self.peak))


def search(model: torch.nn.Module, batch, world: int, hardware: Hardware, precision: Optional[str] = "bf16",
           mem_cap: Optional[float] = None, budget: int = 16, include: Sequence[Plan] = (),
           micro_batches: Sequence[int] = MICRO_BATCHES, progress: Optional[Callable[[str], None]] = None,
           budget_s: Optional[float] = None, moe_imbalance: float = 1.0) -> List[Tried]:
    """Searches ``PASMegatron`` plans of ``model`` on ``world`` devices of ``hardware`` (module docstring).

    Args:
        model, batch: the single-device model (the meta device will do) and one global batch.
        world: devices.
        hardware: a profile that is not this host (``cube.sim.hardware.load("dgx-a100-80g")``).
        precision: training precision (``DeviceCosts``).
        mem_cap: bytes per device (default: the profile's device memory).
        budget: plans simulated at most (those given included).
        include: plans simulated first whatever their static memory (a policy's plan).
        micro_batches: micro-batch sizes to try.
        progress: called with one line per simulated plan (default: print to stderr).
        budget_s: wall seconds the search may take (None: no limit besides ``budget``): a plan is
            simulated only while the seconds spent plus the slowest simulation so far fit in it
            (the first is always simulated).
        moe_imbalance: the busiest expert parallel rank's (token, expert) rows over the mean
            (``DeviceCosts``; 1: a balanced router).

    Returns:
        The simulated plans ranked, best first (``Tried.rank_key``).

    Raises:
        ValueError: ``hardware`` is this host, ``budget`` is below 1 or ``budget_s`` is not positive.
    """
    if hardware.is_host:
        raise ValueError(f"cluster search: {hardware.name!r} is this host; pass a cluster profile "
                         f"(--hardware dgx-a100-80g), or use cube.sim.search for this host")
    if budget < 1:
        raise ValueError(f"cluster search: budget={budget} simulates nothing; pass at least 1")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"cluster search: budget_s={budget_s} leaves no time; pass a positive number of seconds")
    climb = _Climb(model, batch, world, hardware, precision, float(mem_cap if mem_cap is not None else hardware.memory_bytes), budget,
                   tuple(micro_batches), progress or (lambda line: print(line, file=sys.stderr, flush=True)), budget_s,
                   moe_imbalance)
    for plan in include:
        climb.run(plan, "given")
    for plan in _seeds(climb.space, lambda p: climb.static(p) <= climb.cap * SEED_STATIC_SHARE):
        climb.run(plan, "seed")
    climb.climb()
    return sorted(climb.tried.values(), key=Tried.rank_key)


class _Climb:
    """The search's state: the space, the plans simulated so far, the best, the move that last helped."""

    def __init__(self, model, batch, world: int, hardware: Hardware, precision: Optional[str], cap: float,
                 budget: int, micro_batches: Tuple[int, ...], progress: Callable[[str], None],
                 budget_s: Optional[float] = None, moe_imbalance: float = 1.0):
        from cube.sim.cluster import ClusterComm, DeviceCosts
        self.model, self.batch, self.world, self.precision = model, batch, world, precision
        self.cap, self.budget, self.progress = cap, budget, progress
        self.budget_s, self.started, self.slowest = budget_s, time.perf_counter(), 0.0
        self.costs, self.comm = DeviceCosts(hardware, precision, moe_imbalance=moe_imbalance), ClusterComm(hardware)
        self.peak = hardware.peak_flops(mfu_precision(precision or "fp32"))   # MFU's (bf16's under fp8)
        # every plan the space holds runs on NCCL (pipelines with several stages per rank on ordered
        # channels, cube.runtime.p2p.ordered); this host's profile runs them on gloo
        self.backend = "nccl" if hardware.kind == "gpu" else "gloo"
        self.traces: dict = {}   # one trace per batch size, shared by every plan
        structure, sample = batch_structure(batch)
        samples = sample[0].shape[0] if sample and sample[0].ndim else 1
        trainable = [p for p in model.parameters() if p.requires_grad]
        seq = sample[0].shape[1] if sample and sample[0].ndim >= 2 else 1
        # MoE experts: weights with a leading expert dim (PASMegatron's ep), the fewest of them
        experts = min((p.shape[0] for p in trainable if p.ndim >= 3), default=0)
        self.expert_params = sum(p.numel() for p in trainable if p.ndim >= 3)
        self.space = Space(world, samples, _layers(model, sample, structure, precision, self.traces),
                           hardware.gpus_per_node, micro_batches, seq, experts)
        self.tokens = samples * seq   # per step
        self.params = sum(p.numel() for p in trainable)
        self.itemsize = trainable[0].element_size() if trainable else 4
        self.tried: Dict[Plan, Tried] = {}
        self.best: Optional[Tried] = None
        self.last = ""

    def static(self, plan: Plan) -> float:
        return static_bytes(self.params, self.itemsize, plan, self.expert_params)

    def run(self, plan: Plan, origin: str) -> Optional[Tried]:
        """Simulates ``plan`` (None when it was already, or the budget is spent)."""
        from cube.sim.api import simulate_policy
        if plan in self.tried or self.spent():
            return None
        t0 = time.perf_counter()
        got = Tried(plan, origin=origin)
        try:
            got.result = simulate_policy(self.model, self.batch, POLICY, self.world, costs=self.costs, comm=self.comm,
                                         zero=plan.zero, precision=self.precision, options=plan.options(),
                                         symmetric=True, traces=self.traces)
            got.feasible = got.peak <= self.cap
            got.tokens_per_s = self.tokens / got.step_time / self.world
            got.mfu = got.result.model_flops / got.step_time / self.world / self.peak
            got.runs_on = self.backend
        except (ValueError, TypeError, NotImplementedError) as e:
            got.error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        got.seconds = time.perf_counter() - t0
        self.slowest = max(self.slowest, got.seconds)
        self.tried[plan] = got
        if self.best is None or got.rank_key() < self.best.rank_key():
            self.best = got
        what = got.error or f"{got.step_time:9.3f} s {got.peak / 2**30:7.1f} GiB" + \
            ("" if got.feasible else " over the cap")
        self.progress(f"[{len(self.tried)}/{self.budget}] {plan.name:<44} {what}  ({origin}, {got.seconds:.1f} s)")
        return got

    def spent(self) -> bool:
        """Whether the budget (plans, or wall seconds: the next plan might take the slowest's) is spent."""
        if len(self.tried) >= self.budget:
            return True
        return bool(self.tried) and self.budget_s is not None and \
            time.perf_counter() - self.started + self.slowest > self.budget_s

    def step(self, start: Tried) -> bool:
        """Simulates ``start``'s neighbours until one beats the best (True) or none is left; from a
        plan over the cap, only those that do not add memory."""
        reduce_only = start.result is not None and not start.feasible
        for what, plan, adds_memory in sorted(moves(self.space, start.plan), key=lambda m: m[0] != self.last):
            if self.spent():
                return False
            if plan is None or plan in self.tried or self.static(plan) > self.cap or (adds_memory and reduce_only):
                continue
            before = self.best
            self.run(plan, what)
            if self.best is not before:
                self.last = what
                return True
        return False

    def climb(self) -> None:
        """From the best plan, while the budget lasts; then from plans over the cap but faster."""
        while self.best is not None and not self.spent():
            if self.step(self.best):
                continue
            best = self.best
            faster = sorted((t for t in self.tried.values() if t.result is not None and not t.feasible
                             and t.peak <= REPAIR_OVER * self.cap and t.step_time < best.step_time),
                            key=lambda t: t.step_time)
            if not any(self.step(t) for t in faster):
                return


def _seeds(space: Space, fits: Callable[[Plan], bool]) -> List[Plan]:
    """Plans to start from (interleaved where there are stages, recompute, micro-batches of one
    sample, ZeRO-1 only where nothing fits without): the fewest model parallel devices (``tp``
    first, then ``pp``) that ``fits``, the largest ``tp`` inside a node with the fewest
    pipeline ranks that ``fits``, and on a MoE model the fewest model parallel devices that
    ``fits`` with its experts cut over the most data parallel neighbours (``ep``)."""
    def first(tps: Sequence[int], eps: Sequence[int] = (1,)) -> Optional[Plan]:
        for zero in (0, 1):
            for n in sorted({tp * pp for tp in tps for pp in space.pps(tp)}):
                for tp in tps:
                    for ep in eps:
                        for v in (2, 1):
                            plan = space.plan(tp, n // tp, 1, nvirtual=v, recompute=True, zero=zero, ep=ep) \
                                if n % tp == 0 else None
                            if plan is not None and fits(plan):
                                return plan
        return None
    found = [first(space.tps()), first([max(space.tps())])]
    if space.experts:
        found.append(first(space.tps(), sorted(_divisors(space.experts), reverse=True)))
    return [p for k, p in enumerate(found) if p is not None and p not in found[:k]]


def _layers(model, sample, structure, precision, traces: dict) -> int:
    """The model's repeated blocks (``cube.ir.blocks``), from a trace of two samples (kept in
    ``traces`` for the simulator's peek at the policy's mesh)."""
    small = tuple(t[:min(2, t.shape[0])] if t.ndim else t for t in sample)
    key = (tuple(tuple(t.shape) for t in small), 0, precision)
    if key not in traces:
        traces[key] = trace_model(model, small, precision=precision, structure=structure)
    return len(blocks(traces[key].graph))


def table(ranked: List[Tried], world: int, top: Optional[int] = None) -> str:
    """The ranked plans as a text table: step time, peak memory per rank, TFLOP/s per device and
    MFU (the model's FLOPs, forward x 3, against the device's peak), tokens/s per device, and the
    backend the plan runs on."""
    shown = ranked[:top] if top else ranked
    w = max([len("plan")] + [len(c.plan.name) for c in shown])   # the plan column fits its longest name
    lines = [f"{'#':>3}  {'plan':<{w}} {'step s':>9} {'peak GiB':>9} {'TFLOP/s':>8} {'MFU':>6} {'tok/s/dev':>10} "
             f"{'runs on':>7}  note"]
    for i, c in enumerate(shown, 1):
        if c.result is None:
            lines.append(f"{i:>3}  {c.plan.name:<{w}} {'-':>9} {'-':>9} {'-':>8} {'-':>6} {'-':>10} {'-':>7}  {c.error}")
            continue
        tflops = c.result.model_flops / c.step_time / world / 1e12
        note = ", ".join(n for n in ("over the memory cap" if not c.feasible else "",
                                     "given" if c.origin == "given" else "") if n)
        lines.append(f"{i:>3}  {c.plan.name:<{w}} {c.step_time:>9.3f} {c.peak / 2**30:>9.1f} {tflops:>8.1f} "
                     f"{c.mfu * 100:>5.1f}% {c.tokens_per_s:>10.0f} {c.runs_on or 'no':>7}  {note}")
    return "\n".join(lines)
