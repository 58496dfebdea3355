"""cube's 1F1B, interleaved 1F1B, zero-bubble (ZB-H1, ZB-V) and DualPipeV pipelines side by side
with torch.distributed.pipelining, in one torchrun job.

    python -m benchmarks.pipeline [--quick] [--rounds 20] [--steps 1] [--kinds 1F1B,DualPipeV]

Launches one torchrun job (2 ranks, gloo on CPU) in which both ranks train the
same GPT (4 layers, d256, 8 heads, T64, vocab 2048, global batch 16, AdamW) as
a pipeline with ``m = 4`` and ``m = 8`` micro-batches (16 / m sequences each),
after ``warmup`` steps of each, interleaved round by round (each round runs
``steps`` steps of every way in turn; one by default) so machine noise hits all
alike:

- cube ``cube.policies.pipeline:PAS1F1B`` (two stages balanced by
  ``cube.schedule.balance``: embeddings, blocks 0-1 and block 2's attention |
  block 2's MLP, block 3, final norm, LM head and loss; the balance may cut a
  block after its attention's residual add) and ``torch.distributed.pipelining``
  ``PipelineStage`` + ``Schedule1F1B`` over the same split, and
- cube ``cube.policies.pipeline:PAS1F1BInterleaved`` (four balanced stages, two per
  rank, stage ``k`` on rank ``k % 2``) and ``ScheduleInterleaved1F1B`` over
  the same split, each rank building a ``PipelineStage`` for each of its stages.

The split is printed at the top of the report.

The torch stages are written by hand as ``nn.Module`` s (the first takes the
token ids, the last returns logits and the schedule's ``loss_fn`` takes the mean
cross entropy; ``scale_grads=True`` makes the gradients those of the mean
micro-batch loss, as cube's are; ``return_outputs=False``, as nothing reads the
logits). The split is read from cube's generated code (the blocks whose
parameters each stage's method uses).

Tied weights: the GPT ties the token embedding (first stage, rank 0) and the LM
head (last stage, rank 1). cube keeps them tied: one parameter whose gradient
is summed over the two ranks by its reducer. For torch the last stage holds an
untied copy (``lm_head.weight`` cloned from ``wte.weight``) and after each
backward the two copies' gradients are summed with one ``all_reduce`` (what
Megatron-LM does for its embedding group), so both copies stay equal and
training matches the tied model. The first step's losses of all ways are
checked to agree.

Measures, each the median over steps of the slowest rank's time:

- ``ms_per_step``: a whole step (the schedule, gradient sums, AdamW step).
- ``pipeline_ms``: the schedule alone (forward and backward of every
  micro-batch, sends, receives and the gradient sums; no optimizer).
- ``bound_ms``: the bound of the pipeline part, ``T x (m + (p - 1) / v) / m``
  with ``p = 2`` ranks and ``v`` stages per rank (1 for 1F1B, 2 interleaved),
  where ``T`` (the ideal rank time) is the larger over the two ranks of the time
  one rank takes to run forward and backward of its stages for all ``m``
  micro-batches of a step back to back, alone: no sends, receives or waits (its
  inputs and output gradients are made locally), each rank timing its stages at
  the same time as the other (the same contention as in the pipeline), with the
  hand-split torch modules, median over the same rounds. ``(p - 1) / v`` is the
  fill and drain of (interleaved) 1F1B when every micro-step of a stage takes
  ``T / (v m)``.
  Zero-bubble schedules shrink the fill and drain: with F, B and W taking a
  third of ``T / m`` each, ZB-H1's is ``(p - 1) / 3`` micro-steps instead of
  ``p - 1`` (``T x (m + (p - 1) / 3) / m``), and ZB-V's the idle unit steps of
  its schedule grid (``cube.schedule.sched_zbv(...).steps()`` against ``6 m``); DualPipeV's
  likewise from ``sched_dualpipev`` (against torch's ``ScheduleDualPipeV`` on the same V).
- ``bound_share``: ``bound_ms / pipeline_ms`` (1.0 reaches the bound).
- ``bubble`` and ``bound_bubble``: the share of the pipeline part a rank waits,
  ``1 - T / pipeline_ms``, and the same at the bound, ``1 - T / bound_ms``.

Ratios (ms/step): ``cube / torch`` (1F1B, target <= 0.95), ``cube interleaved /
torch interleaved`` (target <= 0.95), ``cube interleaved / torch 1F1B``
(below 1 when cube's interleaving beats torch's plain 1F1B), ``cube ZB-H1 /
torch 1F1B`` (target <= 0.90 at m = 4), ``cube ZB-V / torch ZB-V`` and ``cube DualPipeV /
torch DualPipeV`` (target <= 0.95), and ``cube DualPipeV / cube 1F1B``. cube's bound share
target is >= 0.90.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # python benchmarks/pipeline.py as well as python -m benchmarks.pipeline
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt, port  # noqa: E402

DEFAULTS = {"layers": 4, "dim": 256, "heads": 8, "seq": 64, "batch": 16, "vocab": 2048}
MICROS = (4, 8)
STAGES = 2    # ranks
VIRTUAL = {"1F1B": 1, "interleaved": 2, "ZB-H1": 1, "ZB-V": 2, "DualPipeV": 2}   # stages per rank of each schedule
POLICY = {"1F1B": "cube.policies.pipeline:PAS1F1B", "interleaved": "cube.policies.pipeline:PAS1F1BInterleaved",
          "ZB-H1": "cube.policies.pipeline:PASZBH1", "ZB-V": "cube.policies.pipeline:PASZBV",
          "DualPipeV": "cube.policies.pipeline:PASDualPipeV"}
TORCH = {"1F1B": "1F1B", "interleaved": "interleaved", "ZB-H1": None, "ZB-V": "ZB-V",
         "DualPipeV": "DualPipeV"}   # None: torch 1F1B's way
V_KINDS = ("ZB-V", "DualPipeV")   # stages in a V


def _rank_of(kind: str, k: int, nstages: int) -> int:
    """The rank of stage ``k``: in a V for ZB-V and DualPipeV, else ``k % STAGES``."""
    from cube.schedule import v_placement
    return v_placement(nstages)[k] if kind in V_KINDS else k % STAGES


def _bound_steps(kind: str, m: int) -> float:
    """Micro-steps of ``T / m`` each that the pipeline part takes at its bound (see the docstring)."""
    if kind == "ZB-H1":
        return m + (STAGES - 1) / 3
    if kind in V_KINDS:
        from cube.schedule import sched_dualpipev, sched_zbv
        make = sched_zbv if kind == "ZB-V" else sched_dualpipev
        return m * make(None, m, 2 * STAGES).steps() / (6 * m)
    return m + (STAGES - 1) / VIRTUAL[kind]


def _gpt(cfg: dict):
    import torch
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"],
                         n_head=cfg["heads"], n_embd=cfg["dim"], bias=False))


def _batches(cfg: dict, n: int) -> list:
    """``n`` global batches (ids, targets) of ``cfg['batch']`` sequences, the same on every rank."""
    import torch
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _stage_modules(gpt, bounds: Sequence[int]) -> list:
    """The GPT split by hand: stage ``k`` runs half-blocks ``bounds[k]:bounds[k + 1]`` (half-block
    ``2 i`` is block ``i``'s attention with its residual add, ``2 i + 1`` its MLP: cube's balance may
    cut a block between them), the first stage also the embeddings, the last also the final norm and
    the LM head (an untied copy of the token embedding)."""
    import torch
    import torch.nn as nn

    class Stage(nn.Module):
        def __init__(self, k: int):
            super().__init__()
            self.first, self.last = k == 0, k == len(bounds) - 2
            if self.first:
                self.wte, self.wpe = gpt.wte, gpt.wpe
            self.halves = list(range(bounds[k], bounds[k + 1]))
            held = sorted({h // 2 for h in self.halves})   # a block cut in two: each stage holds its half
            self.layers = nn.ModuleList(gpt.layers[i] for i in held)
            self.index = {i: j for j, i in enumerate(held)}
            if self.last:
                self.ln_f = gpt.ln_f
                self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.vocab_size, bias=False)
                self.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())   # untied copy

        def forward(self, x):
            if self.first:
                pos = torch.arange(0, x.size(1), dtype=torch.long, device=x.device)
                x = self.wte(x) + self.wpe(pos)
            for h in self.halves:
                block = self.layers[self.index[h // 2]]
                x = x + (block.mlp(block.ln_2(x)) if h % 2 else block.attn(block.ln_1(x)))
            return self.lm_head(self.ln_f(x)) if self.last else x

    return [Stage(k) for k in range(len(bounds) - 1)]


def _loss_fn(logits, targets):
    import torch.nn.functional as F
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class _Way:
    """One way of training: ``step()`` runs a step and records (pipeline, whole step) seconds."""

    def __init__(self, name: str, m: int, step):
        self.name, self.m, self._step = name, m, step
        self.pipe: List[float] = []
        self.whole: List[float] = []
        self.first_loss = None

    def step(self, record: bool = False) -> None:
        import torch.distributed as dist
        dist.barrier()
        t0 = time.perf_counter()
        loss, t1 = self._step()
        t2 = time.perf_counter()
        if self.first_loss is None:
            self.first_loss = float(loss) if loss is not None else float("nan")
        if record:
            self.pipe.append(t1 - t0)
            self.whole.append(t2 - t0)


def _cube_way(cfg: dict, m: int, base, cache: str, kind: str):
    """cube's ``kind`` pipeline with ``m`` micro-batches, and the blocks of each stage this rank runs."""
    import torch
    it = iter(_batches(cfg, 1 + 10000 // m))   # one global batch a step; the pipeline cuts it into m
    os.environ["CUBE_MICROS"] = str(m)   # read by the policy at compile time
    train_iter, gen = compile_gpt(copy.deepcopy(base), it, POLICY[kind], cache)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)

    def step():
        loss = train_iter(gen, it)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return loss, t1
    return _Way(f"cube {kind} m={m}", m, step), _stage_blocks(gen)


def _stage_blocks(gen) -> Dict[int, List[int]]:
    """Stage -> the GPT half-blocks (see ``_stage_modules``) whose parameters this rank's generated
    code reads in it (a rank holding one stage runs it as ``forward``; stage ``r`` on rank ``r``)."""
    import torch.distributed as dist
    cls = type(gen)
    methods = {int(n[len("stage_"):]): getattr(cls, n) for n in dir(cls) if re.fullmatch(r"stage_\d+", n)}
    out = {}
    for k, fn in (methods or {dist.get_rank(): cls.forward}).items():
        used = set(fn.__code__.co_names)
        out[k] = sorted({2 * int(n.split(".")[1]) + (n.split(".")[2] in ("ln_2", "mlp"))
                         for local, (names, _) in gen.PARAMS.items() if local in used
                         for n in names if n.startswith("layers.")})
    return out


def _bounds(every: List[Dict[int, List[int]]], layers: int) -> List[int]:
    """The first half-block of each stage and the half-block count, from every rank's ``_stage_blocks``."""
    blocks = {k: v for mine in every for k, v in mine.items()}
    bounds = [0]
    for k in sorted(blocks):   # a stage without blocks (norm and head alone) ends where it starts
        bounds.append(blocks[k][-1] + 1 if blocks[k] else bounds[-1])
    if bounds[-1] != 2 * layers or any(blocks[k] != list(range(bounds[k], bounds[k + 1])) for k in sorted(blocks)):
        raise RuntimeError(f"cube's stages are not consecutive runs of half-blocks covering all {2 * layers}: "
                           f"{blocks}")
    return bounds


def _torch_way(cfg: dict, m: int, base, bounds: List[int], rank: int, kind: str) -> _Way:
    """torch.distributed.pipelining over the stages of ``bounds``: ``Schedule1F1B`` with one stage per
    rank, ``ScheduleInterleaved1F1B`` with several (stage ``k`` on rank ``k % STAGES``), or
    ``ScheduleZBVZeroBubble`` or ``ScheduleDualPipeV`` (``kind`` ZB-V, DualPipeV: stages in a V)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)
    mods = _stage_modules(copy.deepcopy(base), bounds)
    n = len(mods)
    mine = [k for k in range(n) if _rank_of(kind, k, n) == rank]
    stages = [PipelineStage(mods[k], k, n, torch.device("cpu")) for k in mine]
    if kind == "ZB-V":
        sched = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=_loss_fn, scale_grads=True)
    elif kind == "DualPipeV":
        sched = ScheduleDualPipeV(stages, n_microbatches=m, loss_fn=_loss_fn, scale_grads=True)
    elif len(stages) == 1:
        sched = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=_loss_fn, scale_grads=True)
    else:
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=_loss_fn, scale_grads=True)
    opt = torch.optim.AdamW([p for k in mine for p in mods[k].parameters()], lr=1e-3)
    copies = [mods[k].wte.weight if k == 0 else mods[k].lm_head.weight for k in mine if k in (0, n - 1)]
    last = _rank_of(kind, n - 1, n)   # the rank computing the loss
    it = iter(_batches(cfg, 10000))

    def step():
        ids, tgt = next(it)
        losses = [] if rank == last else None
        if rank == 0:   # the first stage's rank feeds the batch (and the last's, in a V, the targets)
            sched.step(ids, target=tgt if rank == last else None, losses=losses, return_outputs=False)
        else:
            sched.step(target=tgt, losses=losses, return_outputs=False)   # no concatenated logits
        loss = torch.stack(losses).mean().detach() if losses else None
        # the untied embedding / LM head copies sum their gradients (on one rank in a V)
        if len(copies) == 2:
            total = copies[0].grad + copies[1].grad
            for c in copies:
                c.grad.copy_(total)
        elif copies:   # one copy on each of two ranks
            dist.all_reduce(copies[0].grad)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return loss, t1
    return _Way(f"torch {kind} m={m}", m, step)


class _Ideal:
    """This rank's stages alone: forward and backward of ``m`` micro-batches, no communication."""

    def __init__(self, cfg: dict, m: int, base, bounds: List[int], rank: int, kind: str):
        import torch
        mods = _stage_modules(copy.deepcopy(base), bounds)
        self.m, self.mods = m, [mods[k] for k in range(len(mods)) if _rank_of(kind, k, len(mods)) == rank]
        mb = cfg["batch"] // m
        gen = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, cfg["vocab"], (mb, cfg["seq"]), generator=gen)
        self.act = torch.randn(mb, cfg["seq"], cfg["dim"], generator=gen)
        self.times: List[float] = []

    def step(self, record: bool = False) -> None:
        import torch.distributed as dist
        for mod in self.mods:
            mod.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(self.m):
            for mod in self.mods:
                out = mod(self.ids if mod.first else self.act.clone().requires_grad_())
                if mod.last:
                    (_loss_fn(out, self.ids) / self.m).backward()
                else:
                    out.backward(self.act)
        if record:
            self.times.append(time.perf_counter() - t0)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import cube
    env = cube.init()
    rank, world = env.rank, env.world_size
    if world != STAGES:
        raise ValueError(f"benchmarks/pipeline.py runs {STAGES} ranks, got {world}")
    torch.set_num_threads(max(1, args.threads))
    cfg = {k: getattr(args, k) for k in DEFAULTS}
    base = _gpt(cfg)
    runners, ways, ideals, splits = [], [], {}, {}
    kinds = _kinds(args.kinds)
    for m in MICROS:
        for kind in kinds:
            cube_way, blocks = _cube_way(cfg, m, base, os.path.join(args.cache, "cube"), kind)
            every = [None] * world
            dist.all_gather_object(every, blocks)
            splits[kind] = bounds = _bounds(every, cfg["layers"])
            ideals[(kind, m)] = _Ideal(cfg, m, base, bounds, rank, kind)
            ways.append(cube_way)
            if TORCH[kind] is not None:
                ways.append(_torch_way(cfg, m, base, bounds, rank, kind))
            elif "1F1B" in splits and bounds != splits["1F1B"]:
                raise RuntimeError(f"{kind} split its stages {bounds} unlike 1F1B's {splits['1F1B']}: the "
                                   f"comparison with torch's 1F1B would not be on the same stages")
            runners += ways[-2:] if TORCH[kind] else ways[-1:]
            runners.append(ideals[(kind, m)])
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    for _ in range(args.rounds):
        for r in runners:
            for _ in range(args.steps):
                r.step(record=True)
    # the slowest rank's time of each step
    mine = {w.name: (w.pipe, w.whole, w.first_loss) for w in ways}
    mine.update({f"ideal {kind} m={m}": (ideal.times, None, None) for (kind, m), ideal in ideals.items()})
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        rows = _rows(every, splits, kinds)
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _kinds(text: str) -> List[str]:
    """The schedules named in ``--kinds`` (comma-separated; empty: all), in ``VIRTUAL``'s order.
    A kind without a torch schedule of its own (ZB-H1) brings 1F1B, its torch comparison."""
    asked = [k for k in text.split(",") if k] or list(VIRTUAL)
    unknown = [k for k in asked if k not in VIRTUAL]
    if unknown:
        raise ValueError(f"benchmarks/pipeline.py --kinds: unknown {unknown}; choose from {list(VIRTUAL)}")
    if any(TORCH[k] is None for k in asked):
        asked.append("1F1B")
    return [k for k in VIRTUAL if k in asked]


