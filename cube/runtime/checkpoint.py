"""Checkpoints of generated modules: files per rank, merged or resharded when read.

A checkpoint is a directory holding, for every rank of the plan that saved it,
``rank{r}.safetensors`` (the rank's tensors: its pieces of parameters and
buffers, and the optimizer state shaped like them) and ``rank{r}.pt`` (the
small rest: names, pieces, optimizer hyperparameters and scalars, ``extra``,
the user model's layout), and ``meta.json``, which rank 0 writes last (world
size, files and a sha256 per file). Every file is written atomically (temporary
file, fsync, rename). A directory without ``meta.json``, or whose files do not
match it, is incomplete or corrupt, and every reader refuses it.

Each rank's record holds, per local parameter and persistent buffer (what the
user's ``state_dict()`` holds: buffers registered with ``persistent=False`` are
neither saved nor expected, as torch leaves them out), the user's names for it
and its piece of the full tensor (``[(dim, start, stop)]``, as in ``PARAMS``);
per parameter, the optimizer state: tensors shaped like the
parameter's piece are pieces with the same splits, anything else (AdamW's
``step``) is kept as is; and the layout of the user's model (its ``state_dict()``
names, which leave out non-persistent buffers, and its ``parameters()`` order),
so a checkpoint merges for the single-device model and its optimizer from the
path alone. Readers assemble full tensors one at a time from the pieces of all
files, reading each piece from its file at its offset, so a checkpoint can be
merged (also into Hugging Face sharded safetensors) or loaded under another plan
(other world size, other policy) without holding the whole model. Checkpoints
of format 1 (every tensor inside ``rank{r}.pt``, no layout) are still read.

Complex tensors (a complex parameter, its AdamW state, a persistent complex
buffer) are stored as their real views, listed in their file's metadata
(``cube.runtime.safetensors_file``); every reader here gives them back complex,
so a merged state dict loads into the single-device model as it is.
"""
from __future__ import annotations

import hashlib
import heapq
import io
import json
import os
import pickle
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from cube.runtime import checkpoint_write as writer
from cube.runtime import resume
from cube.runtime import safetensors_file as sfile
from cube.runtime import session, watchdog
from cube.runtime.module import CubeModule, piece
from cube.runtime.utils import atomic_write
from cube.runtime.zero import whole_parameters

FORMAT = 2
READABLE = (1, 2)
META = writer.META
INDEX = "model.safetensors.index.json"
PathLike = Union[str, os.PathLike]
Source = Union[torch.Tensor, sfile.Slot]   # a piece in memory (format 1, small values) or in a file


# ---------------------------------------------------------------------- save
def save_checkpoint(path: PathLike, model: CubeModule, optimizer=None, extra: Any = None, dataloader=None,
                    async_save: bool = False) -> None:
    """Saves this rank's pieces of the model and optimizer state, its random generator states and its
    data loader's position under directory ``path``.

    Call it on every rank. Each rank writes ``path/rank{r}.safetensors`` and
    ``path/rank{r}.pt``; after all have written, rank 0 writes
    ``path/meta.json``, which marks the checkpoint complete (a crash before
    leaves a directory every reader refuses; ``cube.runtime.checkpoint_write``).
    An optimizer with ``consolidated_state()`` (a ZeRO optimizer) is asked for
    the state a plain optimizer would hold; that call may be collective.

    Args:
        path: the checkpoint directory (created if needed; an older checkpoint
            there is replaced).
        model: this rank's module from ``cube.load_model()``.
        optimizer: the optimizer over ``model.parameters()``, or None.
        extra: tensors and plain Python values to keep with this rank's file
            (a step counter, ...); ``load_checkpoint`` returns them.
        dataloader: a loader with ``state_dict()``/``load_state_dict()`` (torchdata's
            ``StatefulDataLoader``, ``cube.runtime.data.ShuffledBatches``) whose position
            to keep, or None. The random generator states are always kept.
        async_save: return once the state is copied to host memory and write the
            files in a background thread while training goes on. The next save,
            ``cube.wait_checkpoint()`` or the process's exit waits for it; its failure
            is raised by the next of those calls.

    Raises:
        TypeError: ``model`` is not a generated module, or ``dataloader`` has no
            ``state_dict()``/``load_state_dict()``.
        ValueError: the optimizer holds tensors that are not parameters of ``model``;
            ``extra`` or the loader's state holds objects other than tensors and plain
            Python values.
        CheckpointError: this rank's previous asynchronous save failed.
    """
    _check_model(model, "save_checkpoint")
    with watchdog.watched(f"save_checkpoint({str(path)!r})"):
        _save(path, model, optimizer, extra, dataloader, async_save)


