"""What communication costs beyond its alpha-beta when the ranks come to it from computing.

``cube.sim.comm`` times each collective back to back after a barrier: its members arrive together,
with nothing else to run. In a program they come from computing. Where CPU ranks outnumber the cores,
the kernel time-slices them, so they reach a collective at different times, and every rank left
waiting has to be woken again. On a 2-core host with 4 gloo ranks, a burst of 5-20 ms of compute,
then an all-reduce of 1 MiB over all four, took 9-13 ms more a step than the bursts alone. The
engine's fair sharing of the cores charges 6.8 ms for it. Within pairs of the four ranks, it took 5-6
ms against 3.0 ms charged. On 2 ranks and 2 cores, there was no such excess.

``measure`` (run by every rank of a calibration job, on CPU) times three loops:
- bursts of compute alone (``BURST`` seconds of CPU each);
- bursts, each followed by a small all-reduce in every group of ``n`` ranks (the world cut into
  groups of ``n``);
- bursts, each followed by an exchange of messages between the ranks of each pair.

Each loop's time is the wall time per iteration of the bursts alone (the median over repeats) plus
the median of its excess over them within a repeat (the loops alternate; the host's speed drifts
between repeats), on the slowest rank.

``fit`` runs the same loops in the engine (``cube.sim.engine`` with the host's sharing). The cost of a
burst is what makes the bursts alone match. The arrival cost of a collective (of a message) is what
the engine must add to each one for its loop to match. The costs are at least 0: communication
after compute that runs faster than back to back is left at its alpha-beta.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

from cube.sim.engine import run
from cube.sim.host import Host
from cube.sim.instructions import Ins, Program

BURST = 10e-3         # seconds of CPU per burst: about what a layer's share of a step computes here
ITERS = 6             # bursts per timed loop
NBYTES = 64 * 1024    # the all-reduce and the message: small, so latency dominates


def groups_of(world: int, n: int) -> List[Tuple[int, ...]]:
    """The world cut into consecutive groups of ``n`` ranks (``n`` divides ``world``)."""
    return [tuple(range(k, k + n)) for k in range(0, world, n)]


def group_of(world: int, n: int, rank: int) -> Tuple[int, ...]:
    """The group of ``groups_of(world, n)`` that holds ``rank``."""
    k = rank - rank % n
    return tuple(range(k, k + n))


def groups(world: int, sizes: Sequence[int]) -> List[Tuple[int, ...]]:
    """Every group the loops communicate in (to create up front, on every rank)."""
    return sorted({g for n in sizes for g in groups_of(world, n)})


def sizes_for(world: int, sizes: Sequence[int]) -> List[int]:
    """The group sizes among ``sizes`` that cut the world into whole groups."""
    return sorted({n for n in sizes if 2 <= n <= world and world % n == 0})


def _burst() -> Callable[[], None]:
    """A callable that computes for about ``BURST`` seconds of this thread's CPU."""
    import torch
    a, b = torch.rand(128, 128), torch.rand(128, 128)
    t0 = time.thread_time()
    for _ in range(50):
        a @ b
    per = max((time.thread_time() - t0) / 50, 1e-7)
    reps = max(1, round(BURST / per))

    def burst():
        for _ in range(reps):
            a @ b
    return burst


