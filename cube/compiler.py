"""``cube.compile``: drives trace -> policy -> codegen -> load, with a code cache."""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch

from cube import config
from cube.codegen import generate, generate_all
from cube.passes import check_graph
from cube.policy import Resource, apply_policy, load_policy, policy_name, policy_source
from cube.runtime import device as rt_device
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
                 use_cache: bool = True):
        self.fn = fn
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
        if self.env.rank == 0:
            phases = ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items())
            log.info("cube: %s plan %s for %s (world %d): %s", "reused" if self.cache_hit else "compiled",
                     self.key[:12], type(model).__name__, self.env.world_size, phases)

    def _key(self, sample) -> str:
        h = hashlib.sha256()
        user_rules = sorted(f"{k}={v if isinstance(v, str) else policy_source(v)}"
                            for k, v in REGISTRY.rules.items() if k not in REGISTRY.builtin)
        for part in (VERSION, torch.__version__, _model_fingerprint(self.user_model),
                     policy_source(self.policy), self.structure,
                     repr([(tuple(t.shape), t.dtype) for t in sample]),
                     str(self.env.world_size), "\n".join(user_rules)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:32]

    def _compile(self, sample) -> None:
        graph, consts = trace_and_plan(self.user_model, sample, self.structure, self.policy,
                                       self.env.world_size, self.timings)
        with _phase("codegen", self.timings):
            source = generate(graph, self.env.rank, self.env.world_size, policy_name(self.policy))
        self.graph = graph
        self.consts = consts
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.consts:
            _atomic_write(self.consts_path, lambda f: torch.save(self.consts, f))
        _atomic_write(self.path, lambda f: f.write(source.encode()))

    # ------------------------------------------------------------------ public
    def load_model(self) -> torch.nn.Module:
        """This rank's generated module, holding its pieces of the model's current values."""
        model = self.module.GenModel(self.env.device)
        model.load_from(self.user_model, self.consts)
        return model

    def __call__(self, model, dataloader):
        if not isinstance(model, self.module.GenModel):
            raise TypeError(f"the compiled step takes the module from cube.load_model(), got "
                            f"{type(model).__name__}: call `model = cube.load_model()` after compiling "
                            f"and pass that model to the step")
        return self.module.train_step(model, self.batches.take(dataloader))

    @property
    def source(self) -> str:
        return self.path.read_text()


def trace_and_plan(model: torch.nn.Module, sample: tuple, structure: str, policy: Callable,
                   world_size: int, timings: Optional[dict] = None):
    """Traces ``model(*sample)``, builds the IR and applies the policy.

    Returns:
        ``(graph, consts)``: the planned graph and the lifted constant tensors it uses.
    """
    timings = {} if timings is None else timings
    with _phase("trace", timings):
        ep = export(model, sample)
    with _phase("ir", timings):
        graph, consts = build_graph(ep, model, structure)
        check_graph(graph)
    with _phase("policy", timings):
        graph = apply_policy(policy, graph, Resource(world_size))
        check_graph(graph, placed=True)
    used = {n for t in graph.attrs if t.kind.value == "const" for n in t.names}
    return graph, {k: v for k, v in consts.items() if k in used}


def generate_code(model: torch.nn.Module, batch, PAS: Union[Callable, str], world_size: int = 1) -> dict:
    """Every rank's generated source for a plan, in this process (no launch, no cache).

    Returns:
        ``{rank: source}`` for ranks ``0..world_size-1``.
    """
    structure, sample = _structure(batch)
    policy = load_policy(PAS)
    graph, _ = trace_and_plan(model, sample, structure, policy, world_size)
    return generate_all(graph, world_size, policy_name(policy))


def _atomic_write(path: Path, write) -> None:
    """Writes via a temporary file and a rename, so readers never see half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _load_source(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile(model: torch.nn.Module, dataloader, PAS: Union[Callable, str], *,
            cache_dir: Optional[Union[str, os.PathLike]] = None, use_cache: bool = True) -> Callable:
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

    Returns:
        A decorator turning the step into a ``CompiledStep``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cube.compile: model must be a torch.nn.Module, got {type(model).__name__}")

    def decorator(fn: Callable) -> CompiledStep:
        step = CompiledStep(fn, model, dataloader, PAS, cache_dir=cache_dir, use_cache=use_cache)
        _last_step[:] = [step]
        return step

    return decorator


def load_model(step: Optional[CompiledStep] = None) -> torch.nn.Module:
    """This rank's generated module for ``step`` (default: the latest compile)."""
    if step is None:
        if not _last_step:
            raise ValueError("cube.load_model(): nothing was compiled yet; decorate the training step "
                             "with @cube.compile(model, dataloader, PAS=...) first")
        step = _last_step[0]
    return step.load_model()