def _save(path: PathLike, model: CubeModule, optimizer, extra: Any, dataloader, async_save: bool) -> None:
    rank, world = _rank_world()
    writer.wait(rank)   # the previous asynchronous save, finished or its failure raised here
    if dataloader is not None:
        resume.check_stateful(dataloader, "save_checkpoint")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    token = writer.agree(folder, rank, world)
    with whole_parameters(model):   # ZeRO-3 holds only chunks at rest
        tensors, entries = _tensor_records(model)
        opt = None
        if optimizer is not None:
            opt, opt_entries = _optimizer_record(model, optimizer)
            entries += opt_entries
        record = {"format": FORMAT, "model": _model_name(type(model)), "rank": rank, "world_size": world,
                  "full_shapes": getattr(type(model), "FULL_SHAPES", None), "tensors": tensors, "optimizer": opt,
                  "layout": _user_layout(model), "extra": extra, "rng": resume.rng_state(model),
                  "data": resume.loader_state(dataloader) if dataloader is not None else None}
        snap = writer.Snapshot(folder, rank, world, token, {"format": FORMAT, "model": record["model"]},
                               writer.host_copies(entries, rank) if async_save else entries, _serialize(record))
        if async_save:
            writer.start(snap)
            return
        files = writer.write_rank(snap)
    writer.commit_sync(snap, files)


def wait_checkpoint() -> None:
    """Waits until this rank's asynchronous save (``save_checkpoint(..., async_save=True)``) is written.

    Rank 0's save is written when the checkpoint is complete (its ``meta.json``
    too); another rank's when its own files are. Nothing to wait for: returns
    at once.

    Raises:
        CheckpointError: the save failed (its directory is not a checkpoint; the
            previous one stands).
    """
    writer.wait(_rank_world()[0])


def _serialize(record: dict) -> bytes:
    """``rank{r}.pt``'s bytes, checked to load as readers load them (tensors and plain values only)."""
    buf = io.BytesIO()
    torch.save(record, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError) as e:
        raise ValueError(f"cube.save_checkpoint: extra= and the dataloader's state_dict() may hold only tensors and "
                         f"plain Python values (dict, list, tuple, str, int, float, bool, None), which a checkpoint "
                         f"loads without running code; this one does not ({str(e).splitlines()[0][:300]}). "
                         f"Convert other objects to those") from None
    return data


def _entry(key: str, t: torch.Tensor) -> sfile.Entry:
    return sfile.Entry(key, t.dtype, tuple(t.shape), lambda: t)


def _tensor_records(model: CubeModule) -> Tuple[Dict[str, dict], List[sfile.Entry]]:
    """Each local tensor's kind, names and piece; its data goes to the rank's safetensors under its local name.
    Non-persistent buffers are left out (``CubeModule.state_tensors``)."""
    held = dict(model.named_parameters())
    held.update(dict(model.named_buffers()))
    out, entries = {}, []
    for kind, local, names, splits in model.state_tensors():
        out[local] = {"kind": kind, "names": list(names), "splits": [tuple(s) for s in splits]}
        entries.append(_entry(local, held[local]))
    return out, entries


def _optimizer_record(model: CubeModule, optimizer) -> Tuple[dict, List[sfile.Entry]]:
    """Hyperparameters per group, the group of every parameter, and the state by local name
    (pieces go to the rank's safetensors as ``{local}/{key}``)."""
    if hasattr(optimizer, "consolidated_state"):
        state, groups = optimizer.consolidated_state()
    else:
        state, groups = optimizer.state, optimizer.param_groups
    local_of = {id(p): k for k, p in model.named_parameters()}
    group_of = {}
    for i, g in enumerate(groups):
        for p in g.get("params", ()):
            group_of[_local(local_of, p, "save_checkpoint")] = i
    if not any("params" in g for g in groups):   # hyperparameters only: one group over every parameter
        group_of = {k: 0 for k in local_of.values()}
    out, entries = {}, []
    for p, st in state.items():
        local = _local(local_of, p, "save_checkpoint")
        pieces, values = {}, {}
        for key, v in st.items():
            if torch.is_tensor(v) and v.shape == p.shape:
                pieces[key] = f"{local}/{key}"
                entries.append(_entry(pieces[key], v))
            else:
                values[key] = _portable(v) if torch.is_tensor(v) else v
        out[local] = {"pieces": pieces, "values": values}
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    return {"groups": hyper, "group_of": group_of, "state": out}, entries