def measure(rank: int, world: int, sizes: Sequence[int], all_reduce: Callable, repeats: int = 9) -> dict:
    """Times the loops (see the module docstring) on this rank of a gloo job.

    Args:
        all_reduce: ``all_reduce(x, ranks)`` over a group created beforehand (``groups``).
        sizes: the group sizes to time collectives in (``sizes_for``).

    Returns:
        ``{"none": s, "coll": {n: s}, "p2p": s}``: seconds per iteration, the same on every rank.
    """
    import torch
    import torch.distributed as dist
    burst = _burst()
    x = torch.rand(NBYTES // 4)
    buf = torch.empty_like(x)
    partner = rank ^ 1 if world % 2 == 0 else None

    def exchange():
        req = dist.isend(x, partner)
        dist.recv(buf, partner)
        req.wait()

    loops: Dict[str, Callable[[], None]] = {"none": lambda: None}
    for n in sizes:
        loops[f"coll{n}"] = lambda mine=group_of(world, n, rank): all_reduce(x, mine)
    if partner is not None:
        loops["p2p"] = exchange
    times: Dict[str, List[float]] = {k: [] for k in loops}
    for _ in range(repeats):
        for name, after in loops.items():   # alternating, so a drift of the host's speed hits all alike
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(ITERS):
                burst()
                after()
            times[name].append((time.perf_counter() - t0) / ITERS)
    # each loop as the bursts alone and the median of its excess over them within a repeat: the host's
    # speed drifts between repeats, and the excess is a small difference of two long times
    names = list(loops)
    base = statistics.median(times["none"])
    t = torch.tensor([base + statistics.median(a - b for a, b in zip(times[k], times["none"])) if k != "none"
                      else base for k in names], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    got = dict(zip(names, t.tolist()))
    return {"none": got["none"], "coll": {n: got[f"coll{n}"] for n in sizes}, "p2p": got.get("p2p")}


def _loop(world: int, burst: float, after: str, n: int = 0, dur: float = 0.0) -> Dict[int, Program]:
    """The timed loop as the ranks' programs: ``after`` each burst, "none", "coll" (a collective of
    ``dur`` in each group of ``n``) or "p2p" (each pair exchanges messages of ``dur``)."""
    programs = {}
    for r in range(world):
        ins: List[Ins] = []
        g = group_of(world, n, r) if after == "coll" else ()
        for i in range(ITERS):
            ins.append(Ins("compute", burst, label="burst"))
            if after == "coll":
                ins.append(Ins("coll", dur, (g, i), g, "all_reduce", "comm", NBYTES))
            elif after == "p2p":
                p = r ^ 1
                ins.append(Ins("send", dur, ((r, p), i), label="send", cat="comm", nbytes=NBYTES))
                ins.append(Ins("recv", key=((p, r), i), label="recv", cat="comm"))
        programs[r] = Program(r, ins, {}, [])
    return programs


def _per_iter(programs: Dict[int, Program], host: Host) -> float:
    ends, _, _ = run(programs, host)
    return max(ends.values()) / ITERS


def _solve(measured: float, simulated: Callable[[float], float]) -> float:
    """The extra cost ``a >= 0`` at which ``simulated(a)`` (nondecreasing) reaches ``measured``."""
    if simulated(0.0) >= measured:
        return 0.0
    lo, hi = 0.0, measured
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < measured else (lo, mid)
    return (lo + hi) / 2


def fit(times: dict, world: int, host: Host, coll_cost: Callable[[int], float],
        p2p_cost: float) -> Tuple[Dict[int, float], float]:
    """The arrival costs from ``measure``'s times: ``({group size: seconds per collective}, seconds
    per message)``.

    Args:
        host: the measuring job's host (its cores, its sharing, the other programs beside it).
        coll_cost: group size -> the alpha-beta cost of the loops' all-reduce.
        p2p_cost: the alpha-beta cost of the loops' message.
    """
    burst = times["none"] / _per_iter(_loop(world, 1.0, "none"), host)   # the engine scales linearly
    coll = {int(n): _solve(t, lambda a, n=int(n): _per_iter(_loop(world, burst, "coll", n, coll_cost(n) + a), host))
            for n, t in times["coll"].items()}
    p2p = 0.0
    if times.get("p2p") is not None:
        p2p = _solve(times["p2p"], lambda a: _per_iter(_loop(world, burst, "p2p", dur=p2p_cost + a), host))
    return coll, p2p


def refit(model, times: dict, world: int, host: Host):
    """A copy of the communication model ``model`` (``cube.sim.comm.CommModel``) with its arrival costs
    fitted to ``measure``'s ``times`` (its alpha-beta kept)."""
    from dataclasses import replace
    bare = replace(model, arrival={}, p2p_arrival=0.0)
    coll, p2p = fit(times, world, host, lambda n: bare.cost("all_reduce", NBYTES, n), bare.cost("p2p", NBYTES, 2))
    return replace(bare, arrival=coll, p2p_arrival=p2p)
