"""``torch.compile`` over a generated module: computation compiled, communication left eager.

``cube.compile(..., backend="inductor")`` runs each rank's generated compute
through ``torch.compile`` (:func:`compile_module`): the forward, or on a rank
holding pipeline stages each ``stage_<k>`` method. The runtime calls that talk
to other ranks, wait for them or read state kept between calls (collectives,
sends and receives, stashes, ZeRO-3 waits, the fp16 loss scale, profiling
regions) carry :func:`outside_graph`. Before the first compiled call,
:func:`fence` swaps each of them for ``torch.compiler.disable`` of itself, so
dynamo breaks the graph at every such call and compiles each stretch of
computation between two of them. AOTAutograd compiles each stretch's backward
too, while the communication's autograd functions stay nodes of their own
between the compiled ones: backward's communication is eager as well, in the
same order as without a backend, so every rank still meets every collective.

Why the swap happens on first use rather than at import: ``torch.compiler.disable``
imports ``torch._dynamo``, more than a second per process, which a run without a
backend never needs. A disabled function does exactly what the original does when
nothing is being compiled, so the swap changes nothing for the eager steps of other
compiles in the same process.
"""
from __future__ import annotations

import importlib
import re
import threading
from typing import Callable, List, Optional, Tuple

import torch

_MARKED: List[Tuple[str, str]] = []   # (module, qualified name) of every entry point kept out of graphs
_fenced = False
_lock = threading.Lock()
_STAGE = re.compile(r"stage_\d+")
# cube.passes.recompute names them (_recompute_<group>[_<part>]), cube.passes.program adds _s<stage>
_RECOMPUTE = re.compile(r"_recompute_\d+(_\d+)?(_s\d+)?")


def outside_graph(fn: Callable) -> Callable:
    """Marks ``fn``, called by generated code, as one ``torch.compile`` must never trace.

    For functions that communicate, wait for other ranks or read runtime state that
    changes between calls (a traced read would be baked into the graph as a
    constant). ``fn`` itself is returned unchanged: :func:`fence` disables it once
    a compiled module is about to run.
    """
    _MARKED.append((fn.__module__, fn.__qualname__))
    return fn


def marked() -> List[str]:
    """The dotted names of the entry points kept out of compiled graphs."""
    return [f"{module}.{name}" for module, name in _MARKED]


def fence() -> None:
    """Replaces every :func:`outside_graph` entry point by ``torch.compiler.disable`` of it (once)."""
    global _fenced
    with _lock:
        if _fenced:
            return
        disable = _disable()
        for module, qualname in _MARKED:
            owner = importlib.import_module(module)
            *path, name = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, disable(vars(owner)[name]))
        _fenced = True


def _disable() -> Callable:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "disable"):
        return compiler.disable
    import torch._dynamo as dynamo   # older torch: the same function, under dynamo's name
    return dynamo.disable


def backends() -> List[str]:
    """The names ``torch.compile(backend=)`` accepts in this installation."""
    import torch._dynamo as dynamo
    return sorted(dynamo.list_backends(exclude_tags=()))


def check_backend(backend: Optional[str], where: str = "cube.compile") -> None:
    """Checks a ``backend=`` option: None (eager) or a registered ``torch.compile`` backend name.

    Raises:
        TypeError: ``backend`` is neither a string nor None.
        ValueError: no ``torch.compile`` backend has that name (the message lists those that do).
    """
    if backend is None:
        return
    if not isinstance(backend, str):
        raise TypeError(f"{where}: backend must be None (eager) or the name of a torch.compile backend "
                        f"such as 'inductor', got {type(backend).__name__}")
    valid = backends()
    if backend not in valid:
        raise ValueError(f"{where}: backend {backend!r} is not a torch.compile backend; valid names: "
                         f"{', '.join(valid)} (or None: no torch.compile)")


def compute_methods(cls) -> List[str]:
    """The methods of a generated module class holding its computation.

    Each pipeline stage's (``stage_<k>``) when it has stages, else ``forward``; and
    each recompute run's (``_recompute_<g>``). A staged module's ``forward`` only
    picks the stage's method: compiling the methods themselves gives each stage its
    own graphs instead of one ``forward`` recompiled per stage number. A recompute
    run without communication is traced from inside its caller (the same graphs as
    when it is not compiled on its own); one that communicates (tensor parallel
    blocks) cannot be, so ``torch.utils.checkpoint`` runs it eagerly and its own
    compiled method gives the computation between its collectives graphs. The
    caller's code after such a run stays eager: dynamo does not resume inside the
    ``set_checkpoint_early_stop`` block around it.
    """
    names = sorted(vars(cls))
    stages = [n for n in names if _STAGE.fullmatch(n)]
    return (stages or ["forward"]) + [n for n in names if _RECOMPUTE.fullmatch(n)]


def compile_module(cls, backend: str) -> None:
    """Compiles the compute methods of the generated module class ``cls`` with ``torch.compile``.

    Applied to the class, so every instance (each ``cube.load_model()``, a deep copy)
    runs compiled; the class is this compile's own (each compile loads its generated
    file as a new module). Shapes are static (``dynamic=False``), as cube's plans are:
    another batch shape recompiles. Calling it again with the same backend does nothing.

    Raises:
        ValueError: the class was already compiled with another backend.
    """
    done = getattr(cls, "BACKEND", None)
    if done == backend:
        return
    if done is not None:
        raise ValueError(f"{cls.__name__} already runs under torch.compile backend {done!r}, not {backend!r}: "
                         f"compile the step again to change it")
    fence()
    for name in compute_methods(cls):
        setattr(cls, name, torch.compile(vars(cls)[name], backend=backend, dynamic=False))
    cls.BACKEND = backend
