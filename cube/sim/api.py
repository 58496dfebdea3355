"""Entry points that wire the models together: default cost models, and simulating a policy."""
from __future__ import annotations

import os
from dataclasses import replace
from typing import Optional, Tuple

import torch

from cube.compiler import batch_structure, trace_model
from cube.policy import Resource, apply_policy, bind_options, load_policy
from cube.schedule.balance import op_flops
from cube.sim import comm as comm_mod
from cube.sim import symmetry
from cube.sim.costs import Estimator
from cube.sim.host import Host, this_host
from cube.sim.profile import Profiler
from cube.sim.simulate import SimResult, simulate


def default_models(world: int, estimate: bool = False, calibrate: bool = True, cores: Optional[float] = None,
                   recalibrate: bool = False) -> Tuple[object, comm_mod.CommModel, Optional[Host]]:
    """``(costs, comm, host)`` for simulating ``world`` ranks on this kind of device.

    On CPU the ranks are taken to share this host (``cube.sim.host.this_host``:
    its cores, or ``cores``; one thread per rank, as torchrun starts them); on
    GPU each rank has its own device (host None). Collectives are calibrated
    once for ``min(world, what this host can run)`` ranks and cached (``recalibrate``: measured again now).
    """
    cuda = torch.cuda.is_available()
    costs = Estimator() if estimate else Profiler(threads=None if cuda or world == 1 else 1)
    if cuda:
        n = min(world, torch.cuda.device_count())
    else:
        n = min(world, max(2, os.cpu_count() or 2))
    comm = comm_mod.load(n, calibrate_missing=calibrate, again=recalibrate) if n >= 2 else comm_mod.CommModel(
        comm_mod.default_backend())
    if cuda:
        return costs, comm, None
    host = this_host()
    return costs, comm, host if cores is None else replace(host, cores=float(cores))


def simulate_policy(model: torch.nn.Module, batch, policy, world: int, costs=None, comm=None, zero: int = 0,
                    host: Optional[Host] = None, precision: Optional[str] = None,
                    options: Optional[dict] = None, symmetric: bool = False,
                    traces: Optional[dict] = None) -> SimResult:
    """Traces ``model`` on ``batch``, applies ``policy`` (a callable, ``"file.py:Name"``,
    ``"module:Name"`` or a shipped policy name) with its keyword ``options`` for ``world`` ranks
    and simulates one step.

    ``symmetric``: simulate one rank of each symmetric class (``cube.sim.symmetry``: data parallel
    folded to 2 replicas, one rank per ``dp``/``tp`` coordinate), for thousands of ranks; the
    result's ranks are then those simulated, numbered as in the folded world (``result.fold``).

    ``traces``: a dict the traces are kept in (by batch size), for callers simulating one model
    under many plans (``cube.sim.cluster_search``); every plan places a copy.

    Raises:
        TypeError: an option the policy does not take.
    """
    structure, sample = batch_structure(batch)
    samples = size_of(sample)   # of the whole step, whatever part of it is traced
    bound = bind_options(load_policy(policy), options)   # an unknown option fails before the trace
    fold, ranks, micro = None, None, None
    zero_traced = 3 if zero == 3 else 0
    if symmetric:
        # the policy's mesh depends on the world and the options, not on the batch: a small trace will do
        small = tuple(t[:min(2, t.shape[0])] if t.ndim else t for t in sample)
        peek = _trace(model, small, zero_traced, precision, structure, traces)
        mesh = symmetry.policy_mesh(lambda: apply_policy(bound, peek.graph.copy(), Resource(world)), world)
        size = samples if sample and sample[0].ndim else None
        # context and expert parallel (PASMegatron's cp, ep) cut dp into groups kept whole by the fold
        inner = max(int((options or {}).get(k) or 1) for k in ("cp", "ep"))
        fold = symmetry.fold_for(mesh, world, size, zero, inner)
        micro = symmetry.micro_fold(mesh, fold, size, options)
        scale = fold.batch[0] * (micro[0] if micro else 1), fold.batch[1] * (micro[1] if micro else 1)
        if scale[0] != scale[1]:
            sample = tuple(t[:t.shape[0] * scale[0] // scale[1]] for t in sample)
        if micro:
            bound = bind_options(load_policy(policy), {**options, "nmicros": micro[0]})
        ranks = fold.representatives()
        comm = symmetry.MappedComm(comm if comm is not None else comm_mod.CommModel(), fold)
    traced = _trace(model, sample, zero_traced, precision, structure, traces)
    sim_world = fold.world if fold is not None else world
    # a folded pipeline's micro-batch count is known: the policy runs once, on one micro-batch's trace
    graph = traced.place(bound, sim_world, nmicros=micro[0] if micro else None)
    result = simulate(graph, sim_world, costs=costs, comm=comm, zero=zero, host=host, ranks=ranks,
                      coarse=symmetric)
    result.fold = fold
    result.model_flops = model_flops(traced.graph) * (samples / size_of(sample))
    if micro:
        symmetry.extrapolate(result, *micro)
    if hasattr(costs, "save"):
        costs.save()
    return result


def _trace(model, sample, zero: int, precision, structure, cache: Optional[dict]):
    """``trace_model`` of ``sample``, from ``cache`` when it holds one of the same batch size."""
    if cache is None:
        return trace_model(model, sample, zero=zero, precision=precision, structure=structure)
    key = (tuple(tuple(t.shape) for t in sample), zero, precision)
    if key not in cache:
        cache[key] = trace_model(model, sample, zero=zero, precision=precision, structure=structure)
    return cache[key]


def size_of(sample) -> int:
    """Samples in a batch (its first tensor's dim 0; 1 for a tensor without dims)."""
    return sample[0].shape[0] if sample and sample[0].ndim else 1


def model_flops(graph) -> float:
    """FLOPs of one training step of the unplaced ``graph``: each op's forward FLOPs (``cube.ir.ops.flops``,
    matmul-like ops, attention and convolutions) times 3 (forward, and backward at twice the forward),
    recompute not counted, as MFU counts them."""
    return 3.0 * sum(op_flops(op) for op in graph.ops)
