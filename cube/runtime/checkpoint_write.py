"""Writing a checkpoint's files: crash-safe, at once or in the background (``async_save=True``).

One save, on every rank (``cube.save_checkpoint`` drives it):

1. **agree** (:func:`agree`, collective): rank 0 removes the directory's
   ``meta.json`` and the ranks agree on a token for this save
   (``all_gather_object``, also a barrier). No rank writes into the directory
   before an older ``meta.json`` there is gone, so a directory with a
   ``meta.json`` never names files of two saves.
2. **snapshot** (the caller's thread): the rank's tensors and its small record
   (``rank{r}.pt``'s bytes, serialized now). An asynchronous save copies every
   tensor to host memory here (pinned memory for CUDA tensors), so training may
   change the originals as soon as the call returns.
3. **write** (:func:`write_rank`): ``rank{r}.safetensors`` then ``rank{r}.pt``,
   each through a temporary file, fsync and rename, hashed (sha256) while it is
   written.
4. **commit**: ``meta.json`` (world size, every file's size and sha256, the
   token, the time) is written last, by rank 0, once every rank's files are
   written; it is what makes the directory a checkpoint. A synchronous save
   gathers the checksums with ``all_gather_object``. An asynchronous one may not
   use the process group from another thread (its collectives would interleave
   with training's), so each rank writes a marker file ``.rank{r}.done.json``
   (its token and checksums, or its error) and rank 0's writer waits for every
   rank's marker of this token, then writes ``meta.json`` and removes the markers.

A crash at any point leaves either the complete new checkpoint or a directory
without ``meta.json``, which every reader refuses ("incomplete: meta.json is
missing"); earlier checkpoints in other directories are untouched, and
:func:`latest_checkpoint` finds the newest complete one. ``FAULT`` (tests
only) is called at named points of steps 3 and 4 so a test can kill the process
there.

Asynchronous saves: one at a time per rank. The next ``save_checkpoint`` and
``cube.wait_checkpoint()`` wait for the rank's previous save and raise its
failure as a :class:`cube.errors.CheckpointError`; the writer thread is not a
daemon, so the interpreter waits for it at exit, and a failure nobody waited
for is printed then.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import torch
import torch.distributed as dist

from cube.errors import CheckpointError
from cube.runtime import safetensors_file as sfile
from cube.runtime.utils import atomic_write

META = "meta.json"
COMMIT_TIMEOUT_S = 1800.0   # how long rank 0's writer waits for the other ranks' files of an asynchronous save
FAULT: Optional[Callable[[str], None]] = None   # tests: called with "before|during|after <file>" (module docstring)


def _point(name: str) -> None:
    if FAULT is not None:
        FAULT(name)


@dataclass(eq=False)
class Snapshot:
    """What one rank writes for one save, independent of the live model (for an asynchronous save).

    Attributes:
        folder: the checkpoint directory.
        rank, world: this rank and the world size of the plan saving.
        token: this save's token (every rank's is rank 0's).
        meta: ``meta.json``'s fields besides files, token and time (format, model).
        entries: the rank's tensors for ``rank{r}.safetensors``.
        record: ``rank{r}.pt``'s bytes.
    """

    folder: Path
    rank: int
    world: int
    token: str
    meta: dict
    entries: List[sfile.Entry]
    record: bytes

    @property
    def names(self) -> tuple:
        return f"rank{self.rank}.safetensors", f"rank{self.rank}.pt"


# ---------------------------------------------------------------------- the steps of a save
def agree(folder: Path, rank: int, world: int) -> str:
    """Step 1 (collective): the save's token; rank 0 has removed an older ``meta.json`` when it returns."""
    token = uuid.uuid4().hex
    if rank == 0:
        try:
            (folder / META).unlink()   # the directory is incomplete until the new meta.json
        except FileNotFoundError:
            pass
    if dist.is_initialized() and world > 1:
        every: list = [None] * world
        dist.all_gather_object(every, (token, str(folder.resolve())))
        token = every[0][0]
        paths = sorted({p for _, p in every})
        if len(paths) > 1:
            raise ValueError(f"cube.save_checkpoint: the ranks passed different paths {paths}; every rank must "
                             f"pass the same directory (on a file system they share), whose meta.json rank 0 "
                             f"writes once all have saved")
    return token


_HOST: Dict[int, Dict[str, torch.Tensor]] = {}   # rank -> host buffers of its last asynchronous save, reused


