"""Entry points that wire the models together: default cost models, and simulating a policy."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional, Tuple

import torch

from cube.compiler import batch_structure, trace_and_plan
from cube.policy import bind_options, load_policy
from cube.sim import comm as comm_mod
from cube.sim.costs import Estimator
from cube.sim.host import Host, this_host
from cube.sim.profile import Profiler
from cube.sim.simulate import SimResult, simulate


def default_models(world: int, estimate: bool = False, calibrate: bool = True, cores: Optional[float] = None
                   ) -> Tuple[object, comm_mod.CommModel, Optional[Host]]:
    """``(costs, comm, host)`` for simulating ``world`` ranks on this kind of device.

    On CPU the ranks are taken to share this host (``cube.sim.host.this_host``:
    its cores, or ``cores``; one thread per rank, as torchrun starts them); on
    GPU each rank has its own device (host None). Collectives are calibrated
    once for ``min(world, what this host can run)`` ranks and cached.
    """
    cuda = torch.cuda.is_available()
    costs = Estimator() if estimate else Profiler(threads=None if cuda or world == 1 else 1)
    if cuda:
        n = min(world, torch.cuda.device_count())
    else:
        n = min(world, max(2, os.cpu_count() or 2))
    comm = comm_mod.load(n, calibrate_missing=calibrate and n >= 2) if n >= 2 else comm_mod.CommModel(
        comm_mod.default_backend())
    if cuda:
        return costs, comm, None
    host = this_host()
    return costs, comm, host if cores is None else replace(host, cores=float(cores))


def simulate_policy(model: torch.nn.Module, batch, policy, world: int, costs=None, comm=None, zero: int = 0,
                    host: Optional[Host] = None, precision: Optional[str] = None,
                    options: Optional[dict] = None) -> SimResult:
    """Traces ``model`` on ``batch``, applies ``policy`` (a callable, ``"file.py:Name"``,
    ``"module:Name"`` or a shipped policy name) with its keyword ``options`` for ``world`` ranks
    and simulates one step.

    Raises:
        TypeError: an option the policy does not take.
    """
    structure, sample = batch_structure(batch)
    policy = bind_options(load_policy(policy), options)   # an unknown option fails before the trace
    graph, _ = trace_and_plan(model, sample, structure, policy, world,
                              zero=3 if zero == 3 else 0, precision=precision)
    result = simulate(graph, world, costs=costs, comm=comm, zero=zero, host=host)
    if hasattr(costs, "save"):
        costs.save()
    return result
