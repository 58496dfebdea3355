"""``cube.compile``: drives trace -> policy -> codegen -> load, with a code cache."""
from __future__ import annotations

import gc
import hashlib
import importlib.util
import inspect
import logging
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch

from cube import config
from cube.codegen import generate, generate_all
from cube.passes import check_graph
from cube.policy import Resource, apply_policy, load_policy, policy_name, policy_source
from cube.runtime import data as rt_data
from cube.runtime import device as rt_device
from cube.runtime import materialize
from cube.runtime import profile as rt_profile
from cube.runtime.utils import atomic_write
from cube.trace import build_graph, export
from cube.trace.rules import REGISTRY

log = logging.getLogger("cube")

from cube.version import __version__ as VERSION
_last_step: list = []   # the most recent compile, for cube.load_model() without arguments


@contextmanager
def _phase(name: str, timings: dict):
    start = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - start


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


def _structure(batch):
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
    return "\n".join(parts)


class CompiledStep:
    """A compiled training step: call it as ``step(model, dataloader)``.

    Attributes:
        key: the cache key of this plan.
        path: this rank's generated source file.
        timings: seconds per compile phase.
        graph: the IR after the policy (None when the code came from the cache).
    """

    def __init__(self, fn: Callable, model: torch.nn.Module, dataloader, pas, cache_dir=None,
                 use_cache: bool = True, zero: int = 0, precision: Optional[str] = None):
        self.fn = fn
        self.steps_run = 0
        self.zero = zero
        self.precision = precision
        self.user_model = model
        self.timings: dict = {}
        self.env = rt_device.init()
        self.batches = _Batches(dataloader)
        self.structure, sample = _structure(self.batches.first)
        self.policy = load_policy(pas)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else config.cache_dir()
        self.key = self._key(sample)
        folder = self.cache_dir / self.key
        self.path = folder / f"rank{self.env.rank}.py"
        self.consts_path = folder / f"rank{self.env.rank}.consts.pt"
        self.graph = None
        self.consts = {}
        if use_cache and self.path.exists():
            self.cache_hit = True
            if self.consts_path.exists():
                self.consts = torch.load(self.consts_path)
        else:
            self.cache_hit = False
            self._compile(sample)
        with _phase("load", self.timings):
            self.module = _load_source(self.path, f"cube_gen_{self.key[:16]}_rank{self.env.rank}")
        self.part = rt_data.read_part(self.path)
        # a rank whose ops read no batch tensor takes no batches after compile's first read
        self._placeholders = None if self.part.reads else rt_data.Placeholders(sample, self.structure)
        if self.env.rank == 0:
            log.info("cube: %s plan %s for %s (world %d): %s", "reused" if self.cache_hit else "compiled",
                     self.key[:12], type(model).__name__, self.env.world_size, _format_phases(self.timings))
            log.info("cube: %s", _plan_summary(self.module.GenModel, self.path))

    def _key(self, sample) -> str:
        h = hashlib.sha256()
        user_rules = sorted(f"{k}={v if isinstance(v, str) else policy_source(v)}"
                            for k, v in REGISTRY.rules.items() if k not in REGISTRY.builtin)
        for part in (VERSION, torch.__version__, _model_fingerprint(self.user_model),
                     policy_source(self.policy), self.structure,
                     repr([(tuple(t.shape), t.dtype) for t in sample]),
                     str(self.env.world_size), "\n".join(user_rules), f"zero={self.zero}",
                     f"precision={self.precision}"):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def _compile(self, sample) -> None:
        with _gc_paused():
            graph, consts = trace_and_plan(self.user_model, sample, self.structure, self.policy,
                                           self.env.world_size, self.timings, zero=self.zero,
                                           precision=self.precision)
            source = generate(graph, self.env.rank, self.env.world_size, policy_name(self.policy),
                              timings=self.timings)
        self.graph = graph
        self.consts = consts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.consts:
            atomic_write(self.consts_path, lambda f: torch.save(self.consts, f))
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
        return model

    def __call__(self, model, dataloader):
        if not isinstance(model, self.module.GenModel):
            raise TypeError(f"the compiled step takes the module from cube.load_model(), got "
                            f"{type(model).__name__}: call `model = cube.load_model()` after compiling "
                            f"and pass that model to the step")
        step, self.steps_run = self.steps_run, self.steps_run + 1
        if self._placeholders is not None:
            self.batches.pending = False   # compile's batch is not needed on this rank either
            batches = self._placeholders
        else:
            batches = self.batches.take(dataloader)
        with rt_profile.record(self.env.rank, step):   # CUBE_PROFILE: a trace file of this step
            return self.module.train_step(model, batches)

    @property
    def source(self) -> str:
        return self.path.read_text()


