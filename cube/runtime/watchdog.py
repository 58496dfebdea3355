"""Hangs that name themselves: a rank stuck in a step says where, and the job stops.

A rank waiting for a peer that never comes (a collective one rank skipped, a
send nobody receives, a stuck data loader on another rank) would otherwise
wait until the backend's timeout (30 minutes for gloo and NCCL by default) or
an outer one, saying nothing. ``cube.init()`` starts a watchdog thread on every
rank of a multi-rank job. The compiled step and the checkpoint calls run
inside :func:`watched` regions; when the calling thread has been in one
region for longer than the timeout (``CUBE_HANG_TIMEOUT`` seconds, default
1800; ``0`` turns the watchdog off), the watchdog

1. prints ``cube: rank r made no progress for T s in step S (micro-batch m)``,
   what the rank waits in (the innermost frame: a collective, a receive, a
   loader's ``__next__``), the line of the generated code it came from (which
   names the collective or send and its ranks) and the thread's whole stack;
2. reports the hang through the process group's store (``cube.runtime.failfast``),
   so the other ranks stop within a second too, each printing where it was;
3. ends the process with exit code 1, so ``torchrun --max-restarts`` restarts
   the job (from the latest checkpoint).

The timeout must exceed the longest step (the first step of a
``torch.compile``d plan compiles too); the check costs a thread that wakes
once a second.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

from cube.runtime import failfast, session

EXIT_CODE = 1
_LIBRARIES = (os.sep + "torch" + os.sep, os.sep + "cube" + os.sep + "runtime" + os.sep, "threading.py", "<frozen")


@dataclass(eq=False)
class _Region:
    what: str
    thread: int
    since: float
    state: object


_state = {"rank": None, "timeout": 0.0, "region": None, "thread": None}


def install(rank: int, timeout: float) -> None:
    """Starts the watchdog on this rank (once; ``timeout`` <= 0: none)."""
    if _state["thread"] is not None or timeout <= 0:
        return
    _state.update(rank=rank, timeout=float(timeout))
    thread = threading.Thread(target=_watch, name="cube-watchdog", daemon=True)
    _state["thread"] = thread
    thread.start()


def active() -> bool:
    """Whether a watchdog runs in this process."""
    return _state["thread"] is not None


@contextmanager
def watched(what: str) -> Iterator[None]:
    """Marks the block as a region the watchdog times (``what``: e.g. ``"step 3"``); blocks nest, the
    innermost names the region. Nothing is done without a watchdog."""
    if _state["thread"] is None:
        yield
        return
    outer = _state["region"]
    region = _state["region"] = _Region(what, threading.get_ident(), time.monotonic(), session.current())
    try:
        yield
    except BaseException:   # a peer's failure reached this rank here (its error): say where it was
        _state["failed_in"] = _head(region)
        raise
    finally:
        _state["region"] = outer
        if outer is not None:   # the inner region finished: that is progress
            outer.since = time.monotonic()


def _head(region: _Region) -> str:
    micro = getattr(getattr(region.state, "p2p", None), "micro", 0)
    return f"{region.what} (micro-batch {micro})"


def failed_in() -> Optional[str]:
    """The region an exception left last (``"step 3 (micro-batch 1)"``), or None."""
    return _state.get("failed_in")


def where(region: Optional[_Region] = None) -> Optional[str]:
    """Where this rank is: its region, micro-batch, what it waits in and its stack (None outside regions)."""
    region = region or _state["region"]
    if region is None:
        return None
    frame = sys._current_frames().get(region.thread)
    stack = traceback.extract_stack(frame) if frame is not None else []
    head = _head(region)
    generated = {str(s.path) for s in session.steps() if getattr(s, "path", None)}
    gen = next((f for f in reversed(stack) if f.filename in generated), None)
    inner = stack[-1] if stack else None
    waits = ""
    if inner is not None:
        waits = f": waiting in {inner.name} ({inner.filename}:{inner.lineno}: {inner.line})"
    if gen is not None:
        waits += f", called from the generated code {gen.filename}:{gen.lineno}: {gen.line}"
    else:   # outside a compiled step's code: the innermost line of the script's own code
        own = next((f for f in reversed(stack[:-1]) if not any(p in f.filename for p in _LIBRARIES)), None)
        if own is not None:
            waits += f", called from {own.filename}:{own.lineno}: {own.line}"
    return f"{head}{waits}\n" + "".join(traceback.format_list(stack))


def _watch() -> None:
    timeout = _state["timeout"]
    while True:
        time.sleep(min(1.0, timeout / 4))
        region = _state["region"]
        if region is None or time.monotonic() - region.since <= timeout:
            continue
        text = where(region)
        rank = _state["rank"]
        print(f"cube: rank {rank} made no progress for {timeout:.0f} s (CUBE_HANG_TIMEOUT) in {text}"
              f"cube: stopping rank {rank}: a peer it waits for does not come (a skipped collective or send, a "
              f"stuck data loader or a dead rank); raise CUBE_HANG_TIMEOUT if a step may take longer",
              file=sys.stderr, flush=True)
        failfast.report(f"no progress for {timeout:.0f} s in {text.splitlines()[0]}")
        os._exit(EXIT_CODE)
