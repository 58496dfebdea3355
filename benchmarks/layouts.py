"""Layout conversions: the bytes cube's plan moves against the textbook optimum, and the time of
cube's primitive against the one torch call that does the same.

    python -m benchmarks.layouts [--quick] [--nproc 4] [--repeats 5] [--rounds 7] [--warmup 3] [--sizes 1,64]

For each classic pair of layouts of a 2-d float32 tensor (size = the whole
logical tensor, in MiB; ``n`` ranks):

==============  ==========================  =================================
pair            cube's plan                 torch (gloo on CPU)
==============  ==========================  =================================
D -> R          all_gather                  all_gather_into_tensor
                                            (all_gather_single in torch 2.13+)
V -> R          all_reduce (in place)       all_reduce
V -> D          reduce_scatter              reduce_scatter_tensor
                                            (reduce_scatter_single)
D(0) -> D(1)    all_to_all                  all_to_all_single (after the one
                                            copy that lays the chunks out)
D/2 -> D/4      point-to-point exchange     isend / irecv of the same regions
D/4 -> R/1      exchange (p2p.gather)       isend / irecv into the result
R/1 -> D/2      point-to-point exchange     isend / irecv
==============  ==========================  =================================

1. Bytes: the steps come from :func:`cube.passes.adapter.transitions` (and,
   where no chain of collectives fits, :func:`cube.passes.exchange.exchange`,
   as ``build_plans`` does) given the producer's and the consumer's boxes.
   A collective step is counted as what its ring algorithm sends per rank
   (NCCL and gloo use rings at these sizes): all-gather and reduce-scatter
   ``(n-1)/n`` of the whole, all-reduce ``2(n-1)/n``, all-to-all ``(n-1)/n``
   of a piece. An exchange sends exactly its regions taken from other ranks.
   The optimum is computed from the pair alone (the formulas above; for an
   exchange, the part of each reader's box its own piece lacks).
2. Time: under torchrun, ``--nproc`` gloo ranks on the CPU. Each round runs
   cube's call (``cube.runtime.collectives`` / ``cube.runtime.p2p`` as the
   generated code calls them, forward only, on a value that needs no gradient:
   no autograd node, as under ``torch.no_grad()``) and torch's, each between two
   barriers (repeated so one timing lasts about 200 ms: tiny calls would drown in a barrier's
   jitter, and on a shared 2-core VM the same all-reduce timed against itself read 0.91-1.27 in
   windows of 30 ms, 0.96 in windows of 200 ms), in turns; the median over ``--rounds`` after
   ``--warmup`` untimed ones. Torch's call is timed twice in each round; the second over the
   first (``A/A``) is how far two identical calls read apart on the host.
   Target: cube / torch <= 1.10.
3. Blocks: the rounds of one pair form a block, and the whole sweep of pairs runs ``--repeats``
   times in one job; a row's ratio is the median of its blocks' ratios (the range is printed).
   At 1 MiB an exchange's calls last about 0.4 ms, and ranks that share cores settle into one
   order of posting sends and receives that holds for the whole block (gloo's send waits for the
   receiver to say it is ready): the same code read 0.77 in one block and 1.61 in another, and
   D/2 -> D/4 at 1 MiB gave 0.98, 1.22 and 0.92 in three blocks of one job. One block is one
   draw of that order; the median of several is the call's cost.
"""
from __future__ import annotations

import json
import statistics
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import run_rows, worker_cli  # noqa: E402

DEFAULTS = {"nproc": 4, "repeats": 5, "rounds": 7, "warmup": 3, "sizes": "1,64", "threads": 1}
QUICK = {"repeats": 2, "rounds": 5, "warmup": 2, "sizes": "1,8"}
TARGET = 1.10
ELEM = 4   # float32

Box = Tuple[Tuple[int, int], ...]


# ---------------------------------------------------------------- the pairs (boxes and terms)

def _split(rows: int, cols: int, k: int, i: int, dim: int) -> Box:
    whole = [(0, rows), (0, cols)]
    s, e = whole[dim]
    step = (e - s) // k
    whole[dim] = (s + i * step, s + (i + 1) * step)
    return tuple(whole)


