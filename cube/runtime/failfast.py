"""A rank that fails stops the others quickly, with its message.

Without this, when one rank raises (a bad batch, a user error in its part of
the script), the others wait forever in their next collective. ``install``
(called once the process group exists) makes an uncaught exception on any rank
write ``rank r failed: <error>`` to the process group's key-value store; a
daemon thread on every rank polls the store and, when another rank's failure
appears, prints that message and ends its process with exit code 1. Under
torchrun the agent also stops the other ranks; the store path is what reaches
ranks on other machines, and it carries the root cause.

If the store goes away (its host, rank 0, exited) the watcher stops quietly:
a normal end of training looks the same from the other ranks.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from typing import Optional

from cube import config

log = logging.getLogger("cube")


def key() -> str:
    """The store key of a failure: the agent's store outlives a restart under torchrun
    --max-restarts, so each attempt has its own."""
    return f"cube/failed/attempt{config.restart_attempt()}"


POLL_SECONDS = 0.5
_state = {"rank": None, "store": None, "failed_here": False, "stop": threading.Event()}


def failed_here() -> bool:
    """True once this rank reported an uncaught exception (shutdown must not wait on peers)."""
    return _state["failed_here"]


def install(rank: int, store=None) -> None:
    """Starts reporting this rank's uncaught exceptions and watching for the others' (once)."""
    if _state["rank"] is not None:
        return
    if store is None:
        from torch.distributed import distributed_c10d
        try:
            store = distributed_c10d._get_default_store()
        except Exception as e:   # no store to share failures through: the launcher has to stop the ranks
            log.debug("cube: no process group store, ranks will not stop each other on failure: %s", e)
            return
    _state.update(rank=rank, store=store)
    previous = sys.excepthook

    def hook(kind, value, tb):
        report(f"{kind.__name__}: {value}")
        previous(kind, value, tb)
        cause = _failure()
        if cause is not None and not cause.startswith(f"rank {rank} "):
            # this rank's error is a consequence (a peer hung up in a collective): name the cause
            print(f"cube: rank {rank} stopped because {cause}", file=sys.stderr, flush=True)
            _say_where()

    sys.excepthook = hook
    watcher = threading.Thread(target=_watch, name="cube-failfast", daemon=True)
    _state["thread"] = watcher
    watcher.start()


def report(message: str) -> None:
    """Tells every rank that this one failed with ``message`` (the first report wins)."""
    _state["failed_here"] = True
    store = _state["store"]
    if store is None:
        return
    try:
        store.compare_set(key(), "", f"rank {_state['rank']} failed: {message}")
    except Exception as e:   # the store's host already exited: nothing left to tell
        log.debug("cube: could not report the failure to the other ranks: %s", e)


def _failure() -> Optional[str]:
    """The first failure any rank reported, or None (also when the store is gone)."""
    store = _state["store"]
    try:
        return store.get(key()).decode() if store is not None and store.check([key()]) else None
    except Exception:
        return None


def _watch() -> None:
    store, stop, name = _state["store"], _state["stop"], key()
    while not stop.wait(POLL_SECONDS):
        try:
            if not store.check([name]):
                continue
            message = store.get(name).decode()
        except Exception:   # the store is gone (rank 0 ended): stop watching
            return
        if _state["failed_here"]:
            return
        print(f"cube: stopping rank {_state['rank']} because {message}", file=sys.stderr, flush=True)
        _say_where()
        if log.isEnabledFor(logging.DEBUG):
            traceback.print_stack(sys._current_frames().get(threading.main_thread().ident), file=sys.stderr)
        os._exit(1)


def _say_where() -> None:
    """Where this rank was when it stopped (``cube.runtime.watchdog``): the step it waits in, or the one
    its error (a peer's hang-up reaching it) came out of."""
    from cube.runtime import watchdog
    try:
        here = watchdog.where() or watchdog.failed_in()
    except Exception:   # noqa: BLE001 - the process is stopping: the message above must not be lost to this
        return
    if here:
        print(f"cube: rank {_state['rank']} was in {here}", file=sys.stderr, flush=True)


def forget() -> None:
    """Drops the store (at exit, after the process group is gone and the watcher stopped)."""
    _state["store"] = None


def uninstall() -> None:
    """Stops watching and waits for the watcher (normal shutdown, before the process group and its
    store go away: a thread still inside a store call then would crash the exiting process)."""
    _state["stop"].set()
    watcher = _state.get("thread")
    if watcher is not None and watcher is not threading.current_thread():
        watcher.join(timeout=10)