def _rows(every: list, splits: Dict[str, List[int]], kinds: Sequence[str]) -> List[dict]:
    def slowest(name: str, k: int) -> float:
        per_step = zip(*(ranks[name][k] for ranks in every))
        return statistics.median(max(ts) for ts in per_step) * 1e3

    rows = []
    for m in MICROS:
        first = {}
        for ranks in every:   # the loss is known on the rank of the last stage
            for name, (_, _, loss) in ranks.items():
                if name.endswith(f" m={m}") and loss is not None and loss == loss:
                    first[name[:-len(f" m={m}")]] = loss
        ref = next(iter(first.values()))
        if not all(abs(v - ref) <= 1e-5 * abs(ref) for v in first.values()):
            raise RuntimeError(f"m={m}: the first step's losses differ ({first}): the pipelines do not train "
                               f"the same model")
        got = {}
        for kind in kinds:
            ideal = max(statistics.median(ranks[f"ideal {kind} m={m}"][0]) for ranks in every) * 1e3
            bound = ideal * _bound_steps(kind, m) / m
            for who in ("cube", "torch") if TORCH[kind] else ("cube",):
                name = f"{who} {kind} m={m}"
                pipe, whole = slowest(name, 0), slowest(name, 1)
                got[f"{who} {kind}"] = whole
                rows.append({"benchmark": "pipeline", "name": name, "micro_batches": m, "ms_per_step": whole,
                             "pipeline_ms": pipe, "bound_ms": bound, "bound_share": bound / pipe,
                             "bubble": 1 - ideal / pipe, "bound_bubble": 1 - ideal / bound,
                             "ideal_rank_ms": ideal, "first_loss": first[f"{who} {kind}"],
                             "stage_blocks": splits[kind],
                             **({"target": "bound_share >= 0.90"} if who == "cube" else {})})
        for a, b, target in (("cube 1F1B", "torch 1F1B", "<= 0.95"),
                             ("cube interleaved", "torch interleaved", "<= 0.95"),
                             ("cube interleaved", "torch 1F1B", ""),
                             ("cube ZB-H1", "torch 1F1B", "<= 0.90" if m == 4 else ""),
                             ("cube ZB-H1", "cube 1F1B", ""),
                             ("cube ZB-V", "torch ZB-V", "<= 0.95"),
                             ("cube DualPipeV", "torch DualPipeV", "<= 0.95"),
                             ("cube DualPipeV", "cube 1F1B", "")):
            if a not in got or b not in got:   # a kind left out by --kinds
                continue
            rows.append({"benchmark": "pipeline", "name": f"{a} / {b} m={m}", "micro_batches": m,
                         "time_ratio": got[a] / got[b], **({"target": target} if target else {})})
    return rows


