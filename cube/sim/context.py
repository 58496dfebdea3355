"""Ops in context: how much a whole step costs beyond the sum of its ops measured one by one.

The profiler times each op alone, in a loop on the same inputs; a real step
runs them one after another through the generated code and autograd, on fresh
outputs and tensors that no longer sit in cache. The difference has two parts
(measured on CPU ranks: a GPT's step at batch 16 and at batch 4 differ from
their profiled sums by the same ~15 ms, and the difference grows with the
number of layers, not the batch):

- a **scale** on the work itself (cold caches; ``Context.scale``), and
- a **cost per call** that does not shrink with the op (``Context.per_call``:
  each forward call and each backward call of an op pays it once).

Memory-bound work (the optimizer step, copies) has a factor of its own
(``Context.memory``): an AdamW step over the model's parameters timed against
the profiler's rate for it (a shared host's memory bandwidth drifts apart from
its compute: x3 against x1.1 on one afternoon).

``fit_context`` runs the model's single-device plan as cube runs it (its
generated code, ``cube.toolkit.whole``, in this process) at the batch and at a
quarter of it, and the AdamW step, in turns, and fits the three (``fit``); a
model whose batch cannot be cut along dim 0 gets no cost per call. The profiler
then applies them to every op, optimizer step and copy (``Profiler.context``).
A model that does not fit on one device, or cannot run here, keeps the ops as
profiled. On a GPU no cost per call is fitted (the step runs at the batch
alone): a kernel's launch is the host's part of the op, which the simulator
models on its own (``cube.sim.engine``).
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import replace
from typing import List, Optional, Sequence, Tuple

import torch

from cube.compiler import batch_structure, plan
from cube.sim.costs import needs_grad
from cube.sim.profile import Context, seconds_of, typical

log = logging.getLogger("cube")


def _load(source: str):
    namespace: dict = {"__name__": "cube_sim_context"}
    exec(compile(source, "<cube.sim context plan>", "exec"), namespace)   # noqa: S102 - cube's own generated code
    return namespace


def fit(points: Sequence[Tuple[float, int, float]], optimizer: Optional[Tuple[float, float]] = None) -> Context:
    """The ``Context`` through whole steps, each ``(profiled seconds, calls, measured seconds)``, and an
    optimizer step ``(profiled seconds, measured seconds)`` (its ratio is ``memory``; 1 without one).

    Least squares of ``measured = scale * profiled + per_call * calls``; with one point, or points
    whose profiled sums barely differ, the scale alone. Neither part below what the op costs alone:
    a negative cost per call is dropped (the scale alone), a scale under 1 raised to 1 (the rest
    per call).
    """
    memory = optimizer[1] / optimizer[0] if optimizer and optimizer[0] > 0 and optimizer[1] > 0 else 1.0
    return replace(_fit_ops(points), memory=memory)


def _fit_ops(points: Sequence[Tuple[float, int, float]]) -> Context:
    points = [(p, n, m) for p, n, m in points if p > 0 and n > 0]
    if not points:
        return Context()

    def scale_only() -> Context:
        return Context(max(1.0, sum(m for _, _, m in points) / sum(p for p, _, _ in points)))
    ps = [p / n for p, n, _ in points]   # per call: measured/n = scale * profiled/n + per_call
    if len(points) < 2 or max(ps) - min(ps) < 0.05 * max(ps):
        return scale_only()
    ms = [m / n for _, n, m in points]
    pm, mm = sum(ps) / len(ps), sum(ms) / len(ms)
    scale = sum((p - pm) * (m - mm) for p, m in zip(ps, ms)) / sum((p - pm) ** 2 for p in ps)
    per_call = mm - scale * pm
    if per_call < 0:
        return scale_only()
    if scale < 1.0:
        return Context(1.0, max(0.0, statistics.mean((m - p) / n for p, n, m in points)))
    return Context(scale, per_call)


class WholeStep:
    """The model's single-device plan as cube runs it (its generated code, ``cube.toolkit.whole``), ready
    to time: ``seconds()`` runs one forward and backward and returns its seconds (CPU time of this
    thread on a one-thread CPU, else wall time). ``profiled(profiler)``: the sum of the same calls'
    profiled costs, unscaled.

    Raises what planning or running raises (``RuntimeError`` for out of memory, ``ValueError`` or
    ``TypeError`` for a model cube cannot run alone).
    """

    def __init__(self, model: torch.nn.Module, batch, device=None):
        from cube.toolkit import whole   # the whole model on the one device
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.structure, sample = batch_structure(batch)
        planned = plan(model, batch, whole, 1)
        self.calls = [c for c in planned.program[0].plan.calls if c.op is not None]
        self.gen = _load(planned.source(0))["GenModel"](self.device)
        self.gen.load_from(model, {k: v.to(self.device) for k, v in planned.consts.items()})
        self.data = [t.to(self.device) for t in sample]

    def profiled(self, profiler) -> float:
        """Seconds of the step's calls as ``profiler`` measures them one by one (its context left out)."""
        return sum(fw + bw for fw, bw in self._costs(profiler))

    def count(self, profiler) -> int:
        """Calls the step makes as ``Profiler.context`` counts them: each op's forward, and its backward
        where it has one."""
        return sum(1 + (bw > 0) for _, bw in self._costs(profiler))

    def _costs(self, profiler):
        with profiler.alone():
            return [(c.fw, c.bw if needs_grad(call) else 0.0) for call in self.calls for c in [profiler.op_cost(call)]]

    def seconds(self) -> float:
        """Seconds of one forward and backward."""
        return _step(self.gen, self.data, self.structure, self.device)


