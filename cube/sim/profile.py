"""Measuring op pieces on this device: forward and backward time at their local shapes.

For each op piece the profiler forms the call the generated code makes
(``cube.codegen.local.local_call``), builds random inputs of the piece's local
shapes, runs it (forward under autograd when something needs a gradient, then
backward through ``torch.autograd.grad`` on the outputs) and keeps the median
of a few repeats. It also records which tensors autograd saved for backward and
which outputs are views of an input, for the memory model.

Results are cached on disk (``<cache dir>/sim/profile.json``) keyed by the call,
its local shapes, dtypes, gradient flags, non-tensor arguments, the device and
the thread count, so a second run measures nothing. A call that cannot run
standalone falls back to the FLOP/byte estimate (logged at DEBUG).

On a CPU with one intra-op thread (how torchrun runs ranks) the clock is the
measuring thread's CPU time, so other programs sharing the cores do not
inflate the costs: they are those of an idle host (the simulator shares the
cores itself). Elsewhere it is wall time (after synchronizing a GPU).
"""
from __future__ import annotations

import logging
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

import cube.runtime
from cube.codegen.local import local_call
from cube.ir.ops import op_info
from cube.ir.tensor import IRTensor, TensorKind
from cube.passes.rank_plans import Call
from cube.sim.costs import Estimator, OpCost, adamw_workspace, local_shapes, needs_grad
from cube.sim.store import JsonStore, default_path

log = logging.getLogger("cube")
VERSION = 4   # part of every cache key: measurements of another version are taken again