def _user_layout(model: CubeModule) -> Optional[dict]:
    """The user model's ``state_dict()`` names and ``parameters()`` order, for merging without it.

    The generated module does not know its user model; the compiled step that
    made it does. A compile of this process still alive is used when ``model``
    comes from its plan: an instance of its generated class, or of another
    rank's class of the same plan (``python -m cube.debug`` runs every rank in
    one process; the plan's key names the generated modules). None otherwise:
    then ``merge_checkpoint`` needs ``model=`` to leave out non-persistent buffers.
    """
    for step in session.steps():
        if isinstance(model, step.module.GenModel) or \
                type(model).__module__.startswith(f"cube_gen_{step.key[:16]}_rank"):
            return _layout_of(step.user_model)
    return None


def _layout_of(user: torch.nn.Module) -> dict:
    """``state_dict``: the names ``user.state_dict()`` has, in its order (each module's parameters, then
    its buffers but those in its ``_non_persistent_buffers_set``, then its children); ``parameters``:
    ``user.named_parameters()`` names (one per tensor), the order a plain optimizer indexes."""
    state = []
    for prefix, mod in user.named_modules(remove_duplicate=False):
        dot = prefix + "." if prefix else ""
        state += [dot + n for n, t in mod._parameters.items() if t is not None]
        state += [dot + n for n, t in mod._buffers.items()
                  if t is not None and n not in mod._non_persistent_buffers_set]
    return {"state_dict": state, "parameters": [n for n, _ in user.named_parameters()]}


# ---------------------------------------------------------------------- read
class _Checkpoint:
    """A verified checkpoint directory, indexed by the user's tensor names (no tensor data is read)."""

    def __init__(self, path: PathLike):
        self.folder = Path(path)
        self.meta, self.records, slots = _read(self.folder)
        self.world_size = self.meta["world_size"]
        self.model = self.meta.get("model", "?")
        self.alias: Dict[str, str] = {}       # every user name -> the canonical one (names[0])
        self.kind: Dict[str, str] = {}
        self.names: Dict[str, List[str]] = {}
        self.pieces: Dict[str, List[Tuple[list, Source]]] = {}     # canonical -> [(splits, source)]
        self.orders: List[List[str]] = []     # canonical parameter names, per rank in PARAMS order
        self.opt_pieces: Dict[str, Dict[str, list]] = {}
        self.opt_values: Dict[str, dict] = {}
        self.group_of: Dict[str, int] = {}
        self.has_optimizer = any(r["optimizer"] is not None for r in self.records)
        self.groups = next((r["optimizer"]["groups"] for r in self.records if r["optimizer"]), [])
        self.layout = next((r["layout"] for r in self.records if r.get("layout")), None)
        for rec, slot in zip(self.records, slots):
            self._index(rec, slot)
        given = next((r["full_shapes"] for r in self.records if r.get("full_shapes")), None) or {}
        self.shapes = {c: tuple(given[c]) if c in given else _full_shape(
            [(s, tuple(t.shape)) for s, t in ps]) for c, ps in self.pieces.items()}

    def _index(self, rec: dict, slots: Optional[Dict[str, sfile.Slot]]) -> None:
        def source(key: str, inline) -> Source:
            if slots is None:   # format 1: the tensor is in the record
                return inline
            if key not in slots:
                r = rec["rank"]
                raise ValueError(f"checkpoint file {str(self.folder / f'rank{r}.safetensors')!r} has no tensor "
                                 f"{key!r} that rank{r}.pt lists; save the checkpoint again")
            return slots[key]

        order = []
        for local, t in rec["tensors"].items():
            canon = self.alias.setdefault(t["names"][0], t["names"][0])
            for n in t["names"]:
                self.alias.setdefault(n, canon)
            self.kind.setdefault(canon, t["kind"])
            self.names.setdefault(canon, list(t["names"]))
            self.pieces.setdefault(canon, []).append((t["splits"], source(local, t.get("tensor"))))
            if t["kind"] == "param":
                order.append(canon)
        self.orders.append(list(dict.fromkeys(order)))   # a fused weight's blocks: several locals, one name
        opt = rec["optimizer"]
        if opt is None:
            return
        for local, g in opt["group_of"].items():
            self.group_of.setdefault(self.alias[rec["tensors"][local]["names"][0]], g)
        for local, st in opt["state"].items():
            t = rec["tensors"][local]
            canon = self.alias[t["names"][0]]
            for key, v in st["pieces"].items():
                self.opt_pieces.setdefault(canon, {}).setdefault(key, []).append((t["splits"], source(v, v)))
            for key, v in st["values"].items():
                self.opt_values.setdefault(canon, {}).setdefault(key, v)

    def dtype(self, canon: str) -> torch.dtype:
        return self.pieces[canon][0][1].dtype

    def full(self, canon: str, key: Optional[str] = None) -> torch.Tensor:
        """The full tensor (``key``: that optimizer state of the parameter), read from the files now."""
        pieces = self.pieces[canon] if key is None else self.opt_pieces[canon][key]
        what = f"{canon!r}" if key is None else f"optimizer state {key!r} of {canon!r}"
        return _assemble(pieces, self.shapes[canon], what, self.folder)

    def optimizer_state(self, canon: str) -> dict:
        """The parameter's full optimizer state (empty when it has none)."""
        out = {k: v.clone() if torch.is_tensor(v) else v for k, v in self.opt_values.get(canon, {}).items()}
        out.update({key: self.full(canon, key) for key in self.opt_pieces.get(canon, {})})
        return out

    def param_order(self) -> List[str]:
        """Canonical parameter names: an order consistent with every rank's ``PARAMS``."""
        return _merge_orders(self.orders)


