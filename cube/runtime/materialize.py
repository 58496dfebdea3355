"""``cube.load_model(init=..., weights=...)``: a rank's pieces of a model that never exists whole.

The user's model may live on the meta device (shapes only). Each tensor of the
generated module gets its values from one source, decided for the whole model
before anything is read, the same way on every rank:

- ``file``: the weights file holds it (``cube.runtime.weights``), or it is in
  ``state_dict()`` and the weights are a cube checkpoint (which holds every such
  tensor; non-persistent buffers are never in one); the rank reads only its pieces;
- ``init``: ``init(module)`` on its owning module; cube visits the modules in
  ``model.apply`` order (children before parents), gives each one fresh CPU
  tensors at full size for its own (``recurse=False``) parameters and buffers
  (``to_empty`` semantics), calls ``init(module)``, copies this rank's pieces
  out and frees the full tensors, so the peak is one module. Without a weights
  file every module is visited on every rank, held or not, from the random
  state ``load_model`` was called with, so the random numbers are the ones
  ``model.to_empty(device="cpu"); model.apply(init)`` draws on one device;
  with weights (a file or a checkpoint) only modules holding a tensor they lack are visited;
- ``model``: the user's tensor is real (not meta) and neither of the above applies;
- ``reset``: a meta tensor nothing else gives a value, whose module has
  ``reset_parameters()``.

A meta tensor with none of these is a ``ValueError`` naming it. While
``init(module)`` runs, every other module's tensors are meta stand-ins: an
operation on one of them, or assigning another module a tensor, is a
``ValueError`` naming both modules.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode

from cube.runtime.module import piece
from cube.runtime.weights import WeightFiles, is_cube_checkpoint, open_weights

_SHOW = 20   # names listed per kind of problem in one error


@dataclass
class _Tensor:
    """One tensor of the user's model (tied names share it)."""
    value: torch.Tensor
    names: List[str]                      # every name in the user's model
    persistent: bool                      # in ``state_dict()``
    owners: List[Tuple[str, torch.nn.Module]] = field(default_factory=list)   # modules holding it, apply order
    source: str = ""
    held: List[Tuple[torch.Tensor, list]] = field(default_factory=list)       # (local tensor, splits) here


def visit_order(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module]]:
    """``(path, module)`` in the order ``model.apply`` calls its function (children first)."""
    def walk(m, path):
        for name, child in m.named_children():
            yield from walk(child, f"{path}.{name}" if path else name)
        yield path, m
    return walk(model, "")


def _own(m: torch.nn.Module) -> List[Tuple[dict, str, torch.Tensor]]:
    return [(store, k, t) for store in (m._parameters, m._buffers) for k, t in store.items() if t is not None]


def _catalog(model: torch.nn.Module) -> Dict[int, _Tensor]:
    persistent = set(model.state_dict(keep_vars=True))
    out: Dict[int, _Tensor] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        entry = out.setdefault(id(t), _Tensor(t, [], False))
        entry.names.append(name)
        entry.persistent |= name in persistent
    for path, m in visit_order(model):
        for _, _, t in _own(m):
            if id(t) in out and (path, m) not in out[id(t)].owners:
                out[id(t)].owners.append((path, m))
    return out


def _listing(names: List[str]) -> str:
    more = f", ... and {len(names) - _SHOW} more" if len(names) > _SHOW else ""
    return ", ".join(names[:_SHOW]) + more


def check_weights(files: WeightFiles, tensors: Dict[int, _Tensor], strict: bool) -> None:
    """Missing, unexpected and mis-shaped tensors of a weights file, as one ``ValueError``."""
    known = {n: t for t in tensors.values() if t.persistent for n in t.names}
    problems = []
    unexpected = [n for n in files.shapes if n not in known]
    missing = [t.names[0] for t in tensors.values() if t.persistent and not any(n in files.shapes for n in t.names)]
    shaped = [f"{n} (file {list(files.shapes[n])}, model {list(known[n].value.shape)})" for n in files.shapes
              if n in known and tuple(files.shapes[n]) != tuple(known[n].value.shape)]
    if strict and missing:
        problems.append(f"missing from the file ({len(missing)}): {_listing(missing)}")
    if strict and unexpected:
        problems.append(f"in the file but not in the model ({len(unexpected)}): {_listing(unexpected)}")
    if shaped:
        problems.append(f"shapes differ ({len(shaped)}): {_listing(shaped)}")
    if problems:
        raise ValueError(f"cube.load_model(weights={str(files.path)!r}) does not match the compiled model's "
                         "state_dict() names:\n  " + "\n  ".join(problems) + "\nFix: pass rename=fn mapping the "
                         "file's names to the model's (e.g. lambda k: 'm.' + k when the model wraps the saved one "
                         "as self.m), or strict=False to skip missing/unexpected tensors (the model's tensors the "
                         "file lacks then come from init).")


