"""``cube.compile``: drives trace -> policy -> passes -> codegen -> load, with a code cache.

The compile itself is a value: ``cube.trace_model(model, batch)`` gives a ``Traced``
graph that is never changed, ``Traced.plan(policy, world)`` (or ``cube.plan``)
runs the policy on a copy of it and the passes, and returns a ``Plan``: the
placed graph, every rank's program and, on demand, its Python source. Nothing
there starts a process group, reads data or writes files; ``CompiledStep``
(behind ``@cube.compile``) does those around it.
"""
from __future__ import annotations

import copy
import gc
import hashlib
import importlib.util
import inspect
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch

from cube import config
from cube.codegen import emit_all
from cube.codegen.report import write_report
from cube.ir import lost
from cube.ir.graph import IRGraph
from cube.passes import check_graph
from cube.passes.micro import micro_shares
from cube.passes.program import Program, build_program
from cube.passes.rng import check_exact, mark_draws
from cube.policy import Resource, apply_policy, load_policy, policy_name, policy_source
from cube.passes.precision import device_type
from cube.runtime import amp as rt_amp
from cube.runtime import compiled as rt_compiled
from cube.runtime import data as rt_data
from cube.runtime import device as rt_device
from cube.runtime import materialize
from cube.runtime import module as rt_module
from cube.runtime import profile as rt_profile
from cube.runtime import watchdog as rt_watchdog
from cube.runtime import session as rt_session
from cube.runtime.utils import atomic_write
from cube.trace import build_graph, export, flex
from cube.trace.casts import low_casts
from cube.trace.export import TraceError
from cube.trace.rules import REGISTRY

log = logging.getLogger("cube")

from cube.version import __version__ as VERSION


@contextmanager
def _phase(name: str, timings: dict, add: bool = False):
    """Times a phase into ``timings[name]`` (``add``: onto what the phase already took, e.g. the
    second trace and policy run of a pipeline plan on its micro-batch)."""
    start = time.perf_counter()
    yield
    timings[name] = (timings.get(name, 0.0) if add else 0.0) + time.perf_counter() - start


@contextmanager
def _gc_paused():
    """Pauses Python's cyclic garbage collector for a compile.

    Tracing and planning make millions of small objects that live until the
    compile ends; collections triggered while they pile up would walk them again
    and again (a large share of compile time on big graphs). Cycles left behind
    are collected once the collector is back on.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Batches:
    """The user's dataloader, with the batch compile read put back in front."""

    def __init__(self, dataloader):
        if not hasattr(dataloader, "__next__"):
            raise TypeError(f"cube.compile: the dataloader must be an iterator (next(dataloader) gives a "
                            f"batch); got {type(dataloader).__name__}. Pass iter(loader) instead.")
        self.source = dataloader
        # a checkpoint saved before the first step records the loader as it was before this read
        self.before = _state_before(dataloader)
        try:
            self.first = next(dataloader)
        except StopIteration:
            raise ValueError("cube.compile: the dataloader is empty; it needs at least one batch to trace") from None
        self.pending = True

    def take(self, dataloader) -> Iterator:
        if dataloader is self.source and self.pending:
            self.pending = False
            return _Prepend(self.first, dataloader)
        return dataloader


def _state_before(dataloader):
    """A copy of ``dataloader.state_dict()`` where it has one (``cube.runtime.resume``), else None."""
    if not callable(getattr(dataloader, "state_dict", None)):
        return None
    try:
        return copy.deepcopy(dataloader.state_dict())
    except Exception:   # noqa: BLE001 - a loader that cannot say its state before iterating: saves ask it later
        return None


class _Prepend:
    def __init__(self, first, rest):
        self.first, self.rest, self.used = first, rest, False

    def __iter__(self):
        return self

    def __next__(self):
        if not self.used:
            self.used = True
            return self.first
        return next(self.rest)