def _describe(bounds: List[int]) -> str:
    """Half-block bounds ``[0, 5, 8]`` -> ``embeddings + blocks 0..1 + attention of block 2 | MLP of
    block 2 + block 3 + norm + head + loss``."""
    parts = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]   # half-blocks a..b-1
        part = ["embeddings"] if k == 0 else []
        if a % 2 and a < b:
            part.append(f"MLP of block {a // 2}")
            a += 1
        tail = f"attention of block {b // 2}" if b % 2 and a < b else None
        b -= 1 if tail else 0
        if a < b:
            first, last = a // 2, b // 2 - 1
            part.append(f"block {first}" if first == last else f"blocks {first}..{last}")
        part += [tail] if tail else []
        part += ["norm + head + loss"] if k == len(bounds) - 2 else []
        parts.append(" + ".join(part))
    return " | ".join(parts)


def report(rows: List[dict], cfg: dict, nsteps: int) -> None:
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, T{cfg['seq']}, vocab {cfg['vocab']}, global batch "
          f"{cfg['batch']}, {STAGES} ranks (gloo, CPU), median of {nsteps} steps")
    for kind in VIRTUAL:
        bounds = next((r["stage_blocks"] for r in rows if r["name"].startswith(f"cube {kind} ")), None)
        if bounds is None:   # left out by --kinds
            continue
        where = "in a V" if kind in V_KINDS else f"stage k on rank k % {STAGES}"
        print(f"{kind} stages ({where}): {_describe(bounds)}")
    print(f"{'way':<26}{'ms/step':>10}{'pipeline':>10}{'bound':>9}{'share':>8}{'bubble':>8}{'bound':>7}"
          f"{'loss0':>10}")
    for r in rows:
        if "ms_per_step" in r:
            print(f"{r['name']:<26}{r['ms_per_step']:>10.1f}{r['pipeline_ms']:>10.1f}{r['bound_ms']:>9.1f}"
                  f"{r['bound_share']:>8.2f}{r['bubble']:>8.2f}{r['bound_bubble']:>7.2f}{r['first_loss']:>10.5f}")
    for r in rows:
        if "time_ratio" in r:
            target = f" (target {r['target']})" if "target" in r else ""
            print(f"ratio {r['name']}: {r['time_ratio']:.3f}{target}")