def _holds_meta(model: torch.nn.Module) -> bool:
    return any(t.device.type == "meta" for t in list(model.parameters()) + list(model.buffers()))


def _plan_summary(cls, path: Path) -> str:
    """One line on what rank 0 holds and does (from its generated module's tables)."""
    pieces = sum(1 for _, splits in cls.PARAMS.values() if splits)
    groups = len({tuple(r) for _, r in cls.REDUCE})
    parts = [f"rank 0 holds {len(cls.PARAMS)} parameters ({pieces} split into pieces)",
             f"{len(cls.GROUPS)} process groups", f"gradients of {len(cls.REDUCE)} summed over {groups} group(s)"]
    if getattr(cls, "ZERO", 0):
        parts.append(f"ZeRO-{cls.ZERO}")
    if getattr(cls, "PRECISION", None):
        parts.append(cls.PRECISION)
    return "plan: " + ", ".join(parts) + f"; code in {path.parent}"


def trace_and_plan(model: torch.nn.Module, sample: tuple, structure: str, policy: Callable,
                   world_size: int, timings: Optional[dict] = None, zero: int = 0,
                   precision: Optional[str] = None):
    """Traces ``model(*sample)``, builds the IR and applies the policy (``zero``: the ZeRO stage,
    ``precision``: None, "bf16" or "fp16").

    Returns:
        ``(graph, consts)``: the planned graph and the lifted constant tensors it uses.
    """
    timings = {} if timings is None else timings
    with _phase("trace", timings):
        ep = export(model, sample)
    with _phase("ir", timings):
        graph, consts = build_graph(ep, model, structure)
        graph.zero = zero
        graph.precision = precision
        check_graph(graph)
    with _phase("policy", timings):
        graph = apply_policy(policy, graph, Resource(world_size))
        check_graph(graph, placed=True)
    used = {n for t in graph.attrs if t.kind.value == "const" for n in t.names}
    return graph, {k: v for k, v in consts.items() if k in used}


def generate_code(model: torch.nn.Module, batch, PAS: Union[Callable, str], world_size: int = 1,
                  zero: int = 0, precision: Optional[str] = None, timings: Optional[dict] = None) -> dict:
    """Every rank's generated source for a plan, in this process (no launch, no cache): a dry run.

    Args:
        timings: a dict that gets the seconds of each compile phase (``trace``,
            ``ir``, ``policy``, ``plan``, ``codegen``); the phases are also logged
            at INFO on the ``cube`` logger.

    Returns:
        ``{rank: source}`` for ranks ``0..world_size-1``.
    """
    timings = {} if timings is None else timings
    structure, sample = _structure(batch)
    policy = load_policy(PAS)
    with _gc_paused():
        graph, _ = trace_and_plan(model, sample, structure, policy, world_size, timings, zero=zero,
                                  precision=precision)
        sources = generate_all(graph, world_size, policy_name(policy), timings=timings)
    log.info("cube: dry run of %s for %s (world %d): %s", policy_name(policy), type(model).__name__,
             world_size, _format_phases(timings))
    return sources


def _format_phases(timings: dict) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()) + f"; total {sum(timings.values()):.2f}s"


def _load_source(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile(model: torch.nn.Module, dataloader, PAS: Union[Callable, str], *,
            cache_dir: Optional[Union[str, os.PathLike]] = None, use_cache: bool = True,
            zero: int = 0, precision: Optional[str] = None) -> Callable:
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
        precision: None (float32), ``"bf16"`` or ``"fp16"``: the forward runs under
            ``torch.autocast`` over float32 parameters and optimizer state; fp16
            adds a dynamic loss scale (build the optimizer with
            ``cube.build_optimizer`` so overflowed steps are skipped).

    Returns:
        A decorator turning the step into a ``CompiledStep``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cube.compile: model must be a torch.nn.Module, got {type(model).__name__}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"cube.compile: zero must be 0, 1, 2 or 3, got {zero!r}")
    if precision not in (None, "bf16", "fp16"):
        raise ValueError(f"cube.compile: precision must be None, 'bf16' or 'fp16', got {precision!r}")

    def decorator(fn: Callable) -> CompiledStep:
        step = CompiledStep(fn, model, dataloader, PAS, cache_dir=cache_dir, use_cache=use_cache, zero=zero,
                            precision=precision)
        _last_step[:] = [step]
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
        if not _last_step:
            raise ValueError("cube.load_model(): nothing was compiled yet; decorate the training step "
                             "with @cube.compile(model, dataloader, PAS=...) first")
        step = _last_step[0]
    return step.load_model(init=init, weights=weights, rename=rename, strict=strict)
