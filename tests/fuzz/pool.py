"""Worker subprocesses that run plans in sequence, with a watchdog for hangs.

A plan runs in threads (``cube.debug.run``), which cannot be stopped; so each
plan runs in a worker process (``python -m tests.fuzz.worker``) that takes
requests on stdin and answers one JSON line per plan. The parent waits for the
answer with a deadline; past it the worker is killed (by its own pid), the
plan is a ``hang`` and the next plan starts a fresh worker.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
MARK = "@@fuzz-result "


class Worker:
    """One worker process; ``ask`` runs a plan in it (starting it when needed)."""

    def __init__(self, log: Optional[Path] = None):
        self.proc: Optional[subprocess.Popen] = None
        self.log = log

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        err = open(self.log, "ab") if self.log else subprocess.DEVNULL
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz.worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        if self.log:
            err.close()

    def ask(self, request: dict, limit: float) -> dict:
        """Runs one plan; the result dict, or a ``hang``/``crash`` result made here."""
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        start = time.monotonic()
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = limit - (time.monotonic() - start)
                if left <= 0 or not sel.select(timeout=left):
                    self.stop()
                    return _made(request, "hang", "time limit", f"no answer within {limit:.0f}s", limit)
                line = self.proc.stdout.readline()
                if not line:   # the worker died (e.g. a segfault or abort in native code)
                    code = self.proc.wait()
                    self.proc = None
                    return _made(request, "crash", "worker died", f"worker exited with {code}",
                                 time.monotonic() - start)
                if line.startswith(MARK):
                    return json.loads(line[len(MARK):])
        finally:
            sel.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _made(request: dict, outcome: str, category: str, detail: str, seconds: float) -> dict:
    return {"model": request["model"], "seed": request.get("seed"), "outcome": outcome, "category": category,
            "detail": detail, "plan": "", "seconds": round(seconds, 2)}


def run_all(requests: Iterable[dict], jobs: int = 1, limit: float = 120.0,
            on_result: Optional[Callable[[dict], None]] = None, log: Optional[Path] = None) -> List[dict]:
    """Runs every request on ``jobs`` workers; results in request order.

    Args:
        limit: seconds a plan may take before it is a ``hang``.
        on_result: called with each result as it arrives (under a lock).
        log: a file that gets the workers' stderr.
    """
    requests = list(requests)
    results: List[Optional[dict]] = [None] * len(requests)
    lock = threading.Lock()
    queue: List[Tuple[int, dict]] = list(enumerate(requests))
    queue.reverse()

    def drive() -> None:
        worker = Worker(log)
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    i, req = queue.pop()
                res = worker.ask(req, limit)
                with lock:
                    results[i] = res
                    if on_result:
                        on_result(res)
        finally:
            worker.stop()

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        for f in [ex.submit(drive) for _ in range(max(1, jobs))]:
            f.result()
    return results
