"""Communication cost: an alpha-beta model per collective kind, calibrated on the real backend.

A collective over ``n`` ranks moving ``nbytes`` costs

    steps(n) * alpha[kind] + factor(n) * nbytes * beta[kind]

with the ring algorithms' steps and data factors:

=================  ===========  ==============  ==========================
kind               steps(n)     factor(n)       nbytes
=================  ===========  ==============  ==========================
all_reduce         2(n-1)       2(n-1)/n        the tensor
all_gather         n-1          (n-1)/n         the gathered (whole) tensor
reduce_scatter     n-1          (n-1)/n         the input (whole) tensor
all_to_all         n-1          (n-1)/n         this rank's input
p2p                1            1               the message
=================  ===========  ==============  ==========================

``calibrate`` measures the primitives exactly as ``cube.runtime.collectives``
runs them (gloo has no reduce-scatter or all-to-all; cube builds them from
all-reduce and point-to-point, and the fit absorbs that) in a short job of
new processes, fits alpha and beta per kind by least squares and caches
them (``<cache dir>/sim/comm.json``). Without calibration, defaults for the
backend are used.

gloo on CPU moves data with the CPU, so a host busy with other programs
slows it down: calibration counts the other programs competing for the cores
while it measures (``cube.sim.host``) and fits the costs of an idle host (each
time scaled by the share of the cores the measuring ranks had); the simulator
then shares the cores as they are when it runs (``simulate(host=)``).

In a program, the ranks come to a collective from computing rather than from a
barrier: on CPU, calibration also measures what a collective (a message) costs
beyond its alpha-beta then (``cube.sim.arrival``), per group size, and ``cost``
adds it.
"""
from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

import torch

from cube import config
from cube.sim.engine import shares
from cube.sim import arrival
from cube.sim.host import Host, Sampler, autogroups
from cube.sim.store import JsonStore, default_path

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")

# (alpha seconds per step, beta seconds per byte) when not calibrated
DEFAULTS = {
    "gloo": {k: (60e-6, 1 / 1.5e9) for k in KINDS},
    "nccl": {k: (8e-6, 1 / 80e9) for k in KINDS},
}


