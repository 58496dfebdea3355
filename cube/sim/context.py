"""Ops in context: how much a whole step costs beyond the sum of its ops measured one by one.

The profiler times each op alone, on warm caches; a real step runs them one
after another through the generated code and autograd, on tensors that no
longer sit in cache. ``context_factor`` runs the model's single-device plan as
cube runs it (its generated code, ``cube.toolkit.whole``, in this process),
times its forward and backward, and divides by the sum of the profiled costs of
the same calls. The profiler then scales every op by it (``Profiler.scale``). A model
that does not fit on one device, or cannot run here, keeps the factor 1.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch

from cube.compiler import batch_structure, plan
from cube.sim.costs import needs_grad
from cube.sim.profile import typical

log = logging.getLogger("cube")


def _load(source: str):
    namespace: dict = {"__name__": "cube_sim_context"}
    exec(compile(source, "<cube.sim context plan>", "exec"), namespace)   # noqa: S102 - cube's own generated code
    return namespace


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
        """Seconds of the step's calls as ``profiler`` measures them one by one (its scale left out)."""
        scale, profiler.scale = profiler.scale, 1.0
        try:
            return sum(c.fw + (c.bw if needs_grad(call) else 0.0)
                       for call in self.calls for c in [profiler.op_cost(call)])
        finally:
            profiler.scale = scale

    def seconds(self) -> float:
        """Seconds of one forward and backward."""
        return _step(self.gen, self.data, self.structure, self.device)

    def factor(self, profiler, steps: int = 8) -> float:
        """Measured seconds (the median of the faster half of ``steps``, after two untimed ones) over
        ``profiled(profiler)``, at least 1."""
        profiled = self.profiled(profiler)
        measured = typical([self.seconds() for _ in range(max(steps, 1) + 2)][2:])
        return max(1.0, measured / profiled) if profiled > 0 else 1.0


def context_factor(model: torch.nn.Module, batch, profiler, steps: int = 8, device=None) -> float:
    """Measured seconds of a single-device step (forward and backward) over the sum of its ops'
    profiled costs, at least 1; 1 when the step cannot run here.

    Args:
        model, batch: the model and one batch (the sample the step is traced with).
        profiler: the ``Profiler`` whose costs are compared (and that should be scaled).
        steps: timed steps (after two untimed ones; the median of the faster half is kept, as the
            profiler keeps its samples).
    """
    device = device if device is not None else profiler.device
    old = torch.get_num_threads()
    if profiler.threads:
        torch.set_num_threads(profiler.threads)
    try:
        return WholeStep(model, batch, device).factor(profiler, steps)
    except (RuntimeError, ValueError, TypeError) as e:   # out of memory, or a model cube cannot run alone
        log.debug("cube.sim: no context factor (%s: %s); op costs are used as profiled", type(e).__name__, e)
        return 1.0
    finally:
        torch.set_num_threads(old)


def _step(gen, data, structure: str, device: torch.device) -> float:
    """Seconds of one forward and backward (CPU time of this thread on a one-thread CPU, else wall time)."""
    clock = time.thread_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = clock()
    loss = gen(*data) if structure == "tuple" else gen(data[0])
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = clock() - t0
    for p in gen.parameters():
        p.grad = None
    return elapsed


def scaled(profiler, model: torch.nn.Module, batch) -> Optional[float]:
    """Sets ``profiler.scale`` to the model's context factor; returns it (None for other cost models)."""
    if not hasattr(profiler, "scale"):
        return None
    profiler.scale = context_factor(model, batch, profiler)
    return profiler.scale
