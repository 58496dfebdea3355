"""Finding, calling and checking a policy (PAS)."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from dataclasses import dataclass
from typing import Callable, Union

from cube import config
from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation


@dataclass(frozen=True)
class Resource:
    """What a policy plans for. ``ngpus``: the devices in the plan (the world size)."""

    ngpus: int


def load_policy(pas: Union[Callable, str]) -> Callable:
    """Resolves a policy: a callable, ``"path/to/file.py:Name"`` or ``"module:Name"``.

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
        raise ValueError(f"PAS={pas!r}: write 'path/to/file.py:Name' or 'package.module:Name'")
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


def policy_source(fn: Callable) -> str:
    """The source the plan depends on: the policy's whole file (helpers included), and the
    environment variables the shipped policies read (``config.plan_settings``)."""
    target = getattr(fn, "func", fn)  # functools.partial
    try:
        with open(inspect.getsourcefile(target)) as f:
            text = f.read()
    except (OSError, TypeError):
        text = ""
    extra = repr(getattr(fn, "args", ())) + repr(getattr(fn, "keywords", {}))
    return f"{policy_name(target)}\n{text}\n{extra}\n{config.plan_settings()}"


def apply_policy(fn: Callable, graph: IRGraph, resource: Resource) -> IRGraph:
    """Runs the policy and checks that every op got a device within the world.

    Raises:
        TypeError: the policy returned something other than an ``IRGraph``.
        ValueError: some ops have no device, or a device outside the world.
    """
    result = fn(graph, resource)
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
        shown = "\n".join(f"  - {_describe(op)} on device {list(op.device)}" for op in bad[:20])
        raise ValueError(f"policy {policy_name(fn)} placed ops on devices outside the world of "
                         f"{resource.ngpus} (devices 0..{resource.ngpus - 1}):\n{shown}\n"
                         f"Plan for resource.ngpus devices, or launch with more processes.")
    return result


def _describe(op) -> str:
    if isinstance(op, IRFwOperation):
        return f"{op.name} ({op.where()})"
    return f"{op.name}"