def resolve(name: str) -> Callable:
    """``"aten.linear.default"`` / ``"runtime.ops.mean_part"`` / ``"torch.ops.x.y.z"`` -> the callable."""
    root, *rest = name.split(".")
    obj = {"aten": torch.ops.aten, "runtime": cube.runtime, "torch": torch}[root]
    for part in rest:
        obj = getattr(obj, part)
    return obj


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock_for(device: torch.device) -> Callable[[], float]:
    """The clock costs on ``device`` are timed with: this thread's CPU time on a CPU with one intra-op
    thread (not inflated by other programs sharing the cores), else wall time (after ``_sync``)."""
    return time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def seconds_of(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one ``fn()`` on ``clock_for(device)``, the device synchronized around it."""
    clock = clock_for(device)
    _sync(device)
    t0 = clock()
    fn()
    _sync(device)
    return clock() - t0


def time_call(fn: Callable[[], object], device: torch.device, repeats: int = 5, budget: float = 2e-3) -> float:
    """Seconds of ``fn()``: the median of the faster half of ``repeats`` samples. Fast calls are looped so
    that a sample lasts about ``budget``. On a CPU with one intra-op thread the clock is this thread's
    CPU time (not inflated by other programs sharing the cores), else wall time."""
    clock = clock_for(device)
    fn()
    _sync(device)
    t0 = clock()
    fn()
    _sync(device)
    one = max(clock() - t0, 1e-7)
    inner = max(1, min(200, int(budget / one)))
    samples = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            fn()
        _sync(device)
        samples.append((clock() - t0) / inner)
    return typical(samples)


def typical(times) -> float:
    """The median of the faster half of ``times`` (what the profiler keeps of its samples)."""
    times = sorted(times)
    return statistics.median(times[:max(1, (len(times) + 1) // 2)])


@dataclass(frozen=True)
class Context:
    """What an op costs in a whole step: ``scale`` times its profiled seconds, plus ``per_call`` seconds
    for each call (its forward, and its backward when it has one); the optimizer step and memory copies
    ``memory`` times theirs (memory-bound work: a host's memory bandwidth drifts apart from its compute,
    by x3 against x1.1 on a shared VM)."""

    scale: float = 1.0
    per_call: float = 0.0
    memory: float = 1.0

    def __str__(self) -> str:
        return f"x{self.scale:.2f} {self.per_call * 1e6:+.0f} us a call, optimizer and copies x{self.memory:.2f}"


class Profiler:
    """Measured costs of op pieces on ``device`` (default: CUDA if available, else CPU).

    Args:
        device: where to measure.
        cache: the JSON file of measurements (default ``<cache dir>/sim/profile.json``);
            ``False`` keeps them in memory only.
        repeats: samples per measurement (the median is kept).
        threads: intra-op threads while measuring (CPU); default: torch's current setting.
            Ranks launched by torchrun run with one thread each.

    Attributes:
        context: what an op costs in a whole step beyond alone (``Context``: a scale, a cost per
            call and a factor on the optimizer and copies, fitted by ``cube.sim.context.fit_context``);
            none by default (``alone()`` leaves it out for a while).
    """

    def __init__(self, device=None, cache=None, repeats: int = 7, threads: Optional[int] = None):
        self.device = torch.device(device) if device is not None else \
            torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.store = JsonStore(None if cache is False else (cache or default_path("profile")))
        self.repeats = repeats
        self.threads = threads
        self.estimate = Estimator()
        self.hits = self.misses = 0
        self.context = Context()   # what ops cost in a whole step beyond alone (cube.sim.context)
        self._memo: Dict[str, OpCost] = {}

    # ------------------------------------------------------------------ public
    def op_cost(self, call: Call) -> OpCost:
        """The cost of an op piece (measured once, then from the cache), in context: ``context.scale``
        times it, plus ``context.per_call`` for its forward and for its backward (where it has one)."""
        cost = self._cost(call)
        k, c = self.context.scale, self.context.per_call
        if k == 1.0 and c == 0.0:
            return cost
        return OpCost(cost.fw * k + c, cost.bw * k + (c if cost.bw > 0 else 0.0), cost.saved, cost.alias,
                      cost.measured)

    @contextmanager
    def alone(self) -> Iterator["Profiler"]:
        """Inside, costs as profiled: the context is left out (and put back after)."""
        context, self.context = self.context, Context()
        try:
            yield self
        finally:
            self.context = context

    def _cost(self, call: Call) -> OpCost:
        key = self.key(call)
        if key in self._memo:
            return self._memo[key]
        hit = self.store.get(key)
        if hit is not None:
            self.hits += 1
            cost = OpCost.from_json(hit)
        else:
            self.misses += 1
            cost = self._measure(call)
            self.store.put(key, cost.to_json())
        self._memo[key] = cost
        return cost

    def optimizer_cost(self, numels: Sequence[int]) -> float:
        """Seconds of one AdamW step over tensors of ``numels`` elements: a per-tensor and a
        per-element rate, measured once per device, times ``context.memory``."""
        per_tensor, per_elem = self._adam_rates()
        return (len(numels) * per_tensor + sum(numels) * per_elem) * self.context.memory

    def optimizer_workspace(self, numels: Sequence[int]) -> int:
        """AdamW's temporaries on this device: ``foreach`` on a GPU, the single-tensor loop on a CPU."""
        return adamw_workspace(numels, foreach=self.device.type != "cpu")

    def copy_cost(self, nbytes: int) -> float:
        return nbytes * self._copy_rate() * self.context.memory

    def save(self) -> None:
        """Writes new measurements to the cache file."""
        self.store.save()

    def key(self, call: Call) -> str:
        fn, args, kwargs, _ = self._call(call)
        shapes = {id(t): s for t, s in zip(call.op.inputs, local_shapes(call)[0])}
        grads = {id(t): self._requires_grad(call, k) for k, t in enumerate(call.op.inputs)}

        def sig(v):
            if isinstance(v, IRTensor):
                shape = shapes.get(id(v), tuple(v.shape))
                return f"T{list(shape)}:{str(v.dtype)[6:]}{'g' if grads.get(id(v)) else ''}"
            if isinstance(v, (list, tuple)):
                return "[" + ",".join(sig(x) for x in v) + "]"
            if isinstance(v, dict):
                return "{" + ",".join(f"{k}={sig(x)}" for k, x in sorted(v.items())) + "}"
            if isinstance(v, torch.device):
                return "dev"
            return repr(v)
        threads = self.threads or torch.get_num_threads()
        return f"{fn}({sig(args)};{sig(kwargs)})@{self.device.type}/t{threads}/v{VERSION}"

    # ------------------------------------------------------------------ measuring
    def _call(self, call: Call):
        op = call.op
        count = None
        share = getattr(op.root, "micro_share", None)   # a pipeline micro-batch's loss: the global batch's count
        if (call.term_ranks or (share is not None and share[0] == "targets")) and op_info(op.name).counts_targets:
            # a known global count: no communication here
            count = IRTensor((), op.inputs[0].dtype, False, TensorKind.ACTIVATION, "count")
        elif share is not None and share[0] == "value":   # loss_sum / count: the count of the global batch
            count = op.inputs[share[2]]
        fn, args, kwargs = local_call(op, call.layout, call.term_ranks, count)
        name = fn or str(op.target)
        if fn is None and not str(op.target).startswith(("aten.", "torch.ops")):
            name = f"torch.ops.{op.target}"
        return name, args, kwargs, count

    @staticmethod
    def _requires_grad(call: Call, k: int) -> bool:
        t = call.op.inputs[k]
        return bool(call.op.grad_enabled and t.requires_grad and t.dtype.is_floating_point
                    and k not in call.layout.unread)

    def _inputs(self, call: Call, count) -> Dict[int, torch.Tensor]:
        op = call.op
        ins, _ = local_shapes(call)
        floats = [s for s, t in zip(ins, op.inputs) if t.dtype.is_floating_point]
        bound = max(1, min([d for s in floats for d in s] or [2]))
        out: Dict[int, torch.Tensor] = {}
        for k, (t, shape) in enumerate(zip(op.inputs, ins)):
            if t.dtype.is_floating_point:
                x = torch.rand(shape, dtype=t.dtype, device=self.device) + 0.5
                x.requires_grad_(self._requires_grad(call, k))
            elif t.dtype == torch.bool:
                x = torch.rand(shape, device=self.device) > 0.5
            else:
                x = torch.randint(0, bound, shape, dtype=t.dtype, device=self.device)
            out[id(t)] = x
        if count is not None:
            tgt = op.inputs[1] if len(op.inputs) > 1 else op.inputs[0]
            out[id(count)] = torch.tensor(float(tgt.numel()), dtype=count.dtype, device=self.device)
        return out

    def _measure(self, call: Call) -> OpCost:
        old = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            return self._measure_call(call)
        except Exception as e:   # noqa: BLE001 - any op that cannot run alone is estimated instead
            log.debug("cube.sim: cannot profile %s standalone (%s: %s); using the FLOP/byte estimate",
                      call.op.name, type(e).__name__, e)
            return self.estimate.op_cost(call)
        finally:
            torch.set_num_threads(old)

    def _measure_call(self, call: Call) -> OpCost:
        name, args, kwargs, count = self._call(call)
        fn = resolve(name)
        values = self._inputs(call, count)
        dev = self.device

        def mat(v):
            if isinstance(v, IRTensor):
                return values[id(v)]
            if isinstance(v, list):
                return [mat(x) for x in v]
            if isinstance(v, tuple):
                return tuple(mat(x) for x in v)
            if isinstance(v, dict):
                return {k: mat(x) for k, x in v.items()}
            if isinstance(v, torch.device):
                return dev
            return v
        a, kw = mat(args), mat(kwargs)
        grad = needs_grad(call)
        with torch.set_grad_enabled(grad):
            fw = time_call(lambda: fn(*a, **kw), dev, self.repeats)
            saved, out = self._saved(call, values, lambda: fn(*a, **kw))
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if torch.is_tensor(o)]
        alias = tuple(self._alias(o, call, values) for o in outs)
        bw = 0.0
        leaves = [values[id(t)] for k, t in enumerate(call.op.inputs) if self._requires_grad(call, k)]
        roots = [o for o in outs if o.requires_grad]
        if grad and leaves and roots:
            seeds = [torch.ones_like(o) for o in roots]
            run = lambda: torch.autograd.grad(roots, leaves, seeds, retain_graph=True, allow_unused=True)  # noqa: E731
            bw = max(time_call(run, dev, self.repeats) - self._engine_overhead(), 0.1 * fw)
        return OpCost(fw, bw, saved, alias, measured=True)

    def _saved(self, call: Call, values, run):
        """Runs once under saved-tensor hooks: which inputs/outputs (or own tensors) autograd keeps."""
        found: List = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: found.append(t) or t, lambda t: t):
            out = run()
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out]) if torch.is_tensor(o)]
        ptrs_in = {}
        for k, t in enumerate(call.op.inputs):
            x = values[id(t)]
            if x.numel():
                ptrs_in.setdefault(x.untyped_storage().data_ptr(), k)
        ptrs_out = {o.untyped_storage().data_ptr(): j for j, o in enumerate(outs) if o.numel()}
        saved, seen = [], set()
        for t in found:
            if not torch.is_tensor(t) or not t.numel():
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            if ptr in ptrs_out:
                saved.append(("out", ptrs_out[ptr]))
            elif ptr in ptrs_in:
                saved.append(("in", ptrs_in[ptr]))
            else:
                saved.append(("x", t.untyped_storage().nbytes()))
        return tuple(saved), out

    @staticmethod
    def _alias(o: torch.Tensor, call: Call, values) -> int:
        if not o.numel():
            return -1
        ptr = o.untyped_storage().data_ptr()
        for k, t in enumerate(call.op.inputs):
            x = values[id(t)]
            if x.numel() and x.untyped_storage().data_ptr() == ptr:
                return k
        return -1

    # ------------------------------------------------------------------ device rates
    def _rate(self, name: str, measure: Callable[[], object]):
        threads = self.threads or torch.get_num_threads()
        key = f"#{name}@{self.device.type}/t{threads}/v{VERSION}"
        hit = self.store.get(key)
        if hit is None:
            old = torch.get_num_threads()
            if self.threads:
                torch.set_num_threads(self.threads)
            try:
                hit = measure()
            finally:
                torch.set_num_threads(old)
            self.store.put(key, hit)
        return hit

    def _engine_overhead(self) -> float:
        """Seconds autograd spends starting a backward (paid once per step, not per op)."""
        def measure():
            x = torch.rand(4, device=self.device, requires_grad=True)
            y = x * 2
            g = torch.ones_like(y)
            base = time_call(lambda: torch.autograd.grad([y], [x], [g], retain_graph=True), self.device, 9)
            return 0.7 * base   # the rest is the one node's own cost
        return self._rate("engine", measure)

    def _copy_rate(self) -> float:
        def measure():
            x = torch.empty(4 << 20, dtype=torch.float32, device=self.device)
            return time_call(lambda: x.clone(), self.device, 5) / (x.numel() * 4)   # seconds per byte
        return self._rate("copy-seconds-per-byte", measure)

    def _adam_rates(self):
        def measure():
            def step_time(shapes):
                ps = [torch.nn.Parameter(torch.rand(s, device=self.device)) for s in shapes]
                for p in ps:
                    p.grad = torch.rand_like(p)
                opt = torch.optim.AdamW(ps, lr=1e-3)
                return time_call(opt.step, self.device, 5)
            small = step_time([(8,)] * 64) / 64
            big = step_time([(1 << 20,)])
            return [small, max(big - small, 1e-9) / (1 << 20)]
        return tuple(self._rate("adamw", measure))