def _read(folder: Path) -> Tuple[dict, List[dict], List[Optional[Dict[str, sfile.Slot]]]]:
    """Reads ``meta.json``, every rank's record and the headers of its tensor file, checking sizes and
    checksums (tensor files in blocks: their data is not kept)."""
    if not folder.is_dir():
        raise ValueError(f"checkpoint directory {str(folder)!r} does not exist; pass the directory that "
                         f"cube.save_checkpoint wrote")
    meta_path = folder / META
    if not meta_path.is_file():
        raise ValueError(f"checkpoint {str(folder)!r} is incomplete: {META} is missing (rank 0 writes it after "
                         f"every rank saved, so the save did not finish); save again or use another checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
        files, world = meta["files"], int(meta["world_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint file {str(meta_path)!r} is corrupt ({e}); save the checkpoint again") from None
    fmt = meta.get("format")
    if fmt not in READABLE:
        raise ValueError(f"checkpoint {str(folder)!r} has format {fmt!r}, this cube reads formats "
                         f"{list(READABLE)}; save it again with this version")
    kinds = ("pt",) if fmt == 1 else ("pt", "safetensors")
    if sorted(files) != sorted(f"rank{r}.{k}" for r in range(world) for k in kinds):
        raise ValueError(f"checkpoint file {str(meta_path)!r} is corrupt: it lists {sorted(files)} for world size "
                         f"{world}; save the checkpoint again")
    records, slots = [], []
    for r in range(world):
        f = folder / f"rank{r}.pt"
        data = _checked(folder, f, files, read=True)
        try:
            rec = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError) as e:
            raise ValueError(f"checkpoint file {str(f)!r} cannot be read ({str(e).splitlines()[0]}); its extra "
                             f"must hold only tensors and plain Python values") from None
        if rec.get("format") != fmt or rec.get("rank") != r or rec.get("world_size") != world:
            raise ValueError(f"checkpoint file {str(f)!r} does not belong to this checkpoint (rank "
                             f"{rec.get('rank')!r} of {rec.get('world_size')!r}); save the checkpoint again")
        records.append(rec)
        if fmt == 1:
            slots.append(None)
            continue
        f = folder / f"rank{r}.safetensors"
        _checked(folder, f, files, read=False)
        slots.append(sfile.read_header(f)[0])
    return meta, records, slots


def _checked(folder: Path, f: Path, files: dict, read: bool) -> Optional[bytes]:
    """Checks one file's size and sha256 against ``meta.json``; its bytes when ``read``."""
    if not f.is_file():
        raise ValueError(f"checkpoint {str(folder)!r} is incomplete: {f.name} is missing; save it again")
    data = f.read_bytes() if read else None
    size = len(data) if read else f.stat().st_size
    digest = hashlib.sha256(data).hexdigest() if read else _sha256(f)
    if size != files[f.name]["bytes"] or digest != files[f.name]["sha256"]:
        raise ValueError(f"checkpoint file {str(f)!r} is corrupt: its size or sha256 differs from {META} "
                         f"(changed or cut short after the save); save the checkpoint again")
    return data


def _assemble(pieces: List[Tuple[list, Source]], shape: tuple, what: str, folder: Path) -> torch.Tensor:
    """The full tensor from its pieces; every element must be covered. A piece several ranks hold
    (a replica) is read once; overlapping different pieces: the last wins."""
    full = torch.empty(shape, dtype=pieces[0][1].dtype)
    boxes: Dict[tuple, Tuple[list, Source]] = {}
    for splits, src in pieces:
        boxes.setdefault(_box(splits, tuple(src.shape)), (splits, src))
    for splits, src in boxes.values():
        try:
            dst = piece(full, splits)
        except (RuntimeError, IndexError):
            dst = None
        if dst is None or tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"checkpoint {str(folder)!r}: a piece {list(splits)} of {what} (shape "
                             f"{list(src.shape)}) does not fit the full shape {list(shape)}; the checkpoint is "
                             f"corrupt, save it again")
        if isinstance(src, torch.Tensor):
            dst.copy_(src)
        else:
            src.read_into(dst)
    missing = _uncovered(list(boxes), shape)
    if missing:
        raise ValueError(f"checkpoint {str(folder)!r} is incomplete: {missing} of {full.numel()} elements of "
                         f"{what} are held by no rank; save it from a plan whose ranks together hold every tensor")
    return full


