"""Finding, calling and checking a policy (PAS)."""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Union

from cube import config
from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation


@dataclass(frozen=True)
class Resource:
    """What a policy plans for. ``ngpus``: the devices in the plan (the world size)."""

    ngpus: int


# shipped policy name -> the module of the ``cube.policies`` package that defines it (imported only on use)
SHIPPED = {"PASSingle": "cube.policies.single", "PASData": "cube.policies.data", "PASMegatronTP": "cube.policies.megatron",
           "PASHybrid": "cube.policies.hybrid", "PASCol": "cube.policies.gallery", "PASRow": "cube.policies.gallery",
           "PAS1F1B": "cube.policies.pipeline", "PASGPipe": "cube.policies.pipeline",
           "PAS1F1BInterleaved": "cube.policies.pipeline", "PASZBH1": "cube.policies.pipeline",
           "PASZBV": "cube.policies.pipeline", "PASDualPipeV": "cube.policies.pipeline",
           "PASMegatron": "cube.policies.megatron3d",
           "PASPipeDream": "cube.policies.pipedream", "PASAuto": "cube.policies.auto",
           "PASSpatial": "cube.policies.spatial", "PASContext": "cube.policies.context"}


def resolve(name: str) -> str:
    """``"PASData"`` -> ``"cube.policies.data:PASData"``; ``file.py:Name`` / ``module:Name`` pass through.

    Raises:
        ValueError: a bare name that is not a shipped policy.
    """
    if ":" in name:
        return name
    if name not in SHIPPED:
        raise ValueError(f"unknown policy {name!r}: use one of {sorted(SHIPPED)}, or 'file.py:Name' / 'module:Name'")
    return f"{SHIPPED[name]}:{name}"