def _decide(tensors: Dict[int, _Tensor], files: Optional[WeightFiles], ckpt: bool, init) -> None:
    """Sets each tensor's source; a meta tensor without one is a ``ValueError`` naming it."""
    lacking = []
    for t in tensors.values():
        if (ckpt and t.persistent) or (files is not None and any(n in files.shapes for n in t.names)):
            t.source = "file"
        elif init is not None:
            t.source = "init"
        elif t.value.device.type != "meta":
            t.source = "model"
        elif any(callable(getattr(m, "reset_parameters", None)) for _, m in t.owners):
            t.source = "reset"
        else:
            owner = t.owners[0] if t.owners else ("", None)
            lacking.append(f"{t.names[0]} (in {owner[0] or 'the model'}: {type(owner[1]).__name__})")
    if lacking:
        raise ValueError(f"cube.load_model: {len(lacking)} tensor(s) of the model are on the meta device and "
                         f"nothing gives them values: {_listing(lacking)}. Fix: pass init=fn (called on each "
                         f"module, e.g. init=model._init_weights for a Hugging Face model), or weights=path "
                         f"holding them; modules with reset_parameters() are initialized by it by default.")


def _hold(tensors: Dict[int, _Tensor], gen: torch.nn.Module) -> None:
    """Links each tensor to this rank's pieces of it in ``gen`` (its PARAMS/BUFFERS tables)."""
    by_name = {n: t for t in tensors.values() for n in t.names}
    locals_ = dict(gen.named_parameters())
    locals_.update(dict(gen.named_buffers()))
    for table in (gen.PARAMS, gen.BUFFERS):
        for local, (names, splits) in table.items():
            if names[0] not in by_name:
                raise ValueError(f"the model has no tensor {names[0]!r} that the generated code expects; "
                                 f"the cached plan is stale: clear the cube cache directory")
            by_name[names[0]].held.append((locals_[local], splits))


def _keep(t: _Tensor, full: torch.Tensor) -> None:
    for local, splits in t.held:
        local.copy_(piece(full, splits))