def _box(splits: Sequence[Tuple[int, int, int]], shape: tuple) -> tuple:
    """The piece's ``(start, stop)`` per dim in the full tensor (nested narrows of one dim add up)."""
    start = [0] * len(shape)
    for dim, s, _ in splits:
        start[dim] += s
    return tuple((a, a + n) for a, n in zip(start, shape))


def _uncovered(boxes: List[tuple], shape: tuple) -> int:
    """How many elements of ``shape`` no box covers: by volumes when the boxes are disjoint (the
    plans' pieces are), else with a mask."""
    def volume(box):
        n = 1
        for a, b in box:
            n *= max(0, b - a)
        return n

    def meet(x, y):
        return all(a1 < b2 and a2 < b1 for (a1, b1), (a2, b2) in zip(x, y))

    total = volume(tuple((0, s) for s in shape))
    if not any(meet(x, y) for i, x in enumerate(boxes) for y in boxes[i + 1:]):
        return total - sum(volume(b) for b in boxes)
    covered = torch.zeros(shape, dtype=torch.bool)
    for box in boxes:
        covered[tuple(slice(a, b) for a, b in box)] = True
    return int((~covered).sum())


# ---------------------------------------------------------------------- merge
def merge_checkpoint(path: PathLike, model: Optional[torch.nn.Module] = None, *, out: Optional[PathLike] = None,
                     strip_prefix: str = "", max_shard_size: Union[int, str] = "2GB"):
    """Assembles a checkpoint for the single-device model (one process).

    Args:
        path: the checkpoint directory.
        model: the original single-device model (optional). With it, the names
            and shapes are checked against ``model.state_dict()`` and the
            optimizer state is indexed in ``model.parameters()`` order. Without
            it, the layout saved with the checkpoint gives both (its state dict
            names, without non-persistent buffers, and its parameter order); a
            checkpoint saved without a layout (format 1, or a module whose
            compile was not the latest) returns every buffer, with a warning, and
            orders parameters as the generated modules list them.
        out: a directory to write the merged weights to as Hugging Face sharded
            safetensors (``model-00001-of-0000K.safetensors`` and
            ``model.safetensors.index.json``) instead of returning them. Tensors
            are assembled, written and freed one at a time, so the peak memory is
            about the largest tensor. The optimizer state is not written.
        strip_prefix: with ``out``, dropped from the front of every name (``"m."``
            when the compiled module wraps the Hugging Face model as ``self.m``).
        max_shard_size: with ``out``, the largest shard: bytes or a string such
            as ``"2GB"`` (a larger tensor gets a shard of its own).

    Returns:
        Without ``out``: ``(model_state_dict, optimizer_state_dict)``; the first
        has every state dict name (every name of a tied parameter); the second
        (None when the checkpoint holds no optimizer state) is what a plain torch
        optimizer over ``model.parameters()`` loads, one parameter group per saved
        group. With ``out``: the path of the index file written.

    Raises:
        ValueError: a missing, incomplete or corrupt checkpoint, a tensor some
            element of which no rank held, a ``model`` the checkpoint is not of, a
            name without ``strip_prefix``, or an ``out`` holding a
            ``model.safetensors`` that would shadow the index.
    """
    ckpt = _Checkpoint(path)
    names = _state_names(ckpt, model)
    if out is not None:
        return _write_hf(ckpt, names, Path(out), strip_prefix, sfile.parse_size(max_shard_size))
    assembled: Dict[str, torch.Tensor] = {}
    state = {}
    for n in names:
        c = ckpt.alias[n]
        if c not in assembled:
            assembled[c] = ckpt.full(c)
        state[n] = assembled[c]
    if not ckpt.has_optimizer:
        return state, None
    if model is not None:
        order = _dedup(ckpt.alias[n] for n, _ in model.named_parameters())
    elif ckpt.layout is not None:
        order = _dedup(ckpt.alias[n] for n in ckpt.layout["parameters"])
    else:
        order = ckpt.param_order()
    index = {c: i for i, c in enumerate(order)}
    opt_state = {index[c]: s for c in order for s in [ckpt.optimizer_state(c)] if s}
    groups = [{**h, "params": sorted(index[c] for c, g in ckpt.group_of.items() if g == i and c in index)}
              for i, h in enumerate(ckpt.groups)]
    return state, {"state": opt_state, "param_groups": groups}


def _dedup(names) -> List[str]:
    return list(dict.fromkeys(names))