def host_copies(entries: Sequence[sfile.Entry], rank: int) -> List[sfile.Entry]:
    """Step 2 of an asynchronous save: each tensor copied to host memory now.

    The buffers (pinned memory for CUDA tensors, so the copies run at full
    speed) are kept for the rank's next asynchronous save, which reuses those of
    the same name, dtype and shape: pinning memory costs more than copying into
    it. The rank's previous save is finished when this runs (``save_checkpoint``
    waits for it first), so no writer reads them any more.
    """
    pool = _HOST.setdefault(rank, {})
    kept: Dict[str, torch.Tensor] = {}
    out, cuda = [], False
    for e in entries:
        t = e.make().detach()
        c = pool.get(e.name)
        pin = t.device.type == "cuda"
        if c is None or c.dtype != t.dtype or c.shape != t.shape or c.is_pinned() != pin:
            c = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
        c.copy_(t, non_blocking=pin)
        cuda = cuda or pin
        kept[e.name] = c
        out.append(sfile.Entry(e.name, e.dtype, e.shape, lambda c=c: c))
    _HOST[rank] = kept
    if cuda:
        torch.cuda.synchronize()
    return out


class _Hashing:
    """A file being written, hashed as it is; calls ``during`` after the first write."""

    def __init__(self, f, during: Callable[[], None]):
        self.f, self.during, self.hash, self.size = f, during, hashlib.sha256(), 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.hash.update(data)
        self.size += len(memoryview(data).cast("B"))
        if self.during is not None:
            during, self.during = self.during, None
            self.f.flush()
            during()
        return n

    def flush(self) -> None:
        self.f.flush()

    def fileno(self) -> int:
        return self.f.fileno()


def write_file(folder: Path, name: str, write: Callable) -> dict:
    """Writes ``folder/name`` atomically through ``write(file)``; its ``{"sha256", "bytes"}``."""
    _point(f"before {name}")
    box = {}

    def hashed(f):
        h = _Hashing(f, lambda: _point(f"during {name}"))
        write(h)
        box.update(sha256=h.hash.hexdigest(), bytes=h.size)

    atomic_write(folder / name, hashed)
    _point(f"after {name}")
    return box


def write_rank(snap: Snapshot) -> Dict[str, dict]:
    """Step 3: the rank's two files; ``{file name: {"sha256", "bytes"}}``."""
    data, name = snap.names
    half = len(snap.record) // 2
    return {data: write_file(snap.folder, data, lambda f: sfile.write(f, snap.entries)),
            name: write_file(snap.folder, name, lambda f: (f.write(snap.record[:half]), f.write(snap.record[half:])))}