def load_policy(pas: Union[Callable, str]) -> Callable:
    """Resolves a policy: a callable, a shipped policy's name (``"PASData"``),
    ``"path/to/file.py:Name"`` or ``"module:Name"``.

    Raises:
        ValueError: the string does not name a policy that exists.
        TypeError: it is neither a callable nor a string.
    """
    if callable(pas):
        return pas
    if not isinstance(pas, str):
        raise TypeError(f"PAS must be a callable policy or a 'file.py:Name' / 'module:Name' string, "
                        f"got {type(pas).__name__}")
    if ":" not in pas:
        if pas not in SHIPPED:
            raise ValueError(f"PAS={pas!r}: write a shipped policy's name ({', '.join(sorted(SHIPPED))}), "
                             f"'path/to/file.py:Name' or 'package.module:Name'")
        pas = resolve(pas)
    where, name = pas.rsplit(":", 1)
    try:
        module = load_module(where)
    except FileNotFoundError:
        raise ValueError(f"PAS={pas!r}: no policy file {where!r} (relative to {os.getcwd()})") from None
    except ImportError as e:
        raise ValueError(f"PAS={pas!r}: cannot import module {where!r}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        names = sorted(k for k, v in vars(module).items() if k.startswith("PAS") and callable(v))
        raise ValueError(f"PAS={pas!r}: {where!r} has no policy {name!r}; it has {names or 'no PAS* functions'}")
    return fn


def load_module(where: str):
    """The module ``where`` names: a Python file (``path/to/file.py``) or an importable module.

    Raises:
        FileNotFoundError: no such file.
        ImportError: the module cannot be imported.
    """
    if not where.endswith(".py"):
        return importlib.import_module(where)
    if not os.path.isfile(where):
        raise FileNotFoundError(where)
    spec = importlib.util.spec_from_file_location(f"cube_loaded_{abs(hash(os.path.abspath(where)))}", where)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def policy_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def policy_source(fn: Callable, options: Optional[Dict[str, object]] = None) -> str:
    """The source the plan depends on: the policy's whole file (helpers included), its keyword
    ``options``, and the environment variables the shipped policies read (``config.plan_settings``)."""
    target = getattr(fn, "func", fn)  # functools.partial
    try:
        with open(inspect.getsourcefile(target)) as f:
            text = f.read()
    except (OSError, TypeError):
        text = ""
    extra = repr(getattr(fn, "args", ())) + repr(getattr(fn, "keywords", {}))
    if options:
        extra += f"\noptions={sorted(options.items())!r}"
    return f"{policy_name(target)}\n{text}\n{extra}\n{config.plan_settings()}"


def policy_options(fn: Callable) -> Optional[List[str]]:
    """The keyword options ``fn`` takes after ``(graph, resource)``; None when it takes any
    (``**kwargs``) or its signature cannot be read."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:2]
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p not in positional]


def bind_options(fn: Callable, options: Optional[Dict[str, object]] = None) -> Callable:
    """``fn`` with its keyword ``options`` bound (``functools.partial``, same name); ``fn`` itself
    when there are none.

    Raises:
        TypeError: an option the policy does not take (the message lists those it takes).
    """
    if not options:
        return fn
    name = policy_name(fn.func if isinstance(fn, functools.partial) else fn)
    known = policy_options(fn)
    unknown = [k for k in options if known is not None and k not in known]
    if unknown:
        takes = ", ".join(known) if known else "no options"
        raise TypeError(f"policy {name} does not take option(s) {', '.join(map(repr, unknown))}; it takes {takes}")
    bound = functools.partial(fn, **options)
    bound.__name__ = bound.__qualname__ = name
    return bound


def parse_options(items: Iterable[str]) -> Dict[str, object]:
    """``["tp=2", "recompute=all"]`` -> ``{"tp": 2, "recompute": "all"}``: each value an int, a
    float, a bool (``true``/``false``), a tuple of ints (``1,2``) or else the string.

    Raises:
        ValueError: an item that is not ``key=value`` with ``key`` a Python name.
    """
    out: Dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"option {item!r}: write key=value, e.g. tp=2 or recompute=all")
        out[key] = _value(value.strip())
    return out


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float) if any(c.isdigit() for c in text) else ():   # "inf", "nan" stay strings
        try:
            return kind(text)
        except ValueError:
            pass
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > 1 and all(p.lstrip("-").isdigit() for p in parts):
        return tuple(int(p) for p in parts)
    return text


def apply_policy(fn: Callable, graph: IRGraph, resource: Resource,
                 options: Optional[Dict[str, object]] = None) -> IRGraph:
    """Runs the policy (``fn(graph, resource, **options)``) and checks that every op got a device
    within the world.

    Raises:
        TypeError: an option the policy does not take, or the policy returned something other
            than an ``IRGraph``.
        ValueError: some ops have no device, or a device outside the world.
    """
    result = bind_options(fn, options)(graph, resource)
    if not isinstance(result, IRGraph):
        raise TypeError(f"policy {policy_name(fn)} returned {type(result).__name__} "
                        f"({result!r:.60}); a policy must return the IRGraph it was given "
                        f"(end it with `return graph`)")
    unassigned = [op for op in result.ops if op.device is None]
    if unassigned:
        shown = "\n".join(f"  - {_describe(op)}" for op in unassigned[:20])
        more = f"\n  ... and {len(unassigned) - 20} more" if len(unassigned) > 20 else ""
        raise ValueError(f"policy {policy_name(fn)} left {len(unassigned)} op(s) without a device:\n"
                         f"{shown}{more}\nAssign every op (and every piece it made) with graph.assign(op, device).")
    bad = [op for op in result.ops if any(d >= resource.ngpus for d in op.device)]
    if bad:
        needs = 1 + max(d for op in bad for d in op.device)
        shown = "\n".join(f"  - {_describe(op)} on device {list(op.device)}" for op in bad[:5])
        more = f"\n  ... and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise ValueError(f"policy {policy_name(fn)} plans for {needs} devices, but the world has "
                         f"{resource.ngpus}: launch {needs} ranks (torchrun --nproc_per_node={needs}, or "
                         f"python -m cube.debug -n {needs} to run them in one process), or make the policy "
                         f"follow resource.ngpus (cube.toolkit.grid(resource.ngpus, ...) sizes a mesh for "
                         f"the world). Ops outside devices 0..{resource.ngpus - 1}, {len(bad)} in all:\n"
                         f"{shown}{more}")
    return result


def _describe(op) -> str:
    if isinstance(op, IRFwOperation):
        return f"{op.name} ({op.where()})"
    return f"{op.name}"