def _state_names(ckpt: _Checkpoint, model: Optional[torch.nn.Module]) -> List[str]:
    """The state dict names to merge, in the model's order, checked against the checkpoint."""
    where = f"checkpoint {str(ckpt.folder)!r} (model {ckpt.model})"
    if model is not None:
        return _match_model(model, ckpt)
    if ckpt.layout is None:
        if any(k == "buffer" for k in ckpt.kind.values()):
            warnings.warn(f"{where} was saved without its model's layout (by an older cube, or from a module "
                          f"whose compile was not the latest): which buffers are persistent is unknown, so all "
                          f"are merged; pass model= to leave out its non-persistent buffers", stacklevel=3)
        return [n for names in ckpt.names.values() for n in names]
    missing = [n for n in ckpt.layout["state_dict"] if n not in ckpt.alias]
    if missing:
        raise ValueError(f"{where} holds no piece of {missing[:5]} ({len(missing)} tensor(s) of the model's state "
                         f"dict): no rank of the plan held them (a tensor the step never reads?); merge with "
                         f"model= and strict=False loading, or save from a plan that holds them")
    return list(ckpt.layout["state_dict"])


def _match_model(model: torch.nn.Module, ckpt: _Checkpoint) -> List[str]:
    """``model.state_dict()`` names, checked against the checkpoint's names and shapes."""
    expected = model.state_dict()
    for name, t in expected.items():
        if name not in ckpt.alias:
            raise ValueError(f"checkpoint {str(ckpt.folder)!r} (model {ckpt.model}) has no tensor {name!r} that "
                             f"{type(model).__name__} has: it was saved from another model")
        shape = ckpt.shapes[ckpt.alias[name]]
        if shape != tuple(t.shape):
            raise ValueError(f"{name!r} has shape {list(shape)} in checkpoint {str(ckpt.folder)!r} but "
                             f"{list(t.shape)} in {type(model).__name__}: it was saved from another model")
    transient = {n for n, _ in model.named_buffers(remove_duplicate=False)} - set(expected)
    for name in ckpt.alias:
        if name not in expected and name not in transient:
            raise ValueError(f"checkpoint {str(ckpt.folder)!r} holds {name!r}, which {type(model).__name__} does not "
                             f"have: it was saved from another model")
    return list(expected)


def _write_hf(ckpt: _Checkpoint, names: List[str], out: Path, strip_prefix: str, max_bytes: int) -> Path:
    """Writes ``names`` as Hugging Face sharded safetensors under ``out``; returns the index path.

    Every shard is written by ``safetensors_file.write``, which takes each
    tensor from ``ckpt.full`` only when it reaches it, writes its bytes and drops
    it (the ``safetensors`` package would need a whole shard in memory).
    """
    entries = []
    for n in names:
        if not n.startswith(strip_prefix) or n == strip_prefix:
            raise ValueError(f"tensor {n!r} does not start with strip_prefix={strip_prefix!r}; pass the prefix "
                             f"every state dict name starts with (e.g. 'model.' for a wrapper's self.model), or ''")
        c = ckpt.alias[n]
        entries.append(sfile.Entry(n[len(strip_prefix):], ckpt.dtype(c), ckpt.shapes[c],
                                   lambda c=c: ckpt.full(c)))
    out.mkdir(parents=True, exist_ok=True)
    if (out / "model.safetensors").exists():
        raise ValueError(f"{str(out / 'model.safetensors')!r} exists, and from_pretrained would read it instead of "
                         f"{INDEX}; remove it or merge into another directory")
    shards = sfile.plan_shards(entries, max_bytes)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(files, shards):
        atomic_write(out / fname, lambda f, shard=shard: sfile.write(f, shard, {"format": "pt"}))
        weight_map.update({e.name: fname for e in shard})
    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": dict(sorted(weight_map.items()))}
    atomic_write(out / INDEX, lambda f: f.write(json.dumps(index, indent=2).encode()))
    for stale in out.iterdir():   # shards of an earlier merge into this directory
        if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", stale.name) and stale.name not in files:
            stale.unlink()
    return out / INDEX


def _merge_orders(orders: Sequence[List[str]]) -> List[str]:
    """One order consistent with each list (ties: earliest first appearance, rank 0 first)."""
    first: Dict[str, Tuple[int, int]] = {}
    after: Dict[str, set] = {}
    waiting: Dict[str, int] = {}
    for r, seq in enumerate(orders):
        for i, n in enumerate(seq):
            first.setdefault(n, (r, i))
            waiting.setdefault(n, 0)
        for a, b in zip(seq, seq[1:]):
            if b not in after.setdefault(a, set()):
                after[a].add(b)
                waiting[b] += 1
    ready = [(first[n], n) for n, w in waiting.items() if w == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for b in after.get(n, ()):
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, (first[b], b))
    rest = sorted((n for n in first if n not in set(out)), key=first.get)   # only if the ranks disagree
    return out + rest