def batch_structure(batch):
    """``(structure, tensors)`` of a batch: ``"tensor"`` for one tensor, ``"tuple"`` for a tuple or list.

    Raises:
        TypeError: anything else.
    """
    if isinstance(batch, torch.Tensor):
        return "tensor", (batch,)
    if isinstance(batch, (tuple, list)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        return "tuple", tuple(batch)
    raise TypeError(f"cube.compile: a batch must be a tensor or a tuple/list of tensors, got "
                    f"{type(batch).__name__}; convert other items to tensors in the dataloader")


def _model_fingerprint(model: torch.nn.Module) -> str:
    parts = [type(model).__module__, type(model).__qualname__, repr(model), str(model.training)]
    files = set()
    for m in model.modules():
        try:
            files.add(inspect.getsourcefile(type(m)))
        except TypeError:
            pass
    for f in sorted(x for x in files if x):
        try:
            parts.append(Path(f).read_text())
        except OSError:
            parts.append(f)
    seen = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        parts.append(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}:{seen.setdefault(id(t), name)}")
    # the generated module registers these with persistent=False too (code cached before it did not)
    transient = sorted(f"{path}.{n}" if path else n for path, m in model.named_modules(remove_duplicate=False)
                       for n in m._non_persistent_buffers_set)
    parts.append("non-persistent buffers: " + ",".join(transient))
    return "\n".join(parts)


class CompiledStep:
    """A compiled training step: call it as ``step(model, dataloader)``.

    Attributes:
        key: the cache key of this plan.
        path: this rank's generated source file.
        timings: seconds per compile phase.
        graph: the IR after the policy (None when the code came from the cache).
        backend: the ``torch.compile`` backend the loaded module's compute runs under (None: eager).
        lost: the splits the policy asked for that the plan does not keep (``cube.ir.lost``),
            read back from the cache with the code when reused.
        strict: whether such splits are an error.
        exact_rng: whether random ops draw the single device's numbers (``cube.runtime.rng``).
    """

    def __init__(self, fn: Callable, model: torch.nn.Module, dataloader, pas, cache_dir=None,
                 use_cache: bool = True, zero: int = 0, precision: Optional[str] = None,
                 options: Optional[dict] = None, backend: Optional[str] = None, strict: bool = False,
                 exact_rng: bool = False, max_shapes: int = 1, tp_reduce_dtype: Optional[torch.dtype] = None):
        rt_compiled.check_backend(backend)
        self.exact_rng = bool(exact_rng)   # in the cache key: the random ops' code differs
        self.fn = fn
        self.max_shapes = max_shapes
        self._others: Dict[tuple, "CompiledStep"] = {}   # batch shapes -> the plan compiled for them
        self._models: Dict[int, torch.nn.Module] = {}   # id(user's generated model) -> this plan's module over it
        self.use_cache = use_cache
        # not in the cache key: it changes no code; the plan's lost splits are cached with it
        self.strict = strict
        self.options = dict(options or {})
        # not in the cache key: the generated code is the same, load_model wraps it in torch.compile
        self.backend = backend
        self.steps_run = 0
        self.zero = zero
        self.precision = precision
        self.tp_reduce_dtype = tp_reduce_dtype
        self.user_model = model
        self.timings: dict = {}
        self.env = rt_device.init()
        self.batches = _Batches(dataloader)
        self.structure, sample = batch_structure(self.batches.first)
        self.policy = load_policy(pas)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else config.cache_dir()
        self._prepare(sample)
        if self.env.rank == 0:
            log.info("cube: %s plan %s for %s (world %d): %s", "reused" if self.cache_hit else "compiled",
                     self.key[:12], type(model).__name__, self.env.world_size, _format_phases(self.timings))
            log.info("cube: %s", _plan_summary(self.module.GenModel, self.path))
            _warn_lost(self.lost, _policy_label(self.policy))

    def _prepare(self, sample) -> None:
        """Finds (in the cache) or compiles the plan for batches shaped like ``sample``, and loads its code."""
        self.shapes = tuple(tuple(t.shape) for t in sample)
        self.key = self._key(sample)
        folder = self.cache_dir / self.key
        self.path = folder / f"rank{self.env.rank}.py"
        self.consts_path = folder / f"rank{self.env.rank}.consts.pt"
        self.lost_path = folder / f"rank{self.env.rank}.lost.json"
        self.graph = None
        self.consts = {}
        if self.use_cache and self.path.exists():
            self.cache_hit = True
            if self.consts_path.exists():
                self.consts = torch.load(self.consts_path)
            self.lost = lost.loads(self.lost_path.read_text(), str(self.lost_path)) \
                if self.lost_path.exists() else []
            if self.strict and self.lost:   # the plan was made without strict: refuse it as planning would
                raise lost.error(self.lost, _policy_label(self.policy))
        else:
            self.cache_hit = False
            self._compile(sample)
        with _phase("load", self.timings):
            self.module = _load_source(self.path, f"cube_gen_{self.key[:16]}_rank{self.env.rank}")
        self.part = rt_data.read_part(self.path)
        # a rank whose ops read no batch tensor takes no batches after compile's first read
        # (with several batch shapes every rank reads every batch: its shape picks the plan)
        self._placeholders = None if self.part.reads or self.max_shapes > 1 else \
            rt_data.Placeholders(sample, self.structure)

    def _key(self, sample) -> str:
        h = hashlib.sha256()
        user_rules = sorted(f"{k}={v if isinstance(v, str) else policy_source(v)}"
                            for k, v in REGISTRY.rules.items() if k not in REGISTRY.builtin)
        for part in (VERSION, torch.__version__, _model_fingerprint(self.user_model),
                     policy_source(self.policy, self.options), self.structure,
                     repr([(tuple(t.shape), t.dtype) for t in sample]),
                     str(self.env.world_size), "\n".join(user_rules), f"zero={self.zero}",
                     f"precision={self.precision}", f"exact_rng={self.exact_rng}",
                     *((f"tp_reduce_dtype={self.tp_reduce_dtype}",) if self.tp_reduce_dtype is not None else ()),
                     # main-parameter plans: the float32 islands (and so the code) differ between CPU and CUDA
                     # (before: the forward under autocast over the low-precision weights)
                     # (and casts to a value's own dtype go to the weights' dtype: cube.trace.casts)
                     *((f"autocast-device={device_type()}", "half=islands", "casts=low")
                       if rt_amp.main_params(self.precision) else ()),
                     # random ops draw through cube.runtime.rng (before: the default generator as it stood)
                     "rng=keyed",
                     # exact_rng's table names each draw's op and arguments (before: six fields, dropout and rand)
                     *(("rng-table=call",) if self.exact_rng else ()),
                     # pipeline steps take the global batch and cut it (before: nmicros batches per step)
                     "step=global-batch",
                     # the plan's lost splits are cached with its code (entries before them lack the file)
                     "lost-splits=cached", *(() if config.fused_cut() else ("fused-cut=off",))):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def _compile(self, sample) -> None:
        with _gc_paused():
            traced = trace_model(self.user_model, sample, zero=self.zero, precision=self.precision,
                                 tp_reduce_dtype=self.tp_reduce_dtype,
                                 timings=self.timings, structure=self.structure)
            planned = traced.plan(self.policy, self.env.world_size, options=self.options, ranks=[self.env.rank],
                                  strict=self.strict, exact_rng=self.exact_rng)
            source = planned.source(self.env.rank)
        self.timings.update(planned.timings)
        self.graph = planned.graph
        self.consts = planned.consts
        self.lost = planned.lost
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.consts:
            atomic_write(self.consts_path, lambda f: torch.save(self.consts, f))
        # before the code: a cache entry with code has its lost splits
        atomic_write(self.lost_path, lambda f: f.write(lost.dumps(self.lost).encode()))
        atomic_write(self.path, lambda f: f.write(source.encode()))

    # ------------------------------------------------------------------ public
    def load_model(self, init: Optional[Callable] = None, weights=None, rename: Optional[Callable] = None,
                   strict: bool = True) -> torch.nn.Module:
        """This rank's generated module, holding its pieces of the model (see ``cube.load_model``)."""
        if init is None and weights is None and not _holds_meta(self.user_model):
            model = self.module.GenModel(self.env.device)
            model.load_from(self.user_model, self.consts)
        else:
            model = materialize.load(lambda: self.module.GenModel(self.env.device), self.user_model, self.consts,
                                     init=init, weights=weights, rename=rename, strict=strict)
        model.zero_stage = self.zero   # cube.build_optimizer follows it
        if self.backend is not None:
            # the class is this step's own: its forward (or stage methods) compiled once, for every
            # instance; the runtime's communication stays outside the graphs (cube.runtime.compiled)
            rt_compiled.compile_module(self.module.GenModel, self.backend)
        return model

    def __call__(self, model, dataloader):
        if not isinstance(model, self.module.GenModel):
            raise TypeError(f"the compiled step takes the module from cube.load_model(), got "
                            f"{type(model).__name__}: call `model = cube.load_model()` after compiling "
                            f"and pass that model to the step")
        if self.max_shapes > 1:
            return self._call_shaped(model, dataloader)
        if rt_amp.main_params(self.precision) and not getattr(model, "_lowered", False):
            raise ValueError(f"precision={self.precision!r} trains low-precision weights with float32 main "
                             f"parameters that cube.build_optimizer makes: build the optimizer with "
                             f"cube.build_optimizer(model, torch.optim.AdamW, ...) before the first step, or "
                             f"compile with precision={self.precision + '-autocast'!r} to step float32 "
                             f"parameters with any optimizer")
        step, self.steps_run = self.steps_run, self.steps_run + 1
        if self._placeholders is not None:
            self.batches.pending = False   # compile's batch is not needed on this rank either
            batches = self._placeholders
        else:
            batches = self.batches.take(dataloader)
        # the model's runtime state is active for the whole step; CUBE_PROFILE: a trace file of this step;
        # the watchdog names where the rank waits if the step never ends
        with rt_session.running(model), rt_profile.record(self.env.rank, step), \
                rt_watchdog.watched(f"step {step}"):
            return self.module.train_step(model, batches)

    def _call_shaped(self, model, dataloader):
        """A step of a compile for several batch shapes (``max_shapes``): the batch's shapes pick the plan,
        compiled at the first batch of those shapes; every plan runs over ``model``'s parameters."""
        it = self.batches.take(dataloader)
        self.batches.pending = False
        batch = rt_module.take(it)
        structure, sample = batch_structure(batch)
        shapes = tuple(tuple(t.shape) for t in sample)
        if structure != self.structure or len(shapes) != len(self.shapes):
            raise ValueError(f"the dataloader yielded a batch of {len(shapes)} tensor(s) as a {structure}, but the "
                             f"step was compiled for {len(self.shapes)} as a {self.structure}: keep every batch "
                             f"the same structure (only shapes may change, max_shapes={self.max_shapes})")
        plan = self if shapes == self.shapes else self._plan_for(shapes, sample)
        gen = model if plan is self else plan._module_over(model)
        step, self.steps_run = self.steps_run, self.steps_run + 1
        with rt_session.running(gen), rt_profile.record(self.env.rank, step), \
                rt_watchdog.watched(f"step {step}"):
            loss = plan.module.train_step(gen, _Prepend(batch, it))
        if gen is not model:   # one count of steps for the model's random draws (cube.runtime.rng), whatever the plan
            model.__dict__["_rng_steps"] = gen.__dict__.get("_rng_steps", 0)
        return loss

    def _plan_for(self, shapes: tuple, sample) -> "CompiledStep":
        """The plan for batches of ``shapes``: compiled (or found in the cache) the first time they come."""
        other = self._others.get(shapes)
        if other is not None:
            return other
        if len(self._others) + 1 >= self.max_shapes:
            known = [list(map(list, s)) for s in [self.shapes, *self._others]]
            raise ValueError(f"the dataloader yielded a batch of shapes {[list(s) for s in shapes]}, a new shape "
                             f"after {len(known)} (max_shapes={self.max_shapes}): {known}. Pad batches to a few "
                             f"lengths (bucketing: the step compiles one plan per bucket), drop the short last "
                             f"batch (drop_last=True), or raise max_shapes.")
        if self.zero == 3:
            raise ValueError("cube.compile(max_shapes=...) with zero=3: a plan for a new batch shape would gather "
                             "another plan's sharded parameters; use zero 0, 1 or 2, or a fixed batch shape")
        other = copy.copy(self)
        other.timings, other._others, other._models = {}, {}, {}
        other._prepare(sample)
        if not _same_parameters(self.module.GenModel, other.module.GenModel):
            raise ValueError(f"the policy places the parameters otherwise for batches of shapes "
                             f"{[list(s) for s in shapes]} than for {[list(s) for s in self.shapes]}: one model "
                             f"cannot run both plans. Keep the batch shape fixed (pad), or use a policy whose "
                             f"placement does not depend on it.")
        self._others[shapes] = other
        if self.env.rank == 0:
            log.info("cube: batch shapes %s: %s plan %s (%d of max_shapes=%d): %s", [list(s) for s in shapes],
                     "reused" if other.cache_hit else "compiled", other.key[:12], len(self._others) + 1,
                     self.max_shapes, _format_phases(other.timings))
            _warn_lost(other.lost, _policy_label(self.policy))
        return other

    def _module_over(self, model: torch.nn.Module) -> torch.nn.Module:
        """This plan's generated module over ``model``'s parameters and buffers (``model``: the first plan's)."""
        gen = self._models.get(id(model))
        if gen is None or gen.base is not model:
            gen = self.module.GenModel.over(model, self.consts)
            if self.backend is not None:
                rt_compiled.compile_module(self.module.GenModel, self.backend)
            self._models[id(model)] = gen
        gen.follow_base()
        return gen

    @property
    def source(self) -> str:
        return self.path.read_text()


def _same_parameters(a, b) -> bool:
    """Whether two generated modules hold the same pieces of the same parameters and buffers, and sum the
    same gradients over the same ranks (plans of one model for two batch shapes that one model can run)."""
    return all(getattr(a, k, None) == getattr(b, k, None)
               for k in ("PARAMS", "BUFFERS", "FULL_SHAPES", "REDUCE", "REDUCE_AFTER", "ZERO", "PRECISION"))


def _holds_meta(model: torch.nn.Module) -> bool:
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def _plan_summary(cls, path: Path) -> str:
    """One line on what rank 0 holds and does (from its generated module's tables): the user's
    parameters it holds, and how many of them only in part (a fused weight's blocks count as one)."""
    held: Dict[str, int] = {}
    shapes = getattr(cls, "FULL_SHAPES", {})
    for names, splits in cls.PARAMS.values():
        shape = list(shapes.get(names[0], ()))
        for dim, start, stop in splits:
            shape[dim] = stop - start
        held[names[0]] = held.get(names[0], 0) + math.prod(shape)
    pieces = sum(1 for n, k in held.items() if n in shapes and k < math.prod(shapes[n]))
    groups = len({tuple(r) for _, r in cls.REDUCE})
    parts = [f"rank 0 holds {len(held)} parameters ({pieces} split into pieces)",
             f"{len(cls.GROUPS)} process groups", f"gradients of {len(cls.REDUCE)} summed over {groups} group(s)"]
    if getattr(cls, "ZERO", 0):
        parts.append(f"ZeRO-{cls.ZERO}")
    if getattr(cls, "PRECISION", None):
        parts.append(cls.PRECISION)
    return "plan: " + ", ".join(parts) + f"; code in {path.parent}"


@dataclass
class Plan:
    """A compile as a value: what ``world`` ranks run for one policy.

    Attributes:
        graph: the placed graph (the policy's copy of the trace).
        program: every planned rank's program (``cube.passes.program``).
        consts: the lifted constant tensors the graph reads.
        policy: the policy's name (printed in the generated code).
        timings: seconds per phase: ``trace``, ``ir``, ``policy``, ``plan`` (and ``codegen`` once printed).
    """

    graph: IRGraph
    program: Program
    consts: dict
    policy: str
    timings: dict = field(default_factory=dict)

    @property
    def world(self) -> int:
        return self.program.world

    @property
    def lost(self) -> List[lost.LostSplit]:
        """The splits the policy asked for that the plan does not keep (``cube.ir.lost``)."""
        return list(self.graph.lost)

    def sources(self) -> Dict[int, str]:
        """The generated Python module of every rank the plan holds."""
        return emit_all(self.program, self.policy, self.timings)

    def source(self, rank: int) -> str:
        """The generated Python module of rank ``rank``."""
        if rank not in self.program.ranks:
            raise ValueError(f"this plan holds the programs of ranks {sorted(self.program.ranks)}, not {rank}; "
                             f"plan with ranks=None for all of them")
        return emit_all(Program(self.graph, self.world, {rank: self.program[rank]}, self.program.groups),
                        self.policy, self.timings)[rank]


@dataclass
class Traced:
    """A traced model: its IR graph before any policy, never changed (each plan works on a copy).

    Attributes:
        graph: the unplaced graph.
        consts: the lifted constant tensors.
        structure: ``"tensor"`` or ``"tuple"``: how a batch is passed to the model.
        timings: seconds of ``trace`` and ``ir``.
        model, sample, zero, precision, tp_reduce_dtype: what it was traced from (a pipeline plan traces the model
            again on a micro-batch of ``sample``).
    """

    graph: IRGraph
    consts: dict
    structure: str
    timings: dict = field(default_factory=dict)
    model: Optional[torch.nn.Module] = field(default=None, repr=False)
    sample: Optional[tuple] = field(default=None, repr=False)
    zero: int = 0
    precision: Optional[str] = None
    tp_reduce_dtype: Optional[torch.dtype] = None
    _micro: Dict[int, "Traced"] = field(default_factory=dict, repr=False)

    def place(self, PAS: Union[Callable, str], world: int = 1, *, options: Optional[dict] = None,
              zero: Optional[int] = None, timings: Optional[dict] = None,
              nmicros: Optional[int] = None, strict: bool = False) -> IRGraph:
        """The placed graph: the policy run on a copy of the trace for ``world`` ranks (no passes).

        ``zero``: the ZeRO stage of this plan (default: the one traced with).

        ``graph.lost`` lists the splits the policy asked for that the plan does not keep (an op
        run whole on gathered inputs, a linear kept whole, a flow that splits nothing:
        ``cube.ir.lost``); with ``strict`` they are a ``ValueError`` naming each op, its model
        line and the fix.

        A pipeline plan (a schedule of ``nmicros > 1`` micro-batches) takes the global batch this
        was traced on and cuts it into ``nmicros`` micro-batches along dim 0, so its graph must have
        micro-batch shapes: the policy runs first on the global trace (the policy alone decides
        ``nmicros``), then the model is traced again on one micro-batch (``micro(nmicros)``, kept
        for later plans) and the policy runs again on that trace with the same options. Policies
        are deterministic functions of the graph, the world and the options, and a micro-batch is
        the same model at a smaller batch, so the second run must choose the same ``nmicros``
        (checked). The placed graph is the micro-batch's, with ``graph.micro`` saying how a step
        cuts the batch and what each micro-batch's loss is a share of (``cube.passes.micro``).

        Raises:
            ValueError, TypeError: the policy failed or left ops unplaced, or a pipeline plan cannot
                cut the global batch into its micro-batches exactly (the message says how to fix it);
                with ``strict``, the plan does not keep a split the policy asked for.

        ``nmicros``: the micro-batch count the policy will choose, when the caller knows it (the
        simulator, which sets the option): the policy then runs once, on the micro-batch's trace.
        """
        policy = load_policy(PAS)
        timings = {} if timings is None else timings
        if nmicros is not None and nmicros > 1 and self.graph.micro is None:
            graph = self.micro(nmicros, timings)._place(policy, world, options, zero, timings)
            if _nmicros(graph) != nmicros:
                raise ValueError(f"place(nmicros={nmicros}): the policy chose {_nmicros(graph)} micro-batches")
            return _kept(graph, policy, strict)
        graph = self._place(policy, world, options, zero, timings)
        nmicros = _nmicros(graph)
        if nmicros > 1 and self.graph.micro is None:
            micro = self.micro(nmicros, timings)
            try:
                graph = micro._place(policy, world, options, zero, timings)
            except ValueError as e:
                raise ValueError(f"{e}\n(pipeline plan: the global batch of {micro.graph.micro.batch} samples is "
                                 f"cut into {nmicros} micro-batches of {micro.graph.micro.batch // nmicros}; the "
                                 f"policy ran again on one micro-batch. Use a global batch that is a multiple of "
                                 f"nmicros x the data parallel degree.)") from None
            if _nmicros(graph) != nmicros:
                raise ValueError(f"the policy chose {nmicros} micro-batches for the global batch but "
                                 f"{_nmicros(graph)} for its micro-batch of "
                                 f"{micro.graph.micro.batch // nmicros} samples: a pipeline plan's policy must "
                                 f"choose nmicros from its options, not from the batch's shape (pass nmicros=)")
        return _kept(graph, policy, strict)

    def _place(self, policy: Callable, world: int, options: Optional[dict], zero: Optional[int],
               timings: dict) -> IRGraph:
        graph = self.graph.copy()
        if zero is not None:
            graph.zero = zero
        with _phase("policy", timings, add=True):
            graph = apply_policy(policy, graph, Resource(world), options)
            check_graph(graph, placed=True, stage="policy")
        return graph

    def micro(self, nmicros: int, timings: Optional[dict] = None) -> "Traced":
        """The model traced on one of ``nmicros`` equal micro-batches of this trace's batch, its graph
        computing each micro-batch's share of the global loss (``cube.passes.micro``); kept, so
        every plan of this trace with ``nmicros`` micro-batches shares it.

        Raises:
            ValueError: the batch does not cut into ``nmicros`` equal micro-batches along dim 0, or the
                step on micro-batches could not equal the step on the whole batch.
        """
        if nmicros in self._micro:
            return self._micro[nmicros]
        if self.model is None or self.sample is None:
            raise ValueError("a pipeline plan traces the model again on a micro-batch: plan it from "
                             "cube.trace_model(model, batch) (or cube.plan / cube.compile), which keep both")
        sizes = {tuple(t.shape[:1]) for t in self.sample}
        batch = self.sample[0].shape[0] if self.sample[0].ndim else 0
        if len(sizes) != 1 or batch == 0:
            raise ValueError(f"a pipeline plan cuts every tensor of the batch along dim 0 into micro-batches, but "
                             f"the batch's tensors have shapes {[list(t.shape) for t in self.sample]}: give every "
                             f"batch tensor the batch size as its first dim, or plan with nmicros=1")
        if batch % nmicros:
            raise ValueError(f"the global batch of {batch} samples does not cut into nmicros={nmicros} equal "
                             f"micro-batches: make the dataloader's batch size a multiple of {nmicros} (times the "
                             f"data parallel degree), or pass an nmicros that divides {batch}")
        # the first micro-batch: only its shapes and dtypes matter to the trace. A micro-batch of one
        # sample is traced with a dynamic batch dim (torch.export would take every op's size-1 path),
        # and so is the global batch it is compared with, op for op
        one = batch // nmicros == 1
        first = tuple(t[:batch // nmicros] for t in self.sample)
        try:
            micro = trace_model(self.model, first, zero=self.zero, precision=self.precision,
                                tp_reduce_dtype=self.tp_reduce_dtype, structure=self.structure, dynamic_batch=one)
            full = trace_model(self.model, self.sample, zero=self.zero, precision=self.precision,
                               tp_reduce_dtype=self.tp_reduce_dtype,
                               structure=self.structure, dynamic_batch=True) if one else self
        except TraceError as e:
            if not one:   # the global batch traced: what fails is the micro-batch's size
                raise TraceError(f"pipeline plan: the model traces on the global batch of {batch} samples but not "
                                 f"on a micro-batch of {batch // nmicros} (batch norm, say, refuses one sample per "
                                 f"channel in training). Use micro-batches of more samples, or plan the pipeline "
                                 f"with nmicros=1.\n{e}") from e
            # a model that fixes its batch size while tracing (flex_attention does): the one-sample trace is
            # static, a faithful program for a micro-batch of one sample; micro_shares still checks it op for
            # op against the global batch's
            micro = trace_model(self.model, first, zero=self.zero, precision=self.precision,
                                tp_reduce_dtype=self.tp_reduce_dtype, structure=self.structure)
            full, one = self, False
        if timings is not None:   # the other traces count in the compile's trace and ir phases
            for k, v in micro.timings.items():
                timings[k] = timings.get(k, 0.0) + v
            if one:
                for k, v in full.timings.items():
                    timings[k] = timings.get(k, 0.0) + v
        micro_shares(full.graph, micro.graph, nmicros, batch)
        mark_draws(micro.graph, full.graph, nmicros)   # a micro-batch draws its rows of the global batch's masks
        self._micro[nmicros] = micro
        return micro

    def plan(self, PAS: Union[Callable, str], world: int = 1, *, options: Optional[dict] = None,
             zero: Optional[int] = None, ranks: Optional[Sequence[int]] = None, strict: bool = False,
             exact_rng: bool = False) -> Plan:
        """Runs the policy on a copy of the graph for ``world`` ranks, then the passes.

        Args:
            PAS: the policy (a callable, ``"file.py:Name"``, ``"module:Name"`` or a shipped name).
            world: the number of ranks.
            options: keyword options for the policy (``tp``, ``pp``, ``nmicros``, ...).
            zero: the ZeRO stage of this plan (default: the one traced with).
            ranks: the ranks whose programs to lay out (default all; every rank is planned).
            strict: a split the policy asked for that the plan cannot keep is an error (see
                ``place``); without it ``Plan.lost`` lists them.
            exact_rng: random ops draw exactly the single device's numbers (``cube.runtime.rng``);
                without it replicas share a mask and pieces draw independent ones.

        Raises:
            ValueError, TypeError: the policy's plan cannot run (the message says why and how to fix it);
                with ``exact_rng``, a random op whose draws cube cannot reproduce.
        """
        policy = load_policy(PAS)
        timings = dict(self.timings)
        graph = self.place(policy, world, options=options, zero=zero, timings=timings, strict=strict)
        graph.exact_rng = bool(exact_rng)
        if exact_rng:
            check_exact(graph)
        with _phase("plan", timings):
            program = build_program(graph, world, ranks)
        return Plan(graph, program, self.consts_of(graph), policy_name(policy), timings)

    def consts_of(self, graph: IRGraph) -> dict:
        """The constants a placed copy of the graph (or of its micro-batch trace) reads."""
        micro = graph.micro
        consts = self._micro[micro.nmicros].consts if micro is not None and micro.nmicros in self._micro \
            else self.consts
        used = {n for t in graph.attrs if t.kind.value == "const" for n in t.names}
        return {k: v for k, v in consts.items() if k in used}


def _kept(graph: IRGraph, policy: Callable, strict: bool) -> IRGraph:
    """``graph`` with its lost splits counted per step (a pipeline step runs its graph once per
    micro-batch).

    Raises:
        ValueError: ``strict`` and the policy asked for splits the plan does not keep.
    """
    graph.lost = lost.per_step(graph.lost, _nmicros(graph))
    if strict and graph.lost:
        raise lost.error(graph.lost, _policy_label(policy))
    return graph


def _policy_label(policy: Callable) -> str:
    """The policy's name (a ``functools.partial``'s function's)."""
    return policy_name(getattr(policy, "func", policy))


def _warn_lost(records: Sequence[lost.LostSplit], policy: str) -> None:
    """One warning on the ``cube`` logger per split the plan does not keep."""
    for line in lost.lines(records, policy):
        log.warning("cube: %s", line)


def _nmicros(graph: IRGraph) -> int:
    """The micro-batches a step of a placed graph cuts its batch into (1 without a schedule)."""
    return graph.schedule.nmicros if graph.schedule is not None else 1


def trace_model(model: torch.nn.Module, batch, *, zero: int = 0, precision: Optional[str] = None,
                tp_reduce_dtype: Optional[torch.dtype] = None,
                timings: Optional[dict] = None, structure: Optional[str] = None,
                dynamic_batch: bool = False) -> Traced:
    """Traces ``model`` on one batch into an IR graph (no policy yet).

    Args:
        model: the single-device module (it may live on the meta device).
        batch: a tensor or a tuple/list of tensors, as the dataloader yields it (or, with
            ``structure``, the tuple of its tensors).
        zero: the ZeRO stage the plan is for (3 shards parameters in the plan).
        precision: None or one of ``cube.runtime.amp.PRECISIONS`` (``"bf16"``, ``"bf16-autocast"``, ...).
        tp_reduce_dtype: as ``cube.compile``'s.
        timings: a dict that also gets the seconds of ``trace`` and ``ir``.
        structure: how ``batch`` is passed when it is already a tuple of tensors.
        dynamic_batch: trace dim 0 of the batch as a size of any value (``cube.trace.export.export``),
            so a batch of one sample runs the ops of any batch size; the graph's sizes are this batch's.
    """
    if structure is None:
        structure, sample = batch_structure(batch)
    else:
        sample = tuple(batch)
    timings = {} if timings is None else timings
    with _phase("trace", timings):
        ep = export(model, sample, dynamic_batch=dynamic_batch)
        if rt_amp.main_params(precision):   # the casts to a value's own dtype: to the weights' (cube.trace.casts)
            low_casts(model, sample, ep, rt_amp.DTYPES[precision], dynamic_batch=dynamic_batch)
    with _phase("ir", timings):
        graph, consts = build_graph(ep, model, structure)
        graph.zero = zero
        graph.precision = precision
        graph.tp_reduce_dtype = tp_reduce_dtype
        mark_draws(graph, program=ep.graph_module)   # the random ops, in the single device's order (cube.passes.rng)
        check_graph(graph, stage="ir")
    return Traced(graph, consts, structure, timings, model=model, sample=sample, zero=zero, precision=precision,
                  tp_reduce_dtype=tp_reduce_dtype)


def plan(model: torch.nn.Module, batch, PAS: Union[Callable, str], world: int = 1, *,
         options: Optional[dict] = None, zero: int = 0, precision: Optional[str] = None,
         ranks: Optional[Sequence[int]] = None, strict: bool = False, exact_rng: bool = False,
         tp_reduce_dtype: Optional[torch.dtype] = None) -> Plan:
    """Compiles ``model`` for ``world`` ranks in this process, as a value: trace, policy, passes.

    Nothing is launched, read or written (no process group, no cache); ``Plan.sources()``
    gives every rank's generated code. ``cube.trace_model(...).plan(...)`` does the same in
    two steps, so one trace serves many plans (without logging).

    Each split the policy asked for that the plan does not keep is logged as a warning on the
    ``cube`` logger (``Plan.lost`` lists them); with ``strict`` they are a ``ValueError``.
    ``exact_rng``: as ``cube.compile``'s.
    """
    rt_amp.check_tp_reduce_dtype(tp_reduce_dtype, precision, "cube.plan")
    traced = trace_model(model, batch, zero=zero, precision=precision, tp_reduce_dtype=tp_reduce_dtype)
    planned = traced.plan(PAS, world, options=options, ranks=ranks, strict=strict, exact_rng=exact_rng)
    _warn_lost(planned.lost, _policy_label(PAS) if callable(PAS) else planned.policy)
    return planned


def trace_and_plan(model: torch.nn.Module, sample: tuple, structure: str, policy: Callable,
                   world_size: int, timings: Optional[dict] = None, zero: int = 0,
                   precision: Optional[str] = None, options: Optional[dict] = None):
    """``(graph, consts)``: the placed graph of ``policy`` and the constants it reads (see ``plan``)."""
    timings = {} if timings is None else timings
    traced = trace_model(model, sample, zero=zero, precision=precision, structure=structure, timings=timings)
    graph = traced.place(policy, world_size, options=options, timings=timings)
    return graph, traced.consts_of(graph)


def generate_code(model: torch.nn.Module, batch, PAS: Union[Callable, str], world_size: int = 1,
                  zero: int = 0, precision: Optional[str] = None, timings: Optional[dict] = None,
                  options: Optional[dict] = None, exact_rng: bool = False) -> dict:
    """Every rank's generated source for a plan, in this process (no launch, no cache): a dry run.

    Args:
        timings: a dict that gets the seconds of each compile phase (``trace``,
            ``ir``, ``policy``, ``plan``, ``codegen``); the phases are also logged
            at INFO on the ``cube`` logger.

    Returns:
        ``{rank: source}`` for ranks ``0..world_size-1``.
    """
    with _gc_paused():
        planned = plan(model, batch, PAS, world_size, options=options, zero=zero, precision=precision,
                       exact_rng=exact_rng)
        sources = planned.sources()
    if timings is not None:
        timings.update(planned.timings)
    log.info("cube: dry run of %s for %s (world %d): %s", planned.policy, type(model).__name__,
             world_size, _format_phases(planned.timings))
    return sources


def generate_all(graph: IRGraph, world: int, policy: str, ranks: Optional[Sequence[int]] = None,
                 timings: Optional[dict] = None) -> Dict[int, str]:
    """Python source of each rank's module of a placed ``graph`` (``ranks``: which; default all).

    ``timings`` gets the seconds of ``plan`` (every rank's plan) and ``codegen``.

    Raises:
        ValueError: the placement cannot run (see ``cube.passes.program.build_program``).
    """
    timings = {} if timings is None else timings
    with _phase("plan", timings):
        program = build_program(graph, world, ranks)
    return emit_all(program, policy, timings)


def generate(graph: IRGraph, rank: int, world: int, policy: str, timings: Optional[dict] = None) -> str:
    """Python source of rank ``rank``'s module of a placed ``graph`` (see ``generate_all``)."""
    return generate_all(graph, world, policy, [rank], timings)[rank]


def explain(model: torch.nn.Module, batch, PAS: Union[Callable, str], world_size: int, folder, zero: int = 0,
            precision: Optional[str] = None, options: Optional[dict] = None, strict: bool = False,
            exact_rng: bool = False) -> list:
    """Plans ``model`` for ``world_size`` ranks in this process and writes the report into ``folder``.

    Nothing is launched: this traces, applies the policy and plans every rank,
    as ``cube.compile`` would, then writes ``plan.txt``, ``placement.svg`` and
    (for pipeline plans) ``schedule.svg`` (``cube.codegen.report``). ``plan.txt``
    lists the splits the policy asked for that the plan does not keep; with
    ``strict`` they are a ``ValueError`` instead, and nothing is written.

    Returns:
        The paths written.
    """
    planned = plan(model, batch, PAS, world_size, options=options, zero=zero, precision=precision, strict=strict,
                   exact_rng=exact_rng)
    return write_report(planned.program, folder)


def _format_phases(timings: dict) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()) + f"; total {sum(timings.values()):.2f}s"


def _load_source(path: Path, name: str):
    # the flex_attention ops generated code may call are defined when a model is traced: a program loaded
    # from the cache in a fresh process is not (a model's autograd.Functions define their own, on load)
    flex.op()
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile(model: torch.nn.Module, dataloader, PAS: Union[Callable, str], *,
            cache_dir: Optional[Union[str, os.PathLike]] = None, use_cache: bool = True,
            zero: int = 0, precision: Optional[str] = None, options: Optional[dict] = None,
            backend: Optional[str] = None, strict: bool = False, exact_rng: bool = False,
            max_shapes: int = 1, tp_reduce_dtype: Optional[torch.dtype] = None) -> Callable:
    """Compiles a training step for ``model``: decorate ``train_iter(model, dataloader)``.

    The step must take one batch with ``next(dataloader)``, compute
    ``loss = model(*batch)`` (``model(batch)`` for a tensor batch), call
    ``loss.backward()`` and return the loss; cube generates exactly that per rank.

    Args:
        model: the single-device ``nn.Module``; its forward returns a scalar loss.
        dataloader: an iterator of global batches; its first batch is read to
            trace and handed back to the first call of the step.
        PAS: the policy: a callable, ``"path/to/file.py:Name"`` or ``"module:Name"``.
        cache_dir: where generated code lives (default ``CUBE_CACHE_DIR`` or ~/.cache/cube).
        use_cache: reuse generated code of an identical earlier compile.
        zero: the ZeRO stage, said once: ``cube.build_optimizer(model, ...)`` follows
            it. 3 makes a ZeRO-3 plan: parameters summed over a data parallel
            group are sharded over it and gathered in forward; 1 (optimizer state)
            and 2 (and gradients) shard only what the optimizer holds.
        precision: None (float32); ``"bf16"`` or ``"fp16"``: Megatron-LM's recipe, low-precision
            weights for compute, float32 main parameters, optimizer state and gradient
            accumulation in ``cube.build_optimizer`` (a plain optimizer over
            ``model.parameters()`` steps the float32 parameters as autocast does);
            ``"bf16-autocast"`` / ``"fp16-autocast"``: float32 parameters and optimizer state,
            matrix products cast to the low precision by ``torch.autocast`` (losses, norms,
            softmax in float32). The first runs the forward in the weights' dtype, losses in
            float32 (``cube.passes.precision``); fp16 adds a dynamic loss
            scale (build the optimizer with ``cube.build_optimizer`` so overflowed steps are
            skipped). ``"fp8"``: ``"bf16"`` with the linear layers' three matrix products in
            float8, dynamic tensorwise scales (torchao's float8 training; ``cube.passes.float8``);
            refused on a CUDA GPU older than compute capability 8.9, emulated on the CPU.
        options: keyword options for the policy (``{"tp": 2, "nmicros": 8}``): the
            shipped policies take ``tp``, ``pp``, ``nmicros``, ``nvirtual``,
            ``recompute`` (see each policy); they are part of the code cache key.
        backend: None (default: eager) or a ``torch.compile`` backend name
            (``"inductor"``, ``"aot_eager"``, ...; ``torch._dynamo.list_backends()``):
            ``cube.load_model()`` compiles the generated forward (each pipeline
            stage's method) with it, forward and backward, while every collective,
            send, receive and ZeRO-3 wait stays eager between the compiled pieces
            (``cube.runtime.compiled``). The generated code and its cache entry are
            the same as without it. Meant for GPUs; on a CPU it gains little.
        strict: a split the policy asked for that the plan cannot keep (an op run whole on
            gathered inputs, a linear kept whole, a flow that splits nothing, e.g.
            ``PASMegatronTP`` on a model without linear pairs) is a ``ValueError`` naming each
            op, its model line and the fix (``cube.register_op``, or another policy), also
            when the code comes from the cache. Without it, rank 0 logs one warning per such
            op on the ``cube`` logger (``cube.ir.lost``).
        exact_rng: every plan draws exactly the random numbers (dropout masks, Gumbel noise...) the single
            device draws from the default generator, which the step then leaves where the
            plain model leaves it; random ops cube cannot reproduce are a ``ValueError``
            (CPU, float32). Without it, as Megatron-LM's RNG tracker: replicas of a tensor
            share a mask, pieces of a split tensor and data-parallel ranks draw independent
            ones (``cube.runtime.rng`` has the seed derivation).

        tp_reduce_dtype: under ``"bf16"``/``"fp16"``/``"fp8"``, ``torch.float32`` makes every
            partial product of tensor parallelism (a matrix product whose reduction is split over
            ranks) leave its kernel in float32, be summed over the ranks in float32 and be
            rounded to the low precision once, where it is read, as one process rounds the whole
            product (twice the bytes of those sums). None (default): summed in the low precision,
            as Megatron-LM does (docs/precision.md).
        max_shapes: how many batch shapes the step takes (default 1: every batch has the first
            batch's shapes). A batch of new shapes (the short last batch of an epoch, another
            padded length) compiles another plan at that step, cached like the first, sharing the
            model's parameters, up to ``max_shapes`` plans; then a ``ValueError``. Every rank must
            read the same global batches (each rank's step reads every batch to learn its shape).
            Pad to a few lengths (bucketing) to keep the plans few.

    Returns:
        A decorator turning the step into a ``CompiledStep``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cube.compile: model must be a torch.nn.Module, got {type(model).__name__}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"cube.compile: zero must be 0, 1, 2 or 3, got {zero!r}")
    rt_amp.check_precision(precision)
    rt_amp.check_tp_reduce_dtype(tp_reduce_dtype, precision)
    rt_compiled.check_backend(backend)
    if isinstance(max_shapes, bool) or not isinstance(max_shapes, int) or max_shapes < 1:
        raise ValueError(f"cube.compile: max_shapes must be a positive integer, got {max_shapes!r}")

    def decorator(fn: Callable) -> CompiledStep:
        step = CompiledStep(fn, model, dataloader, PAS, cache_dir=cache_dir, use_cache=use_cache, zero=zero,
                            precision=precision, options=options, backend=backend, strict=strict,
                            exact_rng=exact_rng, max_shapes=max_shapes, tp_reduce_dtype=tp_reduce_dtype)
        rt_session.register(step)
        return step

    return decorator


def load_model(step: Optional[CompiledStep] = None, *, init: Optional[Callable] = None,
               weights: Optional[Union[str, os.PathLike]] = None, rename: Optional[Callable] = None,
               strict: bool = True) -> torch.nn.Module:
    """This rank's generated module for ``step`` (default: the latest compile), holding only its pieces.

    Without ``init`` and ``weights`` the pieces are copied from the compiled
    model's current values. For a model built on the meta device (or to replace
    its values) see ``cube.runtime.materialize``: no rank ever holds more than
    one module of the full model at a time, and every rank raises the same error.

    Args:
        step: a compiled step (default: the latest ``cube.compile``).
        init: called on every module in ``model.apply`` order after its own
            parameters and buffers are made at full size on CPU; the result
            equals ``model.to_empty(device="cpu"); model.apply(init)`` on one
            device from the same random state. It may touch only the module's own
            tensors. Without it, meta tensors of modules with ``reset_parameters()``
            are initialized by that.
        weights: a safetensors file, a directory of sharded safetensors with its
            ``*.index.json`` (Hugging Face layout), a ``torch.save``d state dict or
            a cube checkpoint directory; names are the compiled model's
            ``state_dict()`` names. Tensors it lacks (non-persistent buffers) come
            from ``init``, which then runs only on modules holding such tensors.
        rename: maps a name in the weights file to the model's name (None skips it).
        strict: False allows tensors missing from or unexpected in the file.

    Raises:
        ValueError: missing, unexpected or mis-shaped tensors in ``weights``; a meta
            tensor nothing gives a value; ``init`` touched another module's tensors.
    """
    if step is None:
        step = rt_session.latest()
        if step is None:
            raise ValueError("cube.load_model(): nothing was compiled yet; decorate the training step "
                             "with @cube.compile(model, dataloader, PAS=...) first")
    return step.load_model(init=init, weights=weights, rename=rename, strict=strict)