def pairs(rows: int, cols: int, n: int) -> Dict[str, dict]:
    """Each pair: ``where`` (rank -> (box, term) of the producer's pieces), ``need`` (rank -> the
    box the consumer reads) and ``optimum`` (bytes: per rank for a collective, in all for an exchange)."""
    full = ((0, rows), (0, cols))
    size = rows * cols * ELEM
    term = lambda i: ((0, "k", i, n),)   # noqa: E731  one of n partial sums
    ring = (n - 1) / n
    out = {
        "D -> R": dict(where={q: (_split(rows, cols, n, q, 0), ()) for q in range(n)},
                       need={q: full for q in range(n)}, optimum=ring * size, basis="per rank"),
        "V -> R": dict(where={q: (full, term(q)) for q in range(n)},
                       need={q: full for q in range(n)}, optimum=2 * ring * size, basis="per rank"),
        "V -> D": dict(where={q: (full, term(q)) for q in range(n)},
                       need={q: _split(rows, cols, n, q, 0) for q in range(n)}, optimum=ring * size,
                       basis="per rank"),
        "D(0) -> D(1)": dict(where={q: (_split(rows, cols, n, q, 0), ()) for q in range(n)},
                             need={q: _split(rows, cols, n, q, 1) for q in range(n)}, optimum=ring * size / n,
                             basis="per rank"),
    }
    if n % 2 == 0 and n >= 4:
        half = n // 2
        out[f"D/{half} -> D/{n}"] = dict(where={q: (_split(rows, cols, half, q, 0), ()) for q in range(half)},
                                         need={q: _split(rows, cols, n, q, 0) for q in range(n)})
    out[f"D/{n} -> R/1"] = dict(where={q: (_split(rows, cols, n, q, 0), ()) for q in range(n)}, need={0: full})
    out["R/1 -> D/2"] = dict(where={0: (full, ())}, need={q: _split(rows, cols, 2, q, 0) for q in range(2)})
    for spec in out.values():
        if "optimum" not in spec:   # an exchange: what each reader's own piece lacks
            spec["optimum"] = sum(_volume(b) - _own_volume(b, spec["where"].get(r)) for r, b in spec["need"].items()) * ELEM
            spec["basis"] = "in all"
    return out


def _volume(box: Box) -> int:
    v = 1
    for s, e in box:
        v *= max(0, e - s)
    return v


def _own_volume(box: Box, own) -> int:
    if own is None:
        return 0
    from cube.passes.exchange import intersect
    cut = intersect(box, own[0])
    return 0 if cut is None else _volume(cut)


def plan(spec: dict):
    """``("steps", rank -> steps)`` from ``transitions``, or ``("takes", rank -> takes)`` from
    ``exchange`` where no chain of collectives fits (as ``build_plans`` decides)."""
    from cube.passes.adapter import LayoutError, transitions
    from cube.passes.exchange import exchange
    where, need = spec["where"], spec["need"]
    contrib = {r: () for r in need}
    try:
        return "steps", transitions(where, need, contrib, what="x")
    except LayoutError:
        tags: Dict[tuple, int] = {}
        return "takes", exchange(where, need, contrib, False,
                                 lambda q, r, region: tags.setdefault((q, r, region), len(tags) + 1), what="x")


def bytes_sent(kind: str, planned) -> Dict[int, float]:
    """Bytes each rank sends, read from the planned steps (ring algorithms) or takes."""
    sent: Dict[int, float] = {}
    if kind == "takes":
        for r, takes in planned.items():
            for t in takes:
                if t.src != r:
                    sent[t.src] = sent.get(t.src, 0) + _volume(t.region) * ELEM
        return sent
    for r, steps in planned.items():
        total = 0.0
        for s in steps:
            n, out = len(s.ranks), _volume(s.box) * ELEM
            total += {"all_gather": (n - 1) / n * out, "all_reduce": 2 * (n - 1) / n * out,
                      "reduce_scatter": (n - 1) * out, "all_to_all": (n - 1) / n * out}.get(s.kind, 0.0)
        sent[r] = total
    return sent


def describe(kind: str, planned) -> str:
    if kind == "takes":
        moves = sum(1 for r, takes in planned.items() for t in takes if t.src != r)
        return f"exchange ({moves} send{'s' * (moves != 1)})"
    return " + ".join(sorted({s.kind for steps in planned.values() for s in steps})) or "nothing"


# ---------------------------------------------------------------- the timed calls