# ---------------------------------------------------------------------- load
def load_checkpoint(path: PathLike, model: CubeModule, optimizer=None, dataloader=None) -> Any:
    """Loads a checkpoint saved under any plan into this rank's module (and optimizer, and data loader).

    Call it on every rank (it exchanges the ranks' piece tables when
    torch.distributed is initialized). Each rank reads the checkpoint's files on
    CPU, assembles the full tensors it holds pieces of, and copies its pieces in.
    An optimizer with ``load_consolidated_state(state, param_groups)`` (ZeRO)
    gets the per-parameter state through it; a plain one through ``load_state_dict``.
    The saved hyperparameters (lr, ...) replace the optimizer's. The random
    generator states (torch's CPU and CUDA generators, Python's and NumPy's,
    and cube's step count of the model, from which dropout masks are keyed)
    are set to the saved ones, so the run goes on drawing what an uninterrupted
    run would (this rank's when the world size is the same, else rank 0's).

    Args:
        path: the checkpoint directory.
        model: this rank's module from ``cube.load_model()``.
        optimizer: the optimizer over ``model.parameters()``, or None.
        dataloader: a loader with ``load_state_dict()`` to put at the saved
            position (``cube.runtime.resume``), or None. A batch ``cube.compile``
            read from this same loader object is dropped: the next step takes the
            batch that follows the saved position.

    Returns:
        The ``extra`` saved with this rank's file (rank 0's when the world size differs).

    Raises:
        TypeError: ``model`` is not a generated module.
        ValueError: a missing, incomplete or corrupt checkpoint; a checkpoint of
            another model (the first name, kind or shape that differs); an
            optimizer but no optimizer state in the checkpoint, or parameter
            groups that differ from the saved ones; a dataloader but no loader
            state in the checkpoint.
        TypeError: ``dataloader`` has no ``state_dict()``/``load_state_dict()``.
    """
    _check_model(model, "load_checkpoint")
    if dataloader is not None:
        resume.check_stateful(dataloader, "load_checkpoint")
    with watchdog.watched(f"load_checkpoint({str(path)!r})"):
        return _load(path, model, optimizer, dataloader)


def _load(path: PathLike, model: CubeModule, optimizer, dataloader) -> Any:
    target, transient = _target_tables(model)
    ckpt = _Checkpoint(path)
    _check_same_model(ckpt, target, transient, type(model))
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    with torch.no_grad(), whole_parameters(model, write=True):
        for _, local, names, splits in model.state_tensors():
            tensors[local].copy_(piece(ckpt.full(ckpt.alias[names[0]]), splits))
    if optimizer is not None:
        _load_optimizer(ckpt, model, optimizer)
    rank, world = _rank_world()
    mine = ckpt.records[rank if world == ckpt.world_size else 0]
    if dataloader is not None:
        resume.restore_loader(dataloader, ckpt.records, rank, world == ckpt.world_size,
                              f"checkpoint {str(ckpt.folder)!r}")
    resume.restore_rng(model, mine.get("rng"))
    return mine["extra"]


def _target_tables(model: CubeModule) -> Tuple[List[Tuple[str, List[str], list, tuple]], set]:
    """``(kind, names, splits, local shape)`` of every tensor of every rank of the plan that a checkpoint
    holds, and the names of the plan's non-persistent buffers (which it does not hold)."""
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    mine = [(kind, list(names), [tuple(s) for s in splits], tuple(tensors[local].shape))
            for kind, local, names, splits in model.state_tensors()]
    transient = sorted(n for local, (names, _) in model.BUFFERS.items()
                       if local in model._non_persistent_buffers_set for n in names)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine, set(transient)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (mine, transient))
    return [t for rank, _ in every for t in rank], {n for _, names in every for n in names}