def shape_of(kind: str, n: int) -> Tuple[float, float]:
    """``(steps, factor)`` of a collective kind over ``n`` ranks (see the module docstring)."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; use one of {KINDS}")
    if kind == "p2p":
        return 1.0, 1.0
    if n <= 1:
        return 0.0, 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n
    return float(n - 1), (n - 1) / n


@dataclass
class CommModel:
    """Alpha-beta costs per collective kind.

    Attributes:
        backend: ``gloo`` or ``nccl`` (what the parameters describe).
        alpha: kind -> seconds per step (latency).
        beta: kind -> seconds per byte (inverse bandwidth).
        calibrated: whether measured on this machine.
        background: other programs' runnable threads while it was measured (the costs are corrected
            to an idle host).
        arrival: group size -> seconds a collective costs beyond alpha and beta when its members come
            to it from computing (``cube.sim.arrival``; measured on CPU hosts only).
        p2p_arrival: the same for a message.
    """

    backend: str = "gloo"
    alpha: Dict[str, float] = field(default_factory=dict)
    beta: Dict[str, float] = field(default_factory=dict)
    calibrated: bool = False
    background: float = 0.0   # other programs' runnable threads while calibrating (corrected for)
    arrival: Dict[int, float] = field(default_factory=dict)
    p2p_arrival: float = 0.0

    def __post_init__(self):
        if self.backend not in DEFAULTS:
            raise ValueError(f"CommModel: backend must be one of {sorted(DEFAULTS)}, got {self.backend!r}")
        for k, (a, b) in DEFAULTS[self.backend].items():
            self.alpha.setdefault(k, a)
            self.beta.setdefault(k, b)

    def cost(self, kind: str, nbytes: int, n) -> float:
        """Seconds of one ``kind`` collective moving ``nbytes`` over ``n`` ranks (a count, or the ranks:
        one host's network does not depend on which; 0 for one rank)."""
        n = n if isinstance(n, int) else len(n)
        steps, factor = shape_of(kind, n)
        if kind != "p2p" and n <= 1:
            return 0.0
        return steps * self.alpha[kind] + factor * nbytes * self.beta[kind] + self._arrival(kind, n)

    def _arrival(self, kind: str, n: int) -> float:
        if kind == "p2p":
            return self.p2p_arrival
        if not self.arrival:
            return 0.0
        if n in self.arrival:
            return self.arrival[n]
        near = min(self.arrival, key=lambda m: abs(math.log(m / n)))   # the nearest size measured
        return self.arrival[near]

    def to_json(self) -> dict:
        return {"backend": self.backend, "alpha": self.alpha, "beta": self.beta, "calibrated": self.calibrated,
                "background": self.background, "arrival": {str(n): a for n, a in self.arrival.items()},
                "p2p_arrival": self.p2p_arrival}

    @staticmethod
    def from_json(d: dict) -> "CommModel":
        return CommModel(d["backend"], dict(d["alpha"]), dict(d["beta"]), bool(d.get("calibrated")),
                         float(d.get("background", 0.0)),
                         {int(n): float(a) for n, a in d.get("arrival", {}).items()}, float(d.get("p2p_arrival", 0.0)))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def fit(samples: Sequence[Tuple[str, int, int, float]], backend: str = "gloo", cores: float = 0.0,
        background: float = 0.0) -> CommModel:
    """Least-squares alpha and beta per kind from ``(kind, n, nbytes, seconds)`` samples.

    Both are kept non-negative; a kind without samples keeps the backend's default.
    With ``cores``, each time is first scaled to an idle host: by the share of the
    cores that ``n`` measuring ranks had beside ``background`` other runnable threads.
    """
    model = CommModel(backend, calibrated=True)

    def share(n: int) -> float:
        return shares({r: 1.0 for r in range(n)}, cores, background)[0] if cores else 1.0
    for kind in KINDS:
        rows = [(shape_of(kind, n), b, t * share(n)) for k, n, b, t in samples if k == kind]
        if not rows:
            continue
        xs = [(s, f * b) for (s, f), b, _ in rows]
        ys = [t for _, _, t in rows]
        a, b = _nonneg_lstsq(xs, ys)
        model.alpha[kind], model.beta[kind] = a, b
    return model


def _nonneg_lstsq(xs: List[Tuple[float, float]], ys: List[float]) -> Tuple[float, float]:
    """Minimises sum((a*x0 + b*x1 - y)^2) over a, b >= 0 (2 unknowns, solved directly)."""
    s00 = sum(x0 * x0 for x0, _ in xs)
    s01 = sum(x0 * x1 for x0, x1 in xs)
    s11 = sum(x1 * x1 for _, x1 in xs)
    y0 = sum(x0 * y for (x0, _), y in zip(xs, ys))
    y1 = sum(x1 * y for (_, x1), y in zip(xs, ys))
    det = s00 * s11 - s01 * s01
    if det > 0:
        a, b = (y0 * s11 - y1 * s01) / det, (y1 * s00 - y0 * s01) / det
        if a >= 0 and b >= 0:
            return a, b
    a_only = y0 / s00 if s00 else 0.0
    b_only = y1 / s11 if s11 else 0.0
    err = lambda a, b: sum((a * x0 + b * x1 - y) ** 2 for (x0, x1), y in zip(xs, ys))  # noqa: E731
    return min([(max(a_only, 0.0), 0.0), (0.0, max(b_only, 0.0))], key=lambda p: err(*p))


# ---------------------------------------------------------------------- calibration
SIZES = (1 << 12, 1 << 16, 1 << 19, 1 << 21, 1 << 23)


def _worker(rank: int, world: int, init: str, out: str, sizes: Sequence[int], repeats: int) -> None:
    import torch.distributed as dist
    from cube.runtime import collectives as C
    torch.set_num_threads(1)
    backend = default_backend()
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    groups = sorted({2, world}) if world > 2 else [2]
    waits = arrival.sizes_for(world, groups) if backend == "gloo" else []
    C.create_groups(sorted({tuple(range(n)) for n in groups} | set(arrival.groups(world, waits))))
    samples = []

    def timed(fn, n):
        fn()
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for n in groups:
        ranks = tuple(range(n))
        member = rank < n
        for nbytes in sizes:
            numel = -(-max(nbytes // 4, n * n) // n) * n   # whole pieces for n ranks (any n, 3 too)
            x = torch.rand(numel, device=device)
            fns = {"all_reduce": lambda: C._all_reduce(x, ranks),
                   "all_gather": lambda: C._all_gather(x[:x.numel() // n], ranks, 0),
                   "reduce_scatter": lambda: C._reduce_scatter(x, ranks, 0),
                   "all_to_all": lambda: C.all_to_all_data(x, ranks, 0, 0)}
            for kind, fn in fns.items():
                t = timed(fn if member else (lambda: None), n)
                samples.append((kind, n, x.numel() * 4, t))
            if n == 2:
                def p2p():
                    if rank == 0:
                        dist.send(x, 1)
                    elif rank == 1:
                        dist.recv(x, 0)
                samples.append(("p2p", 2, x.numel() * 4, timed(p2p, 2)))
    times = arrival.measure(rank, world, waits, C._all_reduce) if waits else None
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"samples": samples, "arrival": times}, f)
    dist.barrier()
    dist.destroy_process_group()


def calibrate(world: int = 2, sizes: Sequence[int] = SIZES, repeats: int = 7, timeout: float = 300) -> CommModel:
    """Measures the collectives over ``world`` new processes and fits the model (not cached).

    Raises:
        ValueError: ``world < 2``.
        RuntimeError: a measuring process failed (its output is shown).
    """
    if world < 2:
        raise ValueError(f"calibrate needs at least 2 processes, got world={world}")
    root = str(Path(__file__).resolve().parents[2])
    env = config.child_env(root)
    with tempfile.TemporaryDirectory() as tmp:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = os.path.join(tmp, "samples.json")
        code = (f"from cube.sim.comm import _worker; _worker({{r}}, {world}, 'tcp://127.0.0.1:{port}', {out!r}, "
                f"{list(sizes)!r}, {repeats})")
        procs = [subprocess.Popen([sys.executable, "-c", code.replace("{r}", str(r))], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)   # a session per rank, as torchrun starts them
                 for r in range(world)]
        sampler = Sampler([p.pid for p in procs])
        sampler.start()
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
        background = sampler.mean()
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError("calibrating the collectives failed:\n" + "\n".join(x[-2000:] for x in logs))
        with open(out) as f:
            got = json.load(f)
    backend = default_backend()
    cores = float(os.cpu_count() or 1) if backend == "gloo" else 0.0
    model = fit([tuple(s) for s in got["samples"]], backend, cores, background)
    model.background = background
    if got["arrival"]:
        model = arrival.refit(model, got["arrival"], world, Host(cores, 1.0, background, autogroups()))
    return model


# a calibration measured beside more other programs than this is measured again when it is loaded
# with ``calibrate_missing``: correcting its times by the cores the ranks had assumes a collective
# slows in proportion, which latency-bound gloo steps do not (beside 1.7 other programs, a world-2
# all-reduce fitted 65 us per step where an idle host measures 1 ms)
BUSY = 0.5


def cache_key(world: int) -> str:
    """Where ``load`` keeps the calibration of ``world`` ranks on this machine and backend."""
    # idle4: with the arrival costs (cube.sim.arrival); the host's load is measured from other
    # programs' CPU time
    return f"{default_backend()}/{socket.gethostname()}/world{world}/torch{torch.__version__}/idle4"


def load(world: int = 2, calibrate_missing: bool = False, cache=None, again: bool = False) -> CommModel:
    """The calibrated model for this machine, backend and ``world`` from the cache; measured now when
    missing and ``calibrate_missing``, else the backend's defaults. A cached calibration made on a
    busy host (``BUSY``) is measured again with ``calibrate_missing``; the one made beside fewer
    other programs is kept. ``again``: measured now and cached whatever the cache holds (a shared
    host's state drifts: its collectives' costs moved by x1.5 within an hour on a 2-core VM)."""
    store = JsonStore(cache or default_path("comm"))
    key = cache_key(world)
    hit = store.get(key)
    cached = CommModel.from_json(hit) if hit is not None and not again else None
    if cached is not None and (cached.background <= BUSY or not calibrate_missing):
        return cached
    if not calibrate_missing and not again:
        return CommModel(default_backend())
    model = calibrate(world)
    if cached is not None and cached.background < model.background:
        return cached
    store.put(key, model.to_json())
    store.save()
    return model

