"""The host's other work: how many other programs compete for the cores now (Linux ``/proc``).

CPU ranks share the host's cores with whatever else runs. With autogroup
scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, the Linux default)
the kernel shares CPU time fairly between sessions, so the competitors are the
other sessions with a runnable thread; without it, the other runnable threads.
``Sampler`` counts them every ``interval`` seconds in a background thread,
leaving out this process and the given processes and their children; its mean
is the ``background`` the simulator shares the cores with, and what
communication calibration and the profiler correct their measurements for.
Where ``/proc`` is missing the count is 0.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Sequence, Tuple


@dataclass(frozen=True)
class Host:
    """How ranks share one host's CPU cores (``simulate(host=None)``: each rank has a device of its own).

    Attributes:
        cores: the host's cores.
        comm_cpu: how much of a core a rank's running collective asks for (gloo moves data with the CPU).
        background: other programs competing for the cores (``Sampler``).
        per_rank: the kernel shares the cores fairly between ranks (each torchrun rank is a session, and
            autogroup scheduling shares between sessions), else between threads.
    """

    cores: float
    comm_cpu: float = 1.0
    background: float = 0.0
    per_rank: bool = True

    def loaded(self, background: float) -> "Host":
        """The same host with ``background`` other programs competing."""
        return replace(self, background=background)


def this_host() -> Host:
    """This machine as ``Host``: its cores and whether the kernel shares them between sessions."""
    return Host(float(os.cpu_count() or 1), 1.0, 0.0, autogroups())


def autogroups() -> bool:
    """Whether the kernel shares CPU time between sessions (autogroup scheduling)."""
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def competing(exclude: Iterable[int] = ()) -> int:
    """Other programs competing for the cores now: sessions (autogroups) with a runnable thread, or
    runnable threads without autogroup scheduling; this process, ``exclude`` and their children left out."""
    parent: Dict[int, int] = {}
    running: Dict[int, int] = {}
    group: Dict[int, str] = {}
    by_group = autogroups()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[pid] = int(f.read().rsplit(")", 1)[1].split()[1])
            n = 0
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    n += f.read().rsplit(")", 1)[1].split()[0] == "R"
            running[pid] = n
            if by_group and n:
                with open(f"/proc/{pid}/autogroup") as f:
                    group[pid] = f.read().split()[0]
        except (OSError, IndexError, ValueError):
            continue
    mine = set(exclude) | {os.getpid()}
    for pid in pids:
        chain, p = [], pid
        while p in parent and p not in mine and len(chain) < 64:
            chain.append(p)
            p = parent[p]
        if p in mine:
            mine.update(chain)
    others = {pid: n for pid, n in running.items() if pid not in mine and n}
    if by_group:
        return len({group.get(pid, pid) for pid in others})
    return sum(others.values())


class Sampler(threading.Thread):
    """Samples ``competing(exclude)`` every ``interval`` seconds until ``stop()``.

    ``samples`` holds ``(time.time(), count)`` pairs.
    """

    def __init__(self, exclude: Iterable[int] = (), interval: float = 0.5):
        super().__init__(daemon=True)
        self.exclude: List[int] = list(exclude)
        self.interval = interval
        self.samples: List[Tuple[float, int]] = []
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.time(), competing(self.exclude)))

    def stop(self) -> None:
        self._stop.set()

    def mean(self) -> float:
        """Stops sampling; the mean count (0 without samples)."""
        self.stop()
        return statistics.mean(n for _, n in self.samples) if self.samples else 0.0

    def during(self, spans: Sequence[Tuple[float, float]]) -> float:
        """The mean count of the samples taken within ``spans`` (``time.time()`` pairs); the
        overall mean when none falls inside."""
        inside = [n for t, n in self.samples if any(a <= t <= b for a, b in spans)]
        return statistics.mean(inside) if inside else self.mean()
