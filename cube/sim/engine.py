"""Runs the ranks' programs together: a discrete-event simulation of one step.

Each rank has a compute stream (its program, in order) and a communication
stream (a queue of collectives, served in order). A collective starts when it
is at the head of every member's queue and their streams are free, and takes
its cost on all of them; a blocking one holds the rank's program until it ends,
an asynchronous one (gradient buckets, ZeRO gathers) runs beside compute. A
send is posted (its message arrives after the point-to-point cost) and a
receive waits for it.

A GPU rank's host issues its kernels ahead of the device: each rank keeps a
host clock that each compute instruction's ``host`` seconds advance (the host
never waits for the device), and an instruction cannot end before the host has
issued it. A device busier than its host hides the dispatch; a host slower
than its device leaves the device idle between kernels.

CPU ranks on one host (``cube.sim.host.Host``) share its cores: each rank asks
for one core while it computes and ``comm_cpu`` more while a collective of it
runs (gloo moves data with the CPU), and ``background`` other programs ask for
one each. The kernel shares the cores fairly between ranks (``per_rank``: each
torchrun rank is a session of its own, and Linux's autogroup scheduling shares
between sessions; a rank's compute and communication then split its share),
or between threads; compute, and collectives when ``comm_cpu`` is set, slow
down in proportion (a collective at the pace of its slowest member). Op and
collective costs are those of an idle host (the profiler and ``cube.sim.comm``
measure them so).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Dict, List, Optional

from cube.sim.host import Host
from cube.sim.instructions import Program

EPS = 1e-12


@dataclass
class Event:
    """One span of a rank's activity (``thread``: "compute" or "comm")."""

    rank: int
    thread: str
    name: str
    cat: str
    start: float
    end: float
    nbytes: int = 0


@dataclass
class Item:
    key: object
    group: tuple
    dur: float
    label: str
    cat: str
    nbytes: int
    start: float = -1.0
    end: float = -1.0
    remaining: float = 0.0


class DeadlockError(RuntimeError):
    """The programs cannot make progress (mismatched collectives or messages)."""


def shares(demand: Dict[int, float], cores: float, background: float, per_rank: bool = True) -> Dict[int, float]:
    """The fraction of its demand each rank gets (see the module docstring).

    Args:
        demand: rank -> cores it asks for now (compute 1, plus its communication).
        cores: the host's cores.
        background: other programs competing, one core each.
        per_rank: share fairly between ranks (and programs), else between threads.
    """
    busy = {r: d for r, d in demand.items() if d > 0}
    if not per_rank:
        total = sum(busy.values()) + background
        rate = min(1.0, cores / total) if total > 0 else 1.0
        return {r: rate for r in busy}
    claims = sorted([(d, 1.0) for d in busy.values()] + ([(1.0, background)] if background > 0 else []))
    level, left, weight = float("inf"), cores, sum(w for _, w in claims)
    for d, w in claims:   # water-filling: every claimant gets min(its demand, level)
        if d * weight <= left:
            left -= d * w
            weight -= w
        else:
            level = left / weight
            break
    return {r: min(d, level) / d for r, d in busy.items()}


