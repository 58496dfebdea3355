"""The host's other work: how many other programs compete for the cores (Linux ``/proc``).

CPU ranks share the host's cores with whatever else runs. With autogroup
scheduling (``/proc/sys/kernel/sched_autogroup_enabled``, the Linux default)
the kernel shares CPU time fairly between sessions, so each busy session is
one claimant beside the ranks. ``Sampler`` measures, in a background thread,
the CPU time the other programs use (the machine's busy time minus that of
this process, the given processes and their children) and turns it into
competing programs, the ``background`` the simulator shares the cores with and
what communication calibration corrects its measurements for. Where ``/proc``
is missing the background is 0.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


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


def _ticks(roots: Iterable[int]) -> Optional[Tuple[int, int]]:
    """(CPU ticks the whole machine has been busy, CPU ticks of ``roots`` and their descendants)
    since boot, from ``/proc``; None where it is missing."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except (OSError, ValueError):
        return None
    busy = v[0] + v[1] + v[2] + sum(v[5:8])   # user, nice, system, irq, softirq, steal
    parent: Dict[int, int] = {}
    used: Dict[int, int] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[pid], used[pid] = int(fields[1]), int(fields[11]) + int(fields[12])   # ppid, utime + stime
        except (OSError, IndexError, ValueError):
            continue
    mine = set(roots)
    for pid in pids:
        chain, p = [], pid
        while p in parent and p not in mine and len(chain) < 64:
            chain.append(p)
            p = parent[p]
        if p in mine:
            mine.update(chain)
    return busy, sum(used.get(pid, 0) for pid in mine)


def background_of(others: float, ours: float, ranks: int, cores: float) -> float:
    """The competing programs (``Host.background``: claimants of one core each) that explain what
    was measured: the other programs used ``others`` cores on average while ours (``ranks``
    CPU-bound ranks) used ``ours``. On a saturated host the kernel's fair share gives each
    claimant the same, so ``background = ranks * others / ours``; with cores to spare the others
    take what they use and compete with nobody."""
    if others <= 0:
        return 0.0
    if ours + others >= 0.9 * cores and ours >= 0.1 * ranks:   # (ranks that hardly ran saw no contention)
        return ranks * others / ours
    return others


class Sampler(threading.Thread):
    """Measures, every ``interval`` seconds until ``stop()``, the CPU time the other programs use
    (the machine's busy time minus that of this process, ``exclude`` and their children), and
    turns it into the competing programs of ``Host.background`` (``background_of``) for any
    window: :meth:`mean` over the whole sampling, :meth:`during` over given spans.

    CPU accounting, not a count of runnable programs at sample instants: a short burst of
    another program seen at one sample would count as a whole competitor for the span.

    ``samples`` holds ``(time.time(), busy ticks, our ticks)``.
    """

    def __init__(self, exclude: Iterable[int] = (), interval: float = 0.25, ranks: Optional[int] = None):
        super().__init__(daemon=True)
        self.exclude: List[int] = list(exclude)
        self.interval = interval
        self.ranks = ranks if ranks is not None else max(1, len(self.exclude))
        self.cores = float(os.cpu_count() or 1)
        self.samples: List[Tuple[float, int, int]] = []
        self._hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._stop = threading.Event()

    def _sample(self) -> None:
        got = _ticks(self.exclude + [os.getpid()])
        if got is not None:
            self.samples.append((time.time(), *got))

    def run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval):
            self._sample()

    def stop(self) -> None:
        self._stop.set()

    def _window(self, a: float, b: float) -> Optional[Tuple[float, float, float]]:
        """(seconds, other programs' CPU seconds, ours) between the samples around [a, b]."""
        before = [s for s in self.samples if s[0] <= a] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= b] or self.samples[-1:]
        if not before or not after or after[0][0] <= before[-1][0]:
            return None
        (t0, busy0, mine0), (t1, busy1, mine1) = before[-1], after[0]
        ours = max(0.0, (mine1 - mine0) / self._hz)
        return t1 - t0, max(0.0, (busy1 - busy0) / self._hz - ours), ours

    def _background(self, windows) -> float:
        windows = [w for w in windows if w is not None]
        seconds = sum(w[0] for w in windows)
        if not seconds:
            return 0.0
        others, ours = sum(w[1] for w in windows) / seconds, sum(w[2] for w in windows) / seconds
        return background_of(others, ours, self.ranks, self.cores)

    def mean(self) -> float:
        """Stops sampling; the competing programs over the whole sampling (0 without two samples)."""
        self.stop()
        if len(self.samples) < 2:
            return 0.0
        return self._background([self._window(self.samples[0][0], self.samples[-1][0])])

    def during(self, spans: Sequence[Tuple[float, float]]) -> float:
        """The competing programs during ``spans`` (``time.time()`` pairs); the whole sampling's
        when no sample brackets them."""
        got = self._background([self._window(a, b) for a, b in spans])
        return got if any(self._window(a, b) for a, b in spans) else self.mean()