class OptimizerStep:
    """AdamW over copies of parameters, their gradients set, ready to time: ``seconds()`` runs one step
    (CPU time of this thread on a one-thread CPU, else wall time); ``profiled(profiler)`` is its cost as
    the profiler rates it (its context left out)."""

    def __init__(self, params, device=None):
        self.params = [torch.nn.Parameter(p.detach().clone().to(device)) for p in params]
        for p in self.params:
            p.grad = torch.rand_like(p)
        self.opt = torch.optim.AdamW(self.params, lr=1e-4)
        self.device = self.params[0].device if self.params else torch.device("cpu")

    def profiled(self, profiler) -> float:
        with profiler.alone():
            return profiler.optimizer_cost([p.numel() for p in self.params])

    def seconds(self) -> float:
        return seconds_of(self.opt.step, self.device)


def timed(items: Sequence, steps: int = 8) -> List[float]:
    """Seconds of each item's ``seconds()``, timed in turns (so that a swing of the host's speed hits
    all alike), ``steps`` times each after two untimed turns: the median of the faster half, as the
    profiler keeps its samples."""
    times: List[List[float]] = [[] for _ in items]
    for turn in range(max(steps, 1) + 2):
        for item, got in zip(items, times):
            t = item.seconds()
            if turn >= 2:
                got.append(t)
    return [typical(got) for got in times]


def fit_measured(wholes: Sequence[WholeStep], optimizer: Optional[OptimizerStep], measured: Sequence[float],
                 profiler) -> Context:
    """``fit`` of the steps (and the optimizer step, last in ``measured`` when given) as measured."""
    points = [(w.profiled(profiler), w.count(profiler), m) for w, m in zip(wholes, measured)]
    opt = (optimizer.profiled(profiler), measured[len(wholes)]) if optimizer is not None else None
    return fit(points, opt)


def fit_context(model: torch.nn.Module, batch, profiler, steps: int = 8, device=None) -> Context:
    """The ``Context`` of the model's ops (see the module docstring): its single-device step timed at
    ``batch`` and, on a CPU, at a quarter of it (dim 0 of every tensor of the batch), and AdamW over its
    parameters, in turns, fitted by ``fit``; ``Context()`` (the ops as profiled) when the step cannot
    run here.

    Args:
        model, batch: the model and one batch (the sample the step is traced with).
        profiler: the ``Profiler`` whose costs are compared (and that should carry the context).
        steps: timed steps of each (after two untimed ones; the median of the faster half is kept, as
            the profiler keeps its samples).
    """
    device = torch.device(device if device is not None else profiler.device)
    old = torch.get_num_threads()
    if profiler.threads:
        torch.set_num_threads(profiler.threads)
    try:
        wholes = [WholeStep(model, batch, device)]
        small = quarter(batch) if device.type == "cpu" else None
        if small is not None:
            try:
                wholes.append(WholeStep(model, small, device))
            except (RuntimeError, ValueError, TypeError) as e:   # a batch not cut along dim 0: the scale alone
                log.debug("cube.sim: the step at a quarter of the batch does not run (%s: %s); the context is "
                          "a scale alone", type(e).__name__, e)
        optimizer = OptimizerStep(wholes[0].gen.parameters(), device)
        return fit_measured(wholes, optimizer, timed(wholes + [optimizer], steps), profiler)
    except (RuntimeError, ValueError, TypeError) as e:   # out of memory, or a model cube cannot run alone
        log.debug("cube.sim: no context (%s: %s); op costs are used as profiled", type(e).__name__, e)
        return Context()
    finally:
        torch.set_num_threads(old)


def quarter(batch):
    """The batch cut to a quarter along dim 0 (at least one sample), in its structure; None when its
    tensors do not share a dim 0 of at least 2."""
    structure, tensors = batch_structure(batch)
    sizes = {t.shape[0] if t.dim() else 0 for t in tensors}
    if len(sizes) != 1 or next(iter(sizes)) < 2:
        return None
    k = max(1, next(iter(sizes)) // 4)
    cut = tuple(t[:k] for t in tensors)
    return cut[0] if structure == "tensor" else cut


def _step(gen, data, structure: str, device: torch.device) -> float:
    """Seconds of one forward and backward (``seconds_of``); the gradients are cleared after it."""
    elapsed = seconds_of(lambda: (gen(*data) if structure == "tuple" else gen(data[0])).backward(), device)
    for p in gen.parameters():
        p.grad = None
    return elapsed


def scaled(profiler, model: torch.nn.Module, batch) -> Optional[Context]:
    """Sets ``profiler.context`` to the model's (``fit_context``); returns it (None for other cost models)."""
    if not hasattr(profiler, "context"):
        return None
    profiler.context = fit_context(model, batch, profiler)
    log.info("cube.sim: ops in a whole step cost %s of their profiled seconds", profiler.context)
    return profiler.context