def main(quick: bool = False, predict: bool = True, **kwargs) -> List[dict]:
    """Runs the benchmark under torchrun (``quick``: 4 rounds), prints the table, returns the rows;
    ``predict``: also cube.sim's predictions of cube's ways (``_predictions``).

    Raises:
        RuntimeError: the torchrun job failed (its output is shown).
    """
    settings = {"steps": 1, "warmup": 1, "rounds": 4} if quick else {"steps": 1, "warmup": 2, "rounds": 20}
    settings.update({"threads": 1, "kinds": "", **DEFAULTS})
    settings.update(kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={STAGES}",
               "--master_addr=127.0.0.1", f"--master_port={port()}", __file__, "--worker",
               f"--cache={tmp}", f"--out={out}"] + [f"--{k}={v}" for k, v in settings.items()]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        for name in ("CUBE_MICROS", "CUBE_VIRTUAL", "CUBE_RECOMPUTE"):   # the policies' defaults
            env.pop(name, None)
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"benchmarks/pipeline.py: torchrun failed ({proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            rows = json.load(f)
    cfg = {k: settings[k] for k in DEFAULTS}
    report(rows, cfg, settings["steps"] * settings["rounds"])
    if predict:
        rows += _predictions(rows, cfg)
    return rows


def _predictions(rows: List[dict], cfg: dict) -> List[dict]:
    """cube.sim's step time of each cube way (this host's profiled op costs, calibrated gloo, the
    ranks sharing its cores), and its zero-bubble gains over 1F1B next to the measured ones."""
    from cube.sim.api import default_models, simulate_policy
    costs, comm, host = default_models(STAGES)
    model, batch = _gpt(cfg), _batches(cfg, 1)[0]
    measured = {r["name"]: r["ms_per_step"] for r in rows if "ms_per_step" in r and r["name"].startswith("cube ")}
    out, predicted = [], {}
    print(f"{'way':<26}{'measured':>10}{'predicted':>10}")
    for name, ms in measured.items():
        kind, m = name[len("cube "):].rsplit(" m=", 1)
        res = simulate_policy(model, batch, POLICY[kind], STAGES, costs=costs, comm=comm, host=host,
                              options={"nmicros": int(m)})
        predicted[name] = res.step_time * 1e3
        print(f"{name:<26}{ms:>10.1f}{predicted[name]:>10.1f}")
    for m in MICROS:
        for kind in ("ZB-H1", "ZB-V"):
            a, b = f"cube {kind} m={m}", f"cube 1F1B m={m}"
            if a not in measured or b not in measured:   # left out by --kinds
                continue
            got, want = 1 - measured[a] / measured[b], 1 - predicted[a] / predicted[b]
            out.append({"benchmark": "pipeline", "name": f"{kind} gain over 1F1B m={m}", "micro_batches": m,
                        "measured_gain": got, "predicted_gain": want, "points_off": abs(got - want) * 100,
                        "target": "points_off <= 10"})
            print(f"{kind} gain over cube 1F1B m={m}: measured {got:+.1%}, predicted {want:+.1%} "
                  f"({abs(got - want) * 100:.1f} points apart; target <= 10)")
    return out



def _cli() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 rounds (default 20)")
    p.add_argument("--steps", type=int, help="timed steps of each way per round (default 1)")
    p.add_argument("--warmup", type=int, help="untimed steps of each way before the rounds (default 2)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default 1)")
    p.add_argument("--kinds", help=f"comma-separated schedules to run (default all: {','.join(VIRTUAL)})")
    for k in DEFAULTS:
        p.add_argument(f"--{k}", type=int)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    kwargs = {k: v for k, v in vars(args).items() if v is not None and k not in ("quick", "worker", "cache", "out")}
    main(args.quick, **kwargs)


if __name__ == "__main__":
    _cli()