def _cube_call(kind: str, planned, where, rank: int, x) -> Callable[[], object]:
    """The calls the generated code makes on ``rank`` for the planned conversion (forward only)."""
    import torch
    from cube.runtime import collectives as C, p2p
    cpu = torch.device("cpu")
    if kind == "steps":
        steps = planned.get(rank, [])

        def run():
            v = x
            for s in steps:
                if s.kind == "all_gather":
                    v = C.all_gather(v, s.ranks, s.dim, grad=s.grad)
                elif s.kind == "all_reduce":   # a linear's partial output: summed in place, as generated
                    v = C.all_reduce(v, s.ranks, inplace=True)
                elif s.kind == "reduce_scatter":
                    v = C.reduce_scatter(v, s.ranks, s.dim)
                elif s.kind == "all_to_all":
                    v = C.all_to_all(v, s.ranks, s.dim, s.dim2)
                else:
                    raise AssertionError(f"unexpected step {s.kind}")
            return v
        return run
    sends = [(r, t) for r, takes in planned.items() for t in takes if t.src == rank and r != rank]
    mine = planned.get(rank, [])
    box = tuple((min(t.region[d][0] for t in mine), max(t.region[d][1] for t in mine))
                for d in range(len(mine[0].region))) if mine else ()
    shape = tuple(e - s for s, e in box)
    rel = [tuple((s - o, e - o) for (s, e), (o, _) in zip(t.region, box)) for t in mine]
    if len(mine) > 1 and any(t.src != rank for t in mine):   # as the plan does: one gather call
        remote = tuple((t.src, t.tag, place, False, ()) for t, place in zip(mine, rel) if t.src != rank)
        local = tuple((t.part, place, False, ()) for t, place in zip(mine, rel) if t.src == rank)

        def gather():
            for r, t in sends:
                p2p.send(C.region(x, t.part), r, tag=t.tag, grad=False)
            out = p2p.gather(x, remote, local, shape, torch.float32, cpu, requires_grad=False)
            p2p.finish()
            return out
        return gather

    sizes = [tuple(e - s for s, e in t.region) for t in mine]   # literals in the generated code

    def run():
        for r, t in sends:
            p2p.send(C.region(x, t.part), r, tag=t.tag, grad=False)
        values = []
        for t, size in zip(mine, sizes):
            if t.src == rank:
                values.append(C.region(x, t.part))
            else:
                values.append(p2p.recv(t.src, tag=t.tag, shape=size, dtype=torch.float32, device=cpu,
                                       requires_grad=False))
        out = None
        if values:
            out = values[0] if len(values) == 1 else C.assemble(values, tuple(rel), shape)
        p2p.finish()
        return out
    return run


