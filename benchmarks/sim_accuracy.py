"""How well ``cube.sim`` predicts: simulated vs measured step time of GPT plans on CPU ranks.

    python -m benchmarks.sim_accuracy [--quick] [--steps 2] [--rounds 4] [--runs 1]

The GPT of ``benchmarks/parallel.py`` (4 layers, d256, T64, global batch 16,
AdamW) is planned several ways on 2 and 4 gloo ranks (data parallel with ZeRO
stages and recompute, Megatron tensor parallel, hybrid, 1F1B and GPipe with 2
and 4 micro-batches of the same global batch). Each plan is simulated in this
process (ops profiled at one thread per rank, collectives calibrated, ranks
sharing this host's cores), then measured in one torchrun job per world size
(plans interleaved round by round; a step is the compiled step, the optimizer
step and a barrier; median of the timed steps).

The host may be shared: while measuring, the CPU time other programs take is
measured and turned into competing programs (``cube.sim.host.Sampler``), and each plan is predicted twice,
for an idle host and for the host as it was during its steps. A shared machine's speed also drifts (by
30% within an hour on a 2-core VM, with no other program in it), so between the rounds every rank runs
the anchors, the single-device step (``cube.sim.context.WholeStep``) of the global batch and of a quarter
of it and an AdamW step, in turns; their median CPU times against their costs as profiled fit what ops
and the optimizer cost in a step (``cube.sim.context.fit``: a scale, a cost per call and a factor on
memory-bound work) for the second prediction. The quarter step also runs right before each plan's
timed steps (the window anchors): each round's steps are taken at the job's typical pace by the window
anchors around them (``paced``; the speed swings by 20% within seconds), and the ops' context is raised
to the window anchors' level (``in_situ``). The arrival loops (``cube.sim.arrival``) run between the rounds
too, and the second prediction takes what communication costs after compute from them (it drifts with the
host's state, by x3 from job to job on a 2-core VM). Printed per plan: both predictions, the measured time, the
busiest rank's predicted compute and its measured CPU time (which other programs do not inflate); then
the mean absolute percentage error, Spearman's rank correlation, the pairs of plans more than 10% apart
ordered right and the regret of the plan predicted best (its measured time over the measured best,
minus 1).

``build()`` returns the model and a batch, so the simulator's command line
takes this file as a model spec: ``python -m cube.sim benchmarks/sim_accuracy.py --ngpus 2 --search``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt, port  # noqa: E402
from cube.sim.host import Sampler  # noqa: E402

BATCH, SEQ, VOCAB = 16, 64, 2048
# name, world, policy, micro-batches, ZeRO stage, recompute
PLANS = [
    ("PASData", 2, "cube.policies.data:PASData", 1, 0, False),
    ("PASData zero1", 2, "cube.policies.data:PASData", 1, 1, False),
    ("PASData zero3", 2, "cube.policies.data:PASData", 1, 3, False),
    ("PASData recompute", 2, "cube.policies.data:PASData", 1, 0, True),
    ("PASMegatronTP", 2, "cube.policies.megatron:PASMegatronTP", 1, 0, False),
    ("PAS1F1B m2", 2, "cube.policies.pipeline:PAS1F1B", 2, 0, False),
    ("PAS1F1B m4", 2, "cube.policies.pipeline:PAS1F1B", 4, 0, False),
    ("PASGPipe m4", 2, "cube.policies.pipeline:PASGPipe", 4, 0, False),
    ("PASData", 4, "cube.policies.data:PASData", 1, 0, False),
    ("PASHybrid tp2", 4, "cube.policies.hybrid:PASHybrid", 1, 0, False),
    ("PASMegatronTP", 4, "cube.policies.megatron:PASMegatronTP", 1, 0, False),
    ("PAS1F1B m4", 4, "cube.policies.pipeline:PAS1F1B", 4, 0, False),
]
QUICK = [0, 1, 4, 5, 7, 8, 9, 11]


def build():
    """The benchmark GPT and one global batch (the model spec ``python -m cube.sim`` takes)."""
    import torch
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=8, n_embd=256, bias=False))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, (ids, torch.roll(ids, -1, dims=1))


class _env:
    """Sets the plan's environment variables (micro-batches, recompute) for a compile."""

    def __init__(self, nmicros: int, recompute: bool):
        self.set = {"CUBE_MICROS": str(nmicros), "CUBE_RECOMPUTE": "all" if recompute else ""}

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.set}
        os.environ.update(self.set)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def plan_graphs(plans):
    """Each plan traced and planned as its compile would (its micro-batch, CUBE_MICROS, CUBE_RECOMPUTE)."""
    from cube.compiler import trace_and_plan
    from cube.policy import load_policy
    model, (ids, tgt) = build()
    graphs = []
    for name, world, policy, m, zero, rc in plans:
        with _env(m, rc):
            # the global batch: a pipeline plan traces its micro-batch itself, as its compile does
            graph, _ = trace_and_plan(model, (ids, tgt), "tuple", load_policy(policy),
                                      world, zero=3 if zero == 3 else 0)
        graphs.append(graph)
    return graphs