def _check_same_model(ckpt: _Checkpoint, target: list, transient: set, cls: type) -> None:
    """Names, kinds and full shapes of the plan's tensors must be the checkpoint's. Non-persistent
    buffers (``transient``) a checkpoint of an older cube holds are not loaded, as torch does not
    load a buffer ``state_dict()`` leaves out."""
    where = f"checkpoint {str(ckpt.folder)!r} (model {ckpt.model})"
    ours = f"this model ({_model_name(cls)})"
    boxes: Dict[str, list] = {}
    kinds: Dict[str, str] = {}
    for kind, names, splits, shape in target:
        for n in names:
            if n not in ckpt.alias:
                raise ValueError(f"{where} has no {kind} {n!r} that {ours} has: it was saved from another model")
        kinds[names[0]] = kind
        boxes.setdefault(names[0], []).append((splits, shape))
    held = {n for _, names, _, _ in target for n in names}
    for n in ckpt.alias:
        if n not in held and n not in transient:
            raise ValueError(f"{where} holds {n!r}, which {ours} does not have: it was saved from another model")
    given = getattr(cls, "FULL_SHAPES", None) or {}
    for name, pieces in boxes.items():
        canon = ckpt.alias[name]
        if kinds[name] != ckpt.kind[canon]:
            raise ValueError(f"{name!r} is a {ckpt.kind[canon]} in {where} but a {kinds[name]} in {ours}: it was "
                             f"saved from another model")
        shape = tuple(given[name]) if name in given else _full_shape(pieces)
        if shape != ckpt.shapes[canon]:
            raise ValueError(f"{name!r} has shape {list(ckpt.shapes[canon])} in {where} but {list(shape)} in "
                             f"{ours}: it was saved from another model")


def _load_optimizer(ckpt: _Checkpoint, model: CubeModule, optimizer) -> None:
    if not ckpt.has_optimizer:
        raise ValueError(f"checkpoint {str(ckpt.folder)!r} holds no optimizer state (it was saved without an "
                         f"optimizer): load it with optimizer=None, or save with save_checkpoint(path, model, "
                         f"optimizer)")
    state = {}
    for local, p in model.named_parameters():
        names, splits = model.PARAMS[local]
        full = ckpt.optimizer_state(ckpt.alias[names[0]])
        if full:
            state[p] = {k: piece(v, splits).clone() if k in ckpt.opt_pieces.get(ckpt.alias[names[0]], {}) else v
                        for k, v in full.items()}
    if hasattr(optimizer, "load_consolidated_state"):
        optimizer.load_consolidated_state(state, [dict(g) for g in ckpt.groups])
        return
    groups = optimizer.param_groups
    if len(groups) != len(ckpt.groups):
        raise ValueError(f"the optimizer has {len(groups)} parameter groups but checkpoint {str(ckpt.folder)!r} "
                         f"was saved with {len(ckpt.groups)}; build the optimizer's groups as when saving")
    local_of = {id(p): k for k, p in model.named_parameters()}
    index: Dict[int, int] = {}
    saved_groups = []
    for i, g in enumerate(groups):
        for p in g["params"]:
            canon = ckpt.alias[model.PARAMS[_local(local_of, p, "load_checkpoint")][0][0]]
            if ckpt.group_of.get(canon, i) != i:
                raise ValueError(f"parameter {canon!r} is in group {i} of the optimizer but was in group "
                                 f"{ckpt.group_of[canon]} when saved; build the optimizer's groups as when saving")
            index[id(p)] = len(index)
        saved_groups.append({**ckpt.groups[i], "params": [index[id(p)] for p in g["params"]]})
    optimizer.load_state_dict({"state": {index[id(p)]: s for p, s in state.items() if id(p) in index},
                               "param_groups": saved_groups})


# ---------------------------------------------------------------------- helpers
def _check_model(model, fn: str) -> None:
    if not isinstance(model, CubeModule):
        raise TypeError(f"cube.{fn} takes this rank's module from cube.load_model(), got "
                        f"{type(model).__name__}; for the single-device model use merge_checkpoint and "
                        f"model.load_state_dict")


def _local(local_of: Dict[int, str], p: torch.Tensor, fn: str) -> str:
    if id(p) not in local_of:
        raise ValueError(f"cube.{fn}: the optimizer holds a tensor of shape {list(p.shape)} that is not a "
                         f"parameter of the model; build the optimizer over model.parameters()")
    return local_of[id(p)]


def _rank_world() -> Tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _model_name(cls: type) -> str:
    """The user's model class name (generated docstrings start with it)."""
    doc = (cls.__doc__ or "").split(",")[0].strip()
    return doc if doc.isidentifier() else cls.__name__


def _full_shape(pieces: Sequence[Tuple[list, tuple]]) -> tuple:
    """The full shape bounding ``(splits, piece shape)`` pieces: exact where they cover it.

    A dim some piece does not split has that piece's size; a split dim ends
    where the furthest piece ends.
    """
    ndim = len(pieces[0][1])
    size = [0] * ndim
    exact = [None] * ndim
    for splits, shape in pieces:
        offset = [0] * ndim
        for dim, start, _ in splits:
            offset[dim] += start
        for d in range(ndim):
            size[d] = max(size[d], offset[d] + shape[d])
            if d not in {s[0] for s in splits}:
                exact[d] = shape[d]
    return tuple(e if e is not None else s for e, s in zip(exact, size))


def _portable(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy holding only its own elements (a saved view would drag its whole storage)."""
    t = t.detach().cpu()
    if t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
    return t


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