def _torch_call(name: str, kind: str, planned, rank: int, n: int, x, fresh: bool = False) -> Callable[[], object]:
    """The one torch call (or the plain sends and receives) that does the same; into buffers made
    once, or with ``fresh`` into a new result each call, as a value returned to the model is
    (and, for the in-place all-reduce, a copy of the input: what cube's call makes)."""
    import torch
    import torch.distributed as dist
    from cube.runtime import collectives as C
    buffer = (lambda shape: lambda: torch.empty(shape)) if fresh else \
        (lambda shape: (lambda t: lambda: t)(torch.empty(shape)))
    if name == "D -> R":
        out = buffer((n * x.shape[0],) + tuple(x.shape[1:]))
        # torch's all_gather_single (all_gather_into_tensor before 2.13), as cube resolves the name
        return lambda: (C.all_gather_single(o := out(), x), o)[1]
    if name == "V -> R":   # in place: x (or its copy) is the sum afterwards
        return (lambda: (dist.all_reduce(y := x.clone()), y)[1]) if fresh else (lambda: (dist.all_reduce(x), x)[1])
    if name == "V -> D":
        out = buffer((x.shape[0] // n,) + tuple(x.shape[1:]))
        return lambda: (C.reduce_scatter_single(o := out(), x), o)[1]
    if name == "D(0) -> D(1)":
        rows, cols = x.shape
        out = buffer((n, rows, cols // n))

        def a2a():   # chunk j of the columns goes to rank j: laid out along dim 0 first
            o = out()
            dist.all_to_all_single(o, torch.stack(x.chunk(n, 1)))
            return o.view(n * rows, cols // n)
        return a2a
    # an exchange: the same regions, sent and received directly (into the result where it is one tensor)
    sends = [(r, t) for r, takes in planned.items() for t in takes if t.src == rank and r != rank]
    mine = planned.get(rank, [])
    result, lo = None, [min((t.region[d][0] for t in mine), default=0) for d in range(2)]
    if len(mine) == 1 and mine[0].src == rank:   # its own piece holds what it reads
        own = mine[0].part
        result = lambda: x[tuple(slice(s, e) for s, e in own)]   # noqa: E731
    elif mine:
        hi = [max(t.region[d][1] for t in mine) for d in range(2)]
        result = buffer((hi[0] - lo[0], hi[1] - lo[1]))

    def run():
        res = result() if result is not None else None
        works = [dist.isend(x[tuple(slice(s, e) for s, e in t.part)].contiguous(), r, tag=t.tag) for r, t in sends]
        for t in mine:
            dst = res[tuple(slice(s - o, e - o) for (s, e), o in zip(t.region, lo))]
            if t.src == rank:
                if len(mine) > 1:
                    dst.copy_(x[tuple(slice(s, e) for s, e in t.part)])
            else:
                works.append(dist.irecv(dst, t.src, tag=t.tag))
        for w in works:
            w.wait()
        return res
    return run


def _input(spec: dict, rank: int):
    import torch
    own = spec["where"].get(rank)
    if own is None:
        return None
    g = torch.Generator().manual_seed(rank)
    return torch.randn(tuple(e - s for s, e in own[0]), generator=g)


def _timed(fn, reps: int) -> float:
    """Seconds per call of ``fn`` (``reps`` calls between two barriers), the slowest rank's."""
    import time
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    dist.barrier()
    return (time.perf_counter() - t0) / reps


def _reps(fn, budget_s: float = 0.2) -> int:
    """Calls per timing so one timing lasts about ``budget_s`` (a barrier's jitter is then small);
    the same on every rank."""
    import torch
    import torch.distributed as dist
    t = torch.tensor([budget_s / max(_timed(fn, 1), 1e-6)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(min(400, max(1, t.item())))


def _block(name: str, spec: dict, kind: str, planned, rank: int, n: int, args) -> List[float]:
    """One block of a pair: the calls made and checked against each other, ``--warmup`` untimed
    rounds, then ``--rounds`` timed ones; each call's median seconds, the slowest rank's."""
    import torch
    import torch.distributed as dist
    x = _input(spec, rank)
    # cube's own copy of the input: its all-reduce sums in place, as torch's does
    calls = {"cube": _cube_call(kind, planned, spec["where"], rank, None if x is None else x.clone()),
             "torch": _torch_call(name, kind, planned, rank, n, x),
             "fresh": _torch_call(name, kind, planned, rank, n, x, fresh=True),
             # torch's call again: what the host reads between two identical calls
             "again": _torch_call(name, kind, planned, rank, n, x)}
    # the same result (sums may differ in rounding); the in-place all-reduce last
    got = {who: calls[who]() for who in ("cube", "fresh", "torch")}   # "again" is "torch"
    if rank in spec["need"] and not all(torch.allclose(got["cube"], v, rtol=1e-5, atol=1e-5)
                                        for v in got.values()):
        raise AssertionError(f"{name}: cube's result differs from torch's on rank {rank}")
    del got
    for _ in range(args.warmup):
        for fn in calls.values():
            fn()
    reps = _reps(calls["torch"])
    times = {who: [] for who in calls}
    for i in range(args.rounds):   # rotating which goes first, so drift hits all alike
        order = list(calls)[i % len(calls):] + list(calls)[:i % len(calls)]
        for who in order:
            times[who].append(_timed(calls[who], reps))
    local = torch.tensor([statistics.median(times[who]) for who in calls], dtype=torch.float64)
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.tolist()


def worker(args):
    import torch
    import torch.distributed as dist
    warnings.filterwarnings("ignore", category=FutureWarning)   # *_into_tensor / *_tensor: renamed in torch 2.1x
    from cube.runtime.cpu_memory import keep_freed_memory
    dist.init_process_group("gloo")
    keep_freed_memory()   # what cube.init() does on a CPU rank (torch's calls below share it)
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, args.threads))
    cases = []   # (pair, MiB, spec, kind, planned, what the row says of the plan)
    for mib in [float(s) for s in str(args.sizes).split(",")]:
        cols = 512 if mib <= 1 else 1024 if mib <= 16 else 4096
        rows = int(mib * 2**20 / ELEM / cols)
        rows -= rows % (4 * n)
        for name, spec in pairs(rows, cols, n).items():
            kind, planned = plan(spec)
            sent = bytes_sent(kind, planned)
            cases.append((name, mib, spec, kind, planned,
                          {"plan": describe(kind, planned), "basis": spec["basis"], "optimum_bytes": spec["optimum"],
                           "cube_bytes": max(sent.values(), default=0.0) if spec["basis"] == "per rank"
                           else sum(sent.values())}))
    blocks: List[List[List[float]]] = [[] for _ in cases]   # per case, per block: cube, torch, fresh, again (s)
    for _ in range(args.repeats):   # every pair once per block: a block's state is drawn anew
        for (name, _mib, spec, kind, planned, _info), got in zip(cases, blocks):
            got.append(_block(name, spec, kind, planned, rank, n, args))
    rows_out = []
    for (name, mib, _spec, _kind, _planned, info), got in zip(cases, blocks):
        c, t, tf, ta = (statistics.median(b[i] for b in got) for i in range(4))
        ratios = [b[0] / b[1] for b in got]
        rows_out.append({"benchmark": "layouts", "name": f"{name} {mib:g} MiB", "pair": name, "mib": mib, **info,
                         "bytes_ratio": info["cube_bytes"] / info["optimum_bytes"] if info["optimum_bytes"] else 1.0,
                         "cube_ms": c * 1e3, "torch_ms": t * 1e3, "torch_fresh_ms": tf * 1e3,
                         "torch_again_ms": ta * 1e3, "blocks": len(got),
                         "time_ratio": statistics.median(ratios), "block_ratios": ratios,
                         "fresh_time_ratio": statistics.median(b[0] / b[2] for b in got),
                         "control_ratio": statistics.median(b[3] / b[1] for b in got),
                         "target": f"<= {TARGET:.2f}"})
    if rank == 0:
        _print(rows_out, n, args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows_out, f)
    dist.barrier()
    dist.destroy_process_group()


def _range(values: List[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _print(rows: List[dict], n: int, args) -> None:
    print(f"layout conversions of a float32 tensor over {n} gloo ranks (CPU): {args.repeats} blocks of each pair, "
          f"each the median of {args.rounds} rounds after {args.warmup}; ratios: the median over blocks; "
          f"bytes: ring algorithms (per rank) or the regions sent (in all)")
    head = (f"{'pair':<14}{'MiB':>5}  {'plan':<22}{'basis':<10}{'cube MiB':>10}{'opt MiB':>10}"
            f"{'cube ms':>10}{'torch ms':>10}{'ratio':>8}{'blocks':>13}{'+alloc ms':>11}{'ratio':>8}{'A/A':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        flag = "" if r["time_ratio"] <= TARGET else "  > target"
        print(f"{r['pair']:<14}{r['mib']:>5g}  {r['plan']:<22}{r['basis']:<10}{r['cube_bytes'] / 2**20:>10.3f}"
              f"{r['optimum_bytes'] / 2**20:>10.3f}{r['cube_ms']:>10.2f}{r['torch_ms']:>10.2f}"
              f"{r['time_ratio']:>8.3f}{_range(r['block_ratios']):>13}"
              f"{r['torch_fresh_ms']:>11.2f}{r['fresh_time_ratio']:>8.3f}"
              f"{r['control_ratio']:>7.3f}{flag}")
    worst = max(r["time_ratio"] for r in rows)
    exact = all(abs(r["cube_bytes"] - r["optimum_bytes"]) < 1e-6 for r in rows)
    print("torch ms: into buffers made once (all_reduce in place); blocks: the lowest and highest block's ratio; "
          "+alloc ms: into a new result each call, as cube's call returns one; A/A: torch's call timed again "
          "against itself, the resolution of this host (a ratio within A/A's distance of 1 cannot be told "
          "from torch)")
    spread = max(abs(r["control_ratio"] - 1) for r in rows)
    print(f"A/A ranged {min(r['control_ratio'] for r in rows):.3f}-{max(r['control_ratio'] for r in rows):.3f} "
          f"(at most {spread:.1%} off)")
    print(f"bytes equal the optimum: {'yes' if exact else 'NO'}; worst time ratio {worst:.3f} "
          f"(target <= {TARGET:.2f})")


def main(quick: bool = False, **settings) -> List[dict]:
    """Runs the conversions (``quick``: 1 and 8 MiB, 2 blocks of 5 rounds) in a torchrun job; returns
    rank 0's rows."""
    cfg = {**DEFAULTS, **(QUICK if quick else {}), **settings}
    return run_rows(Path(__file__), cfg)


def _cli(argv=None) -> int:
    return worker_cli(__doc__, DEFAULTS, "1 and 8 MiB", worker, main, argv)


if __name__ == "__main__":
    sys.exit(_cli())