def run(programs: Dict[int, Program], host: Optional[Host] = None):
    """Simulates the programs from time 0 (``host``: how the ranks share one host's cores, see the module
    docstring; None: each rank has its own device).

    Each time step touches only the ranks that change: those ready to start an instruction, those
    computing, the collectives running, and the blocked ranks whose release time is known (a
    receive learns it when its message is sent, a wait when its collective ends).

    Returns:
        ``(end time per rank, events, end time of every instruction per rank)``.
    """
    ranks = sorted(programs)
    ins = {r: programs[r].ins for r in ranks}
    pc = {r: 0 for r in ranks}
    state = {r: "ready" for r in ranks}
    remaining = {r: 0.0 for r in ranks}
    started = {r: 0.0 for r in ranks}
    waiting: Dict[int, tuple] = {}
    queue = {r: deque() for r in ranks}
    running: Dict[int, Optional[Item]] = {r: None for r in ranks}
    items: Dict[object, Item] = {}
    messages: Dict[object, float] = {}
    sent_until = {r: 0.0 for r in ranks}
    ends = {r: [0.0] * len(ins[r]) for r in ranks}
    events: List[Event] = []
    ready = {r for r in ranks if ins[r]}   # ranks whose next instruction may start now
    computing: set = set()
    active: Dict[int, Item] = {}           # the collectives running, by id
    queued: set = set()                    # ranks with collectives in their queue
    known: Dict[int, float] = {}           # blocked rank -> when its condition lifts
    issued = {r: 0.0 for r in ranks}       # the host's clock: when it has issued the rank's work so far
    waiters: Dict[tuple, List[int]] = {}   # a condition not met yet -> the ranks blocked on it
    left = [len(ready)]                    # ranks with instructions left
    now = 0.0

    def finish(r: int, t: float) -> None:
        i = ins[r][pc[r]]
        ends[r][pc[r]] = t
        if t - started[r] > EPS and i.op in ("compute", "coll", "recv", "wait", "flush"):
            cat = i.cat if i.op == "compute" else "comm" if i.op == "coll" else "wait"
            events.append(Event(r, "compute", i.label, cat, started[r], t, i.nbytes))
        pc[r] += 1
        state[r] = "ready"
        if pc[r] < len(ins[r]):
            ready.add(r)
        else:
            left[0] -= 1

    def item(i) -> Item:
        it = items.get(i.key)
        if it is None:   # members not simulated (symmetric copies) are taken to arrive with the others
            group = tuple(m for m in i.group if m in ins)
            it = items[i.key] = Item(i.key, group, i.dur, i.label, i.cat, i.nbytes)
        return it

    def block(r: int, cond: tuple) -> None:
        state[r], waiting[r] = "blocked", cond
        t = released(cond)
        if t is not None:
            known[r] = t
        else:
            waiters.setdefault(cond, []).append(r)

    def advance() -> bool:
        """Starts every instruction that can start now; True if anything changed."""
        changed = False
        for r in sorted(ready):
            while state[r] == "ready" and pc[r] < len(ins[r]):
                i = ins[r][pc[r]]
                started[r] = now
                changed = True
                if i.op == "compute":
                    issued[r] += i.host
                    dur = max(i.dur, issued[r] - now)   # it ends once issued, at the earliest
                    if dur <= 0:
                        finish(r, now)
                    else:
                        state[r], remaining[r] = "compute", dur
                        computing.add(r)
                elif i.op in ("coll", "launch"):
                    queue[r].append(item(i))
                    queued.add(r)
                    if i.op == "coll":
                        block(r, ("item", i.key))
                    else:
                        finish(r, now)
                elif i.op == "wait":
                    if i.key in items and items[i.key].end >= 0 and items[i.key].end <= now + EPS:
                        finish(r, now)
                    else:
                        block(r, ("item", i.key))
                elif i.op == "send":
                    messages[i.key] = now + i.dur
                    sent_until[r] = max(sent_until[r], now + i.dur)
                    for w in waiters.pop(("msg", i.key), ()):
                        known[w] = messages[i.key]
                    finish(r, now)
                elif i.op == "recv":
                    block(r, ("msg", i.key))
                elif i.op == "flush":
                    block(r, ("flush", r))
                else:
                    raise ValueError(f"unknown instruction {i.op!r}")
        ready.clear()
        for r in sorted(queued):   # start collectives at the head of all their members' queues
            if running[r] is not None or not queue[r]:
                continue
            it = queue[r][0]
            if all(queue[m] and queue[m][0] is it and running[m] is None for m in it.group):
                it.start, it.remaining = now, it.dur
                for m in it.group:
                    queue[m].popleft()
                    running[m] = it
                    if not queue[m]:
                        queued.discard(m)
                active[id(it)] = it
                changed = True
        return changed

    def released(cond: tuple) -> Optional[float]:
        """When a blocking condition lifts (None: not known yet)."""
        kind, key = cond
        if kind == "item":
            it = items.get(key)
            return it.end if it is not None and it.end >= 0 else None
        if kind == "msg":
            return messages.get(key)
        return sent_until[key]

    while True:
        while advance():
            pass
        if not left[0]:
            break
        rate: Dict[int, float] = {}
        if host is not None:
            demand = {r: (state[r] == "compute") + host.comm_cpu * (running[r] is not None) for r in ranks}
            rate = shares(demand, host.cores, host.background, host.per_rank)
        pace = {k: min(rate.get(m, 1.0) for m in it.group) if host is not None and host.comm_cpu else 1.0
                for k, it in active.items()}
        times = [now + remaining[r] / rate.get(r, 1.0) for r in computing]
        times += [now + it.remaining / pace[k] for k, it in active.items()]
        times += known.values()
        if not times:
            raise DeadlockError(_describe(ranks, ins, pc, state, waiting, queue))
        t = max(min(times), now)
        for r in computing:
            remaining[r] -= (t - now) * rate.get(r, 1.0)
        for k, it in active.items():
            it.remaining -= (t - now) * pace[k]
        now = t
        for r in sorted(computing):
            if remaining[r] <= EPS * max(1.0, now):
                computing.discard(r)
                finish(r, now)
        for k, it in list(active.items()):
            if it.remaining <= EPS * max(1.0, now):
                it.end = now
                del active[k]
                for m in it.group:
                    running[m] = None
                    events.append(Event(m, "comm", it.label, it.cat, it.start, it.end, it.nbytes))
                for w in waiters.pop(("item", it.key), ()):
                    known[w] = now
        for r in sorted(known):
            if known[r] <= now + EPS:
                del known[r], waiting[r]
                finish(r, now)
    return {r: (ends[r][-1] if ends[r] else 0.0) for r in ranks}, events, ends


def _describe(ranks, ins, pc, state, waiting, queue) -> str:
    lines = ["the ranks' programs deadlock (a collective or message some member never reaches):"]
    for r in ranks:
        if pc[r] >= len(ins[r]):
            lines.append(f"  rank {r}: done")
            continue
        i = ins[r][pc[r]]
        head = queue[r][0].key if queue[r] else None
        lines.append(f"  rank {r}: at instruction {pc[r]} {i.op} {i.label!r} key={i.key} ({state[r]}, "
                     f"waiting for {waiting.get(r)}; comm queue head {head})")
    return "\n".join(lines)