def anchors(model, batch):
    """The anchors: the single-device step (``cube.sim.context.WholeStep``) of the global batch and of a
    quarter of it (the smallest micro-batch of the plans), and AdamW over the model's parameters
    (``cube.sim.context.OptimizerStep``), whose measured seconds fit the ops' context."""
    from cube.sim.context import OptimizerStep, WholeStep, quarter
    wholes = [WholeStep(model, batch), WholeStep(model, quarter(batch))]
    return wholes + [OptimizerStep(wholes[0].gen.parameters())]


def predict(plans, graphs, background=None, threads: int = 1, contexts=None, comms=None):
    """Simulated results of each plan: ops profiled at ``threads`` threads (as the ranks run) and put in
    the context of a whole step (``cube.sim.context``), collectives calibrated, the ranks sharing this
    host's cores (``cube.sim.host.this_host``) with ``background[i]`` other programs. ``contexts``: the
    ``Context`` of each plan (fitted once for all, from the anchors run in this process, when None).
    ``comms``: the communication model of each plan (the calibrated one of its world size, when None).

    Returns ``(results, the fitted context, the anchors and a profiler)``; the last two None when
    ``contexts`` was given.
    """
    import torch
    from cube.sim import comm as comm_mod
    from cube.sim.context import fit_measured, timed
    from cube.sim.host import this_host
    from cube.sim.profile import Profiler
    from cube.sim.simulate import simulate
    torch.set_num_threads(threads)
    costs = Profiler(threads=threads)
    context = fitted = None
    if contexts is None:   # the anchors, timed in turns
        fitted = anchors(*build())
        context = fit_measured(fitted[:2], fitted[2], timed(fitted, steps=12), costs)
    contexts = contexts if contexts is not None else [context] * len(plans)
    host = this_host()
    out = []
    for i, ((name, world, policy, m, zero, rc), graph) in enumerate(zip(plans, graphs)):
        costs.context = contexts[i]
        comm = comms[i] if comms is not None else comm_mod.load(world, calibrate_missing=True)
        out.append(simulate(graph, world, costs=costs, comm=comm, zero=zero,
                            host=host.loaded(background[i] if background else 0.0)))
    costs.save()
    return out, context, (fitted, costs) if fitted else None