def _write_meta(snap: Snapshot, files: Dict[str, dict]) -> None:
    meta = {**snap.meta, "world_size": snap.world, "token": snap.token, "saved_ns": time.time_ns(),
            "files": dict(sorted(files.items()))}
    text = json.dumps(meta, indent=1).encode()
    write_file(snap.folder, META, lambda f: (f.write(text[:len(text) // 2]), f.write(text[len(text) // 2:])))


def commit_sync(snap: Snapshot, files: Dict[str, dict]) -> None:
    """Step 4 of a synchronous save (collective): rank 0 writes ``meta.json`` once every rank has written."""
    every = [files]
    if dist.is_initialized() and snap.world > 1:   # also the barrier: every rank has written its files
        every = [None] * snap.world
        dist.all_gather_object(every, files)
    if snap.rank == 0:
        _write_meta(snap, {n: v for f in every for n, v in f.items()})


def _marker(rank: int) -> str:
    return f".rank{rank}.done.json"


def _commit_async(snap: Snapshot, files: Optional[Dict[str, dict]], error: Optional[str]) -> None:
    """Step 4 of an asynchronous save, in the writer thread (module docstring)."""
    note = {"token": snap.token, "files": files} if error is None else {"token": snap.token, "error": error}
    write_file(snap.folder, _marker(snap.rank), lambda f: f.write(json.dumps(note).encode()))
    if snap.rank != 0 or error is not None:
        return
    every: Dict[int, dict] = {}
    deadline, pause = time.monotonic() + COMMIT_TIMEOUT_S, 0.005
    while len(every) < snap.world:
        for r in range(snap.world):
            if r in every:
                continue
            try:
                note = json.loads((snap.folder / _marker(r)).read_text())
            except (FileNotFoundError, ValueError):   # not there yet, or an older one being replaced
                continue
            if note.get("token") != snap.token:
                continue
            if "error" in note:
                raise CheckpointError(f"rank {r} could not write its files: {note['error']}")
            every[r] = note["files"]
        if len(every) < snap.world:
            if time.monotonic() > deadline:
                missing = [r for r in range(snap.world) if r not in every]
                raise CheckpointError(f"rank(s) {missing} did not write their files within {COMMIT_TIMEOUT_S:.0f} s "
                                      f"(no {_marker(missing[0])} of this save): a rank died or its disk stalls")
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
    _write_meta(snap, {n: v for r in range(snap.world) for n, v in every[r].items()})
    for r in range(snap.world):
        try:
            (snap.folder / _marker(r)).unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------- saves in the background
@dataclass(eq=False)
class _Job:
    snap: Snapshot
    thread: Optional[threading.Thread] = None
    error: Optional[BaseException] = None
    reported: bool = False
    done: threading.Event = field(default_factory=threading.Event)


_JOBS: Dict[int, _Job] = {}   # rank -> its save in the background (the in-process world: one per rank thread)
_JOBS_LOCK = threading.Lock()


def _run(job: _Job) -> None:
    try:   # Linux: a thread's own nice value; the writer yields the cores to training where they are shared
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    try:
        files, error = None, None
        try:
            files = write_rank(job.snap)
        except BaseException as e:   # noqa: BLE001 - told to rank 0 through the marker, raised at the next call
            error = e
        _commit_async(job.snap, files, None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
    except BaseException as e:   # noqa: BLE001 - kept for the next save / wait_checkpoint
        job.error = e
    finally:
        job.done.set()


def start(snap: Snapshot) -> None:
    """Steps 3 and 4 in a writer thread; returns at once (the rank's previous save must be waited for)."""
    job = _Job(snap)
    job.thread = threading.Thread(target=_run, args=(job,), name=f"cube-checkpoint-rank{snap.rank}", daemon=False)
    with _JOBS_LOCK:
        if snap.rank in _JOBS:
            raise CheckpointError(f"rank {snap.rank} started a save while its previous one is in flight")
        _JOBS[snap.rank] = job
    job.thread.start()


def pending(rank: int) -> bool:
    """Whether rank ``rank`` has an asynchronous save not yet waited for."""
    return rank in _JOBS


def writing(rank: int) -> bool:
    """Whether rank ``rank``'s asynchronous save is still being written (its writer has not finished)."""
    job = _JOBS.get(rank)
    return job is not None and not job.done.is_set()


def wait(rank: int) -> None:
    """Waits for rank ``rank``'s asynchronous save, if any, and raises its failure.

    Raises:
        CheckpointError: the save failed; its directory has no ``meta.json`` (the previous complete
            checkpoint stands).
    """
    with _JOBS_LOCK:
        job = _JOBS.get(rank)
    if job is None:
        return
    job.done.wait()
    if job.thread is not None:
        job.thread.join()
    with _JOBS_LOCK:
        if _JOBS.get(rank) is job:
            del _JOBS[rank]
    if job.error is not None:
        job.reported = True
        raise CheckpointError(f"the asynchronous save of {str(job.snap.folder)!r} on rank {rank} failed: "
                              f"{type(job.error).__name__}: {job.error}. That directory is not a checkpoint (no "
                              f"{META}); the previous complete one stands (cube.latest_checkpoint)") from job.error


@atexit.register
def _report_at_exit() -> None:
    """Runs after the interpreter joined the writer threads: a failure nobody waited for is printed."""
    for rank, job in list(_JOBS.items()):
        if job.error is not None and not job.reported:
            print(f"cube: the asynchronous save of {str(job.snap.folder)!r} on rank {rank} failed: "
                  f"{type(job.error).__name__}: {job.error}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- finding checkpoints
def complete(folder: Path) -> Optional[dict]:
    """``meta.json`` of ``folder`` when it is there and every file it lists has its size, else None
    (the checksums are checked when the checkpoint is read)."""
    try:
        meta = json.loads((folder / META).read_text())
        files = meta["files"]
        if not all((folder / n).stat().st_size == v["bytes"] for n, v in files.items()):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def latest_checkpoint(root: Union[str, os.PathLike]) -> Optional[Path]:
    """The newest complete checkpoint in ``root`` or its subdirectories, or None.

    A directory counts when its ``meta.json`` is there and every file it lists
    has the size it lists; partial saves (a crash before ``meta.json``) are
    skipped. Newest: the latest time a ``meta.json`` records (its file's
    modification time for checkpoints of an older cube), then the name
    (``step10`` after ``step9``).

    Args:
        root: a directory holding checkpoint directories (``ckpt/`` of ``ckpt/step100``).

    Raises:
        ValueError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"cube.latest_checkpoint: {str(root)!r} is not a directory; pass the directory that "
                         f"holds the checkpoint directories")
    best, key = None, None
    for d in [root, *sorted(p for p in root.iterdir() if p.is_dir())]:
        meta = complete(d)
        if meta is None:
            continue
        when = meta.get("saved_ns") or (d / META).stat().st_mtime_ns
        k = (int(when), _natural(d.name))
        if key is None or k > key:
            best, key = d, k
    return best