class _Guard(TorchDispatchMode):
    """Refuses operations on other modules' (meta stand-in) tensors while ``init(module)`` runs."""

    def __init__(self, keys: Dict[int, str]):
        super().__init__()
        self.keys = keys
        self.module = ("", None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for a in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(a, torch.Tensor) and a.device.type == "meta":
                name = self.keys.get(a.untyped_storage()._cdata)
                if name is not None:
                    raise ValueError(self.message(name, f"{func} on it"))
        return func(*args, **(kwargs or {}))

    def message(self, name: str, what: str) -> str:
        path, m = self.module
        return (f"cube.load_model: init({path or 'the model'} ({type(m).__name__})) touched {name}, a tensor of "
                f"another module ({what}). init may touch only the parameters and buffers the module it is given "
                f"owns itself (recurse=False): initialize each tensor when init gets its own module.")


@contextlib.contextmanager
def _stand_ins(model: torch.nn.Module, tensors: Dict[int, _Tensor]) -> Iterator[Tuple[Dict[int, str], list]]:
    """Swaps every real tensor of the model for a meta stand-in while modules are visited.

    Yields:
        ``(keys, entries)``: meta storage -> tensor name, for the guard; and every
        ``(store, key, stand-in, original)`` (restored on exit).
    """
    made: Dict[int, torch.Tensor] = {}
    entries = []
    for m in model.modules():
        for store, k, t in _own(m):
            if t.device.type != "meta" and id(t) not in made:
                meta = torch.empty_like(t, device="meta")
                made[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
            entries.append((store, k, made.get(id(t), t), t))
            store[k] = made.get(id(t), t)
    keys = {stand.untyped_storage()._cdata: tensors[id(orig)].names[0] for _, _, stand, orig in entries}
    try:
        yield keys, entries
    finally:
        for store, k, _, orig in entries:
            store[k] = orig


def _visit(model: torch.nn.Module, tensors: Dict[int, _Tensor], fn: Callable, which: Callable) -> None:
    """Calls ``fn`` on each module ``which(module)`` selects, in apply order, one module materialized at a time."""
    with _stand_ins(model, tensors) as (keys, entries):
        guard = _Guard(keys)

        def registered(module, name, value):
            if module is not guard.module[1]:
                raise ValueError(guard.message(f"{type(module).__name__}.{name}", "assigned a tensor to it"))

        hooks = [nn_module.register_module_parameter_registration_hook(registered),
                 nn_module.register_module_buffer_registration_hook(registered)]
        stand_of = {(id(store), k): (stand, orig) for store, k, stand, orig in entries}
        try:
            for path, m in visit_order(model):
                if which(m):
                    _visit_one(path, m, fn, tensors, guard, stand_of)
        finally:
            for h in hooks:
                h.remove()
        for store, k, stand, orig in entries:
            if store.get(k) is not stand:
                raise ValueError(f"cube.load_model: an init call replaced or removed {tensors[id(orig)].names[0]} "
                                 f"outside its own module; init may change only the module it is given")


def _visit_one(path: str, m: torch.nn.Module, fn: Callable, tensors: Dict[int, _Tensor], guard: _Guard,
               stand_of: dict) -> None:
    """Materializes ``m``'s own tensors, calls ``fn(m)``, keeps this rank's pieces, frees the rest."""
    own = [(store, k) + stand_of[(id(store), k)] for store, k, _ in _own(m)]
    fresh: Dict[int, torch.Tensor] = {}
    for store, k, stand, _ in own:   # to_empty: fresh storage on CPU, the same Parameter-ness
        if id(stand) not in fresh:
            empty = torch.empty_like(stand, device="cpu")
            fresh[id(stand)] = (torch.nn.Parameter(empty, stand.requires_grad)
                                if isinstance(stand, torch.nn.Parameter) else empty)
        store[k] = fresh[id(stand)]
    guard.module = (path, m)
    try:
        with guard, torch.no_grad():
            fn(m)
    finally:
        guard.module = ("", None)
    where = f"{path or 'the model'} ({type(m).__name__})"
    done = set()
    for store, k, stand, orig in own:
        value = store.get(k)
        if not isinstance(value, torch.Tensor) or value.device.type == "meta" or value.shape != stand.shape:
            got = "removed it" if value is None else f"left {type(value).__name__} " + (
                f"on {value.device}, shape {list(value.shape)}" if isinstance(value, torch.Tensor) else "")
            raise ValueError(f"cube.load_model: after init({where}) its tensor {k!r} must be a CPU tensor of shape "
                             f"{list(stand.shape)}, but init {got}")
        t = tensors[id(orig)]
        if t.source in ("init", "reset") and id(orig) not in done:
            done.add(id(orig))
            with torch.no_grad():
                _keep(t, value)
        store[k] = stand   # frees the full tensor


def _reset(m: torch.nn.Module) -> None:
    m.reset_parameters()


def load(build: Callable[[], torch.nn.Module], model: torch.nn.Module, consts: Dict[str, torch.Tensor], *,
         init: Optional[Callable] = None, weights=None, rename: Optional[Callable] = None,
         strict: bool = True) -> torch.nn.Module:
    """Builds this rank's generated module and fills its pieces (see the module docstring).

    Args:
        build: makes the empty generated module (it may create process groups).
        model: the user's model (meta, real or mixed); left as it was.
        consts: the plan's lifted constants.
        init, weights, rename, strict: as ``cube.load_model``.

    Raises:
        ValueError: a weights file that does not match the model, a meta tensor
            nothing gives a value, an init that touches another module's tensors,
            a meta constant.
    """
    rng = torch.get_rng_state()   # the state the caller's single-device init would start from
    if init is not None and not callable(init):
        raise TypeError(f"cube.load_model: init must be a function of a module, got {type(init).__name__}")
    if rename is not None and not callable(rename):
        raise TypeError(f"cube.load_model: rename must be a function of a name, got {type(rename).__name__}")
    tensors = _catalog(model)
    ckpt = weights is not None and is_cube_checkpoint(weights)
    files = open_weights(weights, rename) if weights is not None and not ckpt else None
    if files is not None:
        check_weights(files, tensors, strict)
    _decide(tensors, files, ckpt, init)
    gen = build()
    _check_consts(gen, consts)
    _hold(tensors, gen)
    partial = files is not None or ckpt   # only modules holding a tensor the weights lack are visited
    with torch.no_grad():
        if init is not None and (not partial or any(t.source == "init" for t in tensors.values())):
            needs = {id(m) for t in tensors.values() if t.source == "init" for _, m in t.owners}
            torch.set_rng_state(rng)
            _visit(model, tensors, init, lambda m: not partial or id(m) in needs)
        if any(t.source == "reset" for t in tensors.values()):
            needs = {id(m) for t in tensors.values() if t.source == "reset" for _, m in t.owners}
            torch.set_rng_state(rng)
            _visit(model, tensors, _reset, lambda m: id(m) in needs and callable(getattr(m, "reset_parameters", None)))
        for t in tensors.values():
            if t.source == "model":
                _keep(t, t.value)
            elif t.source == "file" and files is not None:
                name = next(n for n in t.names if n in files.shapes)
                for local, splits in t.held:
                    local.copy_(files.read(name, splits))
        for local, (names, splits) in gen.CONSTS.items():
            getattr(gen, local).copy_(piece(consts[names[0]], splits))
    if ckpt:
        from cube.runtime.checkpoint import load_checkpoint
        load_checkpoint(weights, gen)
    return gen


def _check_consts(gen: torch.nn.Module, consts: Dict[str, torch.Tensor]) -> None:
    for names, _ in gen.CONSTS.values():
        if names[0] not in consts:
            raise ValueError(f"the plan has no value for the constant {names[0]!r} the generated code expects; "
                             f"the cached plan is stale: clear the cube cache directory")
    meta = [names[0] for names, _ in gen.CONSTS.values() if consts[names[0]].device.type == "meta"]
    if meta:
        raise ValueError(f"cube.load_model: the model's forward uses tensor attributes that are neither "
                         f"parameters nor buffers and were built on the meta device: {_listing(meta)}. Fix: "
                         f"register them with register_buffer(..., persistent=False) so init can compute them.")