def _worker(args) -> None:
    """One torchrun job: every plan of this world size, compiled once, timed round by round."""
    import torch
    import torch.distributed as dist
    import cube
    from cube.runtime import collectives as C
    from cube.sim import arrival
    env = cube.init()
    torch.set_num_threads(1)
    plans = [p for p in PLANS if p[1] == env.world_size and p[0] in args.names.split("|")]
    model, (ids, tgt) = build()
    runners = []
    for name, world, policy, m, zero, rc in plans:
        batches = [(ids, tgt)]   # one global batch a step, for every plan (a pipeline cuts it into m)

        def endless(batches=batches):
            while True:
                yield from batches
        it = endless()
        with _env(m, rc):
            train_iter, gen = compile_gpt(model, it, policy, args.cache, zero=3 if zero == 3 else 0)
        opt = cube.build_optimizer(gen, torch.optim.AdamW, zero=zero, lr=1e-4)

        def step(train_iter=train_iter, gen=gen, opt=opt, it=it):
            train_iter(gen, it)
            opt.step()
            opt.zero_grad()
        runners.append((f"{name} w{world}", step, [], [], []))
    # the anchors: the single-device step of the global batch and of a quarter of it, and AdamW, run by every
    # rank at once between the plans' rounds; their CPU times tell what ops cost while the plans are measured
    wholes = anchors(model, (ids, tgt))
    anchor = [[] for _ in wholes]
    # and the arrival loops (cube.sim.arrival): what communication costs beyond its alpha-beta when the ranks
    # come to it from computing drifts with the host's state as its speed does, so it is measured here too
    sizes = arrival.sizes_for(env.world_size, sorted({2, env.world_size}))
    C.create_groups(arrival.groups(env.world_size, sizes))
    waits = []
    # and the window anchors: the quarter step once before each plan's timed steps and once after the last
    # plan of a round. The host's speed swings by 20% within seconds (a shared VM's neighbours), so each
    # plan's steps are also taken at the pace of the anchors around them (``paced``)
    windows: List[float] = []
    for _ in range(args.rounds):
        dist.barrier()
        for turn in range(args.steps + 1):   # in turns (a swing of the host's speed hits all alike)
            for whole, times in zip(wholes, anchor):
                t = whole.seconds()
                if turn:
                    times.append(t)
        waits.append(arrival.measure(env.rank, env.world_size, sizes, C._all_reduce, repeats=3))
        for _, step, times, spans, cpu in runners:
            for _ in range(args.warmup):
                step()
            dist.barrier()
            windows.append(wholes[1].seconds())
            times.append([])
            cpu.append([])
            for _ in range(args.steps):
                dist.barrier()
                t0, wall, c0 = time.perf_counter(), time.time(), time.thread_time()
                step()
                cpu[-1].append(time.thread_time() - c0)
                dist.barrier()
                times[-1].append(time.perf_counter() - t0)
                spans.append((wall, time.time()))
        dist.barrier()
        windows.append(wholes[1].seconds())
    w = torch.tensor(windows, dtype=torch.float64)
    dist.all_reduce(w)
    w = (w / env.world_size).tolist()   # the ranks' mean of each window anchor
    out = {}
    for k, (name, _, times, spans, cpu) in enumerate(runners):
        around = [(w[i * (len(runners) + 1) + k] + w[i * (len(runners) + 1) + k + 1]) / 2 for i in range(args.rounds)]
        got = torch.tensor([statistics.median(paced(cpu, around, w)), statistics.median(sum(cpu, []))],
                           dtype=torch.float64)
        dist.all_reduce(got, op=dist.ReduceOp.MAX)   # CPU time of the busiest rank's main thread
        out[name] = [statistics.median(paced(times, around, w)), spans, float(got[0]),
                     statistics.median(sum(times, [])), float(got[1])]
    mid = torch.tensor([statistics.median(times) for times in anchor], dtype=torch.float64)
    dist.all_reduce(mid)
    out["anchor"] = (mid / env.world_size).tolist()   # per anchor, the ranks' mean of their median
    out["windows"] = [min(w), statistics.median(w), max(w)]
    out["arrival"] = {"none": statistics.median(t["none"] for t in waits),
                      "coll": {n: statistics.median(t["coll"][n] for t in waits) for n in sizes},
                      "p2p": statistics.median(t["p2p"] for t in waits) if waits[0]["p2p"] is not None else None}
    if env.rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.barrier()


def in_situ(context, window: float, quarter: float):
    """``context`` with its ops at the level of the window anchors: times their median over the quarter
    step's median between rounds. The same step reads 5-11% slower right before a plan's steps than
    in turns with the other anchors between rounds (measured on a 2-core VM; the plans' ranks ran
    4-21% above the between-rounds context), and the plans' ops run where the window anchors do.
    The optimizer's factor is kept: AdamW streams its state from memory either way."""
    from dataclasses import replace
    r = window / quarter if window > 0 and quarter > 0 else 1.0
    return replace(context, scale=context.scale * r, per_call=context.per_call * r)


def paced(samples: List[List[float]], around: List[float], windows: List[float]) -> List[float]:
    """Each round's samples at the job's typical pace: times the median window anchor over the mean of the
    two window anchors around them (``around[i]`` for ``samples[i]``)."""
    typical_pace = statistics.median(windows)
    return [t * typical_pace / a for got, a in zip(samples, around) for t in got]


def measure(plans, steps: int, rounds: int, warmup: int = 1):
    """Per plan (one torchrun job per world size): the median step seconds, the mean number of other
    programs competing for the cores during its timed steps, the median CPU seconds per step of the
    busiest rank's main thread (its compute, which other programs do not inflate), the median CPU
    seconds of each anchor (``anchors``: the single-device step, forward and backward) that the ranks of
    its job ran between rounds, the raw median step and CPU seconds (the first and third are paced:
    ``paced``), and per job the window anchors' (min, median, max) seconds and the arrival loops' times
    (``cube.sim.arrival.measure``, medians over the rounds)."""
    out, background, busy, anchor, raw, windows, waits = {}, {}, {}, {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in sorted({p[1] for p in plans}):
            names = "|".join(p[0] for p in plans if p[1] == world)
            result = os.path.join(tmp, f"w{world}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                   "--master_addr=127.0.0.1", f"--master_port={port()}", __file__, "--worker", "--names", names,
                   "--out", result, "--cache", os.path.join(tmp, "cache"), "--steps", str(steps),
                   "--rounds", str(rounds), "--warmup", str(warmup)]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                       CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
            job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            sampler = Sampler([job.pid], ranks=world)
            sampler.start()
            stdout, stderr = job.communicate()
            sampler.stop()
            if job.returncode != 0:
                raise RuntimeError(f"torchrun failed:\n{stdout[-3000:]}\n{stderr[-5000:]}")
            got = json.loads(Path(result).read_text())
            anchor[world], windows[world], waits[world] = got.pop("anchor"), got.pop("windows"), got.pop("arrival")
            for name, (median, spans, cpu, raw_median, raw_cpu) in got.items():
                out[name], background[name], busy[name] = median, sampler.during(spans), cpu
                raw[name] = (raw_median, raw_cpu)
    keys = [f"{p[0]} w{p[1]}" for p in plans]
    return ([out[k] for k in keys], [background[k] for k in keys], [busy[k] for k in keys],
            [anchor[p[1]] for p in plans], [raw[k] for k in keys], windows, waits)



def spearman(xs, ys) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else 0.0


def metrics(rows, key: str = "loaded_ms") -> dict:
    """MAPE, Spearman and regret of the prediction ``key`` over ``rows`` (each also with ``measured_ms``)."""
    pred = [r[key] for r in rows]
    meas = [r["measured_ms"] for r in rows]
    mape = statistics.mean(abs(p - m) / m for p, m in zip(pred, meas))
    chosen = min(range(len(rows)), key=lambda i: pred[i])
    apart = [(i, j) for i in range(len(rows)) for j in range(i + 1, len(rows))
             if abs(meas[i] - meas[j]) > 0.1 * min(meas[i], meas[j])]
    right = sum((pred[i] - pred[j]) * (meas[i] - meas[j]) > 0 for i, j in apart)
    return {"mape": mape, "spearman": spearman(pred, meas), "regret": meas[chosen] / min(meas) - 1,
            "predicted_best": rows[chosen]["plan"], "apart": len(apart), "ordered": right}


def main(quick: bool = False, steps: int = 2, rounds: int = 4) -> list:
    """Predicts and measures the plans; prints the table and the metrics; returns one dict per plan.

    Two predictions per plan: for ranks that have the host's cores to themselves at the speed the ops
    were profiled at (``predicted_ms``), and for the host as it was while measuring (``loaded_ms``):
    shared with the other programs' runnable threads (``background``: their mean count), its ops in the
    context fitted to the anchors (the single-device steps the ranks ran between the plans' rounds,
    against the sums of their ops as profiled). The anchors follow the host's speed, which drifts on a
    shared machine by more than the simulator's error; they give one context per job, the same for
    every plan of it.
    """
    plans = [PLANS[i] for i in QUICK] if quick else PLANS
    from cube.sim import arrival, comm as comm_mod
    from cube.sim.context import fit_measured
    from cube.sim.host import this_host
    t0 = time.perf_counter()
    graphs = plan_graphs(plans)
    idle, context, (fitted, costs) = predict(plans, graphs)
    t1 = time.perf_counter()
    measured, background, cpu, anchor, raw, windows, waits = measure(plans, steps, rounds)
    t2 = time.perf_counter()
    # each job's context from its anchors, as measured by its ranks, at the window anchors' level
    now = [in_situ(fit_measured(fitted[:2], fitted[2], seconds, costs), windows[p[1]][1], seconds[1])
           for p, seconds in zip(plans, anchor)]
    # and each job's arrival costs from its arrival loops (the host's other programs as during its plans)
    calibrated = {w: comm_mod.load(w) for w in waits}
    comms = {w: arrival.refit(calibrated[w], waits[w], w, this_host().loaded(
        statistics.mean(b for p, b in zip(plans, background) if p[1] == w))) for w in waits}
    loaded, *_ = predict(plans, graphs, background, contexts=now, comms=[comms[p[1]] for p in plans])
    rows = []
    for (name, world, *_), res, busy, m, others, c, k, (m_raw, c_raw) in zip(plans, idle, loaded, measured, background,
                                                                             cpu, now, raw):
        compute = max(s.compute for s in busy.ranks.values())
        rows.append({"benchmark": "sim_accuracy", "name": f"{name} ({world} ranks)", "plan": f"{name} ({world} ranks)",
                     "world": world, "predicted_ms": res.step_time * 1e3, "loaded_ms": busy.step_time * 1e3,
                     "measured_ms": m * 1e3, "raw_ms": m_raw * 1e3, "raw_cpu_ms": c_raw * 1e3, "background": others,
                     "error_pct": (busy.step_time - m) / m * 100, "peak_mib": res.peak_memory / 2**20,
                     "compute_ms": compute * 1e3, "cpu_ms": c * 1e3, "ops_scale": k.scale,
                     "ops_per_call_us": k.per_call * 1e6, "profiled_scale": context.scale,
                     "profiled_per_call_us": context.per_call * 1e6})
    worlds = sorted({r["world"] for r in rows})
    scales = ", ".join(f"{next(k for (_, w, *_), k in zip(plans, now) if w == world)} with {world} ranks"
                       for world in worlds)
    print(f"GPT 4 layers, d256, T64, global batch {BATCH}; CPU gloo ranks on {os.cpu_count()} cores; "
          f"simulated in {t1 - t0:.1f}s, measured in {t2 - t1:.1f}s; ops in a whole step cost {context} "
          f"when profiled; while measured (the anchors): {scales}")
    print("window anchors (the quarter step around each plan's steps, ms min/median/max): " + ", ".join(
        f"{lo * 1e3:.0f}/{mid * 1e3:.0f}/{hi * 1e3:.0f} with {w} ranks"
        for w, (lo, mid, hi) in sorted(windows.items())))

    def _arrival(m) -> str:
        return " ".join(f"n={n}: {a * 1e3:.2f}" for n, a in sorted(m.arrival.items())) + f" p2p: {m.p2p_arrival * 1e3:.2f}"
    print("arrival costs (ms a collective, by group size, and a message; cube.sim.arrival): " + ", ".join(
        f"calibrated {_arrival(calibrated[w])}, in the job {_arrival(comms[w])} with {w} ranks" for w in sorted(comms)))
    print(f"{'plan':<27}{'idle host':>10}{'as loaded':>10}{'measured':>10}{'error':>8}{'raw':>8}{'others':>8}"
          f"{'compute':>9}{'CPU':>8}{'peak MiB':>10}")
    for r in rows:
        print(f"{r['plan']:<27}{r['predicted_ms']:>10.1f}{r['loaded_ms']:>10.1f}{r['measured_ms']:>10.1f}"
              f"{r['error_pct']:>7.1f}%{r['raw_ms']:>8.1f}{r['background']:>8.2f}{r['compute_ms']:>9.1f}"
              f"{r['cpu_ms']:>8.1f}{r['peak_mib']:>10.1f}")
    print("(ms per step. idle host: predicted with the cores to the ranks, ops in the context fitted before "
          "measuring; as loaded: sharing them with the other programs competing while it was measured ('others', "
          "from their CPU time), ops in the anchors' context; measured: at the job's typical pace (each round's "
          "steps times the median window anchor over the window anchors around them); error: as loaded vs "
          "measured; raw: the steps' median as timed; compute: predicted compute of the busiest rank, as loaded; "
          "CPU: its main thread's measured CPU time, paced)")
    cmape = statistics.mean(abs(r["compute_ms"] - r["cpu_ms"]) / r["cpu_ms"] for r in rows)
    print(f"compute vs CPU time: MAPE {cmape * 100:.1f}% (the op costs, whatever else runs on the host)")
    rmape = statistics.mean(abs(r["loaded_ms"] - r["raw_ms"]) / r["raw_ms"] for r in rows)
    print(f"as loaded vs the raw medians: MAPE {rmape * 100:.1f}% (the host's swings within the job left in)")
    _print_metrics(rows)
    return rows


def _print_metrics(rows) -> None:
    """MAPE, Spearman and regret of both predictions, over all plans and per world size."""
    worlds = sorted({r["world"] for r in rows})
    for key, label in (("loaded_ms", "as loaded"), ("predicted_ms", "idle host")):
        for part_label, part in [("all", rows)] + [(f"{w} ranks", [r for r in rows if r["world"] == w]) for w in worlds]:
            if len(part) < 2:
                continue
            m = metrics(part, key)
            print(f"{label:<10}{part_label:<8} MAPE {m['mape'] * 100:5.1f}% (target <= 10%)   Spearman "
                  f"{m['spearman']:6.3f} (>= 0.9)   ordered {m['ordered']:>2}/{m['apart']:<2} (pairs > 10% apart)   "
                  f"regret {m['regret'] * 100:5.1f}% (<= 5%), predicted best: {m['predicted_best']}")


def over_runs(runs) -> list:
    """One row per plan holding the medians over ``runs`` (each a list of ``main``'s rows, same plans)."""
    out = []
    for group in zip(*runs):
        row = dict(group[0])
        for key in ("predicted_ms", "loaded_ms", "measured_ms", "raw_ms", "raw_cpu_ms", "compute_ms", "cpu_ms"):
            row[key] = statistics.median(r[key] for r in group)
        row["error_pct"] = (row["loaded_ms"] - row["measured_ms"]) / row["measured_ms"] * 100
        out.append(row)
    return out


def repeated(runs: int, **kw) -> list:
    """``main`` ``runs`` times (each profiles nothing it has measured before, measures again, anchors
    again), then the per-plan medians over the runs and their metrics: a shared host's drift makes
    one run's figures swing by more than the simulator's error."""
    results = [main(**kw) for _ in range(runs)]
    rows = over_runs(results)
    if runs > 1:
        print(f"\nper-plan medians over {runs} runs")
        print(f"{'plan':<27}{'idle host':>10}{'as loaded':>10}{'measured':>10}{'error':>8}")
        for r in rows:
            print(f"{r['plan']:<27}{r['predicted_ms']:>10.1f}{r['loaded_ms']:>10.1f}{r['measured_ms']:>10.1f}"
                  f"{r['error_pct']:>7.1f}%")
        _print_metrics(rows)
        _print_reproducibility(results)
    return rows


def reproducibility(runs) -> dict:
    """How well one run's measurements rank the plans of another run (same plans): Spearman over
    every pair of runs, of the measured times against each other, and of each run's as-loaded
    prediction against the other run's measurement. Measured against measured is what the
    benchmark can resolve on this host: a prediction cannot rank the plans more reliably than
    measuring them again does."""
    pairs = [(i, j) for i in range(len(runs)) for j in range(len(runs)) if i != j]
    meas = lambda run: [r["measured_ms"] for r in run]   # noqa: E731
    return {"measured": [spearman(meas(runs[i]), meas(runs[j])) for i, j in pairs if i < j],
            "predicted": [spearman([r["loaded_ms"] for r in runs[i]], meas(runs[j])) for i, j in pairs]}


def _print_reproducibility(runs) -> None:
    rep = reproducibility(runs)
    fmt = lambda v: f"{min(v):.3f}-{max(v):.3f} (median {statistics.median(v):.3f})"   # noqa: E731
    print(f"run against run: Spearman of one run's measured times against another's {fmt(rep['measured'])}; "
          f"of one run's prediction (as loaded) against another's measured times {fmt(rep['predicted'])}")


def _cli() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{len(QUICK)} plans instead of {len(PLANS)}")
    p.add_argument("--steps", type=int, default=2, help="timed steps per plan and round")
    p.add_argument("--rounds", type=int, default=4, help="rounds over the plans (interleaved)")
    p.add_argument("--runs", type=int, default=1, help="whole runs; with more than one, the metrics of the "
                   "per-plan medians follow")
    p.add_argument("--warmup", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--names", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        _worker(args)
        return
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    repeated(args.runs, quick=args.quick, steps=args.steps, rounds=args.rounds)


if __name__ == "__main__":
    _cli()
