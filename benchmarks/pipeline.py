"""cube's 1F1B pipeline side by side with torch.distributed.pipelining, in one torchrun job.

    python -m benchmarks.pipeline [--quick] [--rounds 20] [--steps 1]

Launches one torchrun job (2 ranks, gloo on CPU) in which both ranks train the
same GPT (4 layers, d256, 8 heads, T64, vocab 2048, global batch 16, AdamW) as
a two-stage pipeline with ``m = 4`` and ``m = 8`` micro-batches (16 / m
sequences each), after ``warmup`` steps of each, interleaved round by round
(each round runs ``steps`` steps of every way in turn; one by default) so
machine noise hits all alike:

- cube ``policies.pipeline:PAS1F1B`` (stages balanced by ``cube.schedule.balance``:
  embeddings and blocks 0-1 | blocks 2-3, final norm, LM head and loss), and
- ``torch.distributed.pipelining`` ``PipelineStage`` + ``Schedule1F1B`` over the
  same split, written by hand as two ``nn.Module`` s (the first takes the token
  ids, the last returns logits and the schedule's ``loss_fn`` takes the mean
  cross entropy; ``scale_grads=True`` makes the gradients those of the mean
  micro-batch loss, as cube's are; ``return_outputs=False``, as nothing reads
  the logits).

Tied weights: the GPT ties the token embedding (stage 0) and the LM head
(stage 1). cube keeps them tied: one parameter whose gradient is summed over
the two ranks by its reducer. For torch the last stage holds an untied copy
(``lm_head.weight`` cloned from ``wte.weight``) and after each backward the two
copies' gradients are summed with one ``all_reduce`` (what Megatron-LM does for
its embedding group), so both copies stay equal and training matches the tied
model. The first step's losses of the two are checked to agree.

Measures, each the median over steps of the slowest rank's time:

- ``ms_per_step``: a whole step (the schedule, gradient sums, AdamW step).
- ``pipeline_ms``: the schedule alone (forward and backward of every
  micro-batch, sends, receives and the gradient sums; no optimizer).
- ``bound_ms``: the 1F1B bound of the pipeline part,
  ``T x (m + p - 1) / m`` with ``p = 2`` stages, where ``T`` (the ideal stage
  time) is the larger over the two stages of the time one stage takes to run
  forward and backward for all ``m`` micro-batches of a step back to back,
  alone: no sends, receives or waits (its inputs and output gradients are
  made locally), each rank timing its own stage at the same time as the other
  (the same contention as in the pipeline), with the hand-split torch modules,
  median over the same rounds. ``(m + p - 1) / m`` is the fill and drain of
  1F1B when every micro-step of a stage takes ``T / m``.
- ``bound_share``: ``bound_ms / pipeline_ms`` (1.0 reaches the bound).

Ratios: ``time_ratio`` = cube ms/step / torch ms/step (target <= 0.95);
cube's bound share target is >= 0.90.
"""
from __future__ import annotations

import argparse
import copy
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
if str(ROOT) not in sys.path:   # python benchmarks/pipeline.py as well as python -m benchmarks.pipeline
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt  # noqa: E402

DEFAULTS = {"layers": 4, "dim": 256, "heads": 8, "seq": 64, "batch": 16, "vocab": 2048}
MICROS = (4, 8)
STAGES = 2


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


def _stage_modules(gpt, cut: int):
    """The GPT split by hand at block ``cut``: (embeddings + blocks[:cut], blocks[cut:] + norm + head).

    The last stage's LM head is an untied copy of the token embedding.
    """
    import torch
    import torch.nn as nn

    class First(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe = gpt.wte, gpt.wpe
            self.layers = nn.ModuleList(gpt.layers[:cut])

        def forward(self, idx):
            pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for block in self.layers:
                x = block(x)
            return x

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(gpt.layers[cut:])
            self.ln_f = gpt.ln_f
            self.lm_head = nn.Linear(gpt.config.n_embd, gpt.config.vocab_size, bias=False)
            self.lm_head.weight = nn.Parameter(gpt.wte.weight.detach().clone())   # untied copy

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return First(), Last()


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


def _cube_way(cfg: dict, m: int, base, cache: str) -> _Way:
    """cube PAS1F1B with ``m`` micro-batches, and the indices of the blocks this rank's stage holds."""
    import torch
    full = _batches(cfg, 1 + 10000 // m)
    it = iter([tuple(t.chunk(m)[k] for t in b) for b in full for k in range(m)])
    os.environ["CUBE_MICROS"] = str(m)   # read by the policy at compile time
    train_iter, gen = compile_gpt(copy.deepcopy(base), it, "policies.pipeline:PAS1F1B", cache)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)

    def step():
        loss = train_iter(gen, it)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return loss, t1
    held = {int(n.split(".")[1]) for names, _ in gen.PARAMS.values() for n in names if n.startswith("layers.")}
    return _Way(f"cube 1F1B m={m}", m, step), held


def _torch_way(cfg: dict, m: int, base, cut: int, rank: int) -> _Way:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    first, last = _stage_modules(copy.deepcopy(base), cut)
    mod = first if rank == 0 else last
    stage = PipelineStage(mod, rank, STAGES, torch.device("cpu"))
    sched = Schedule1F1B(stage, n_microbatches=m, loss_fn=_loss_fn, scale_grads=True)
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
    tied = mod.wte.weight if rank == 0 else mod.lm_head.weight
    it = iter(_batches(cfg, 10000))

    def step():
        ids, tgt = next(it)
        if rank == 0:
            sched.step(ids, return_outputs=False)
            loss = None
        else:
            losses = []
            sched.step(target=tgt, losses=losses, return_outputs=False)   # no concatenated logits
            loss = torch.stack(losses).mean().detach()
        dist.all_reduce(tied.grad)   # the untied embedding / LM head copies sum their gradients
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        return loss, t1
    return _Way(f"torch 1F1B m={m}", m, step)


class _Ideal:
    """This rank's stage alone: forward and backward of ``m`` micro-batches, no communication."""

    def __init__(self, cfg: dict, m: int, base, cut: int, rank: int):
        import torch
        first, last = _stage_modules(copy.deepcopy(base), cut)
        self.m, self.rank, self.mod = m, rank, first if rank == 0 else last
        mb = cfg["batch"] // m
        gen = torch.Generator().manual_seed(2)
        self.ids = torch.randint(0, cfg["vocab"], (mb, cfg["seq"]), generator=gen)
        self.act = torch.randn(mb, cfg["seq"], cfg["dim"], generator=gen)
        self.times: List[float] = []

    def step(self, record: bool = False) -> None:
        import torch.distributed as dist
        self.mod.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(self.m):
            if self.rank == 0:
                out = self.mod(self.ids)
                out.backward(self.act)
            else:
                x = self.act.clone().requires_grad_()
                (_loss_fn(self.mod(x), self.ids) / self.m).backward()
        if record:
            self.times.append(time.perf_counter() - t0)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    import cube
    env = cube.init()
    rank, world = env.rank, env.world_size
    if world != STAGES:
        raise ValueError(f"benchmarks/pipeline.py runs {STAGES} ranks (one per stage), got {world}")
    torch.set_num_threads(max(1, args.threads))
    cfg = {k: getattr(args, k) for k in DEFAULTS}
    base = _gpt(cfg)
    ways, ideals = [], {}
    for m in MICROS:
        cube_way, held = _cube_way(cfg, m, base, os.path.join(args.cache, "cube"))
        cut = min(held) if rank == 1 else max(held) + 1   # cube's balanced split, in blocks
        cuts = [None] * world
        dist.all_gather_object(cuts, cut)
        assert cuts[0] == cuts[1], f"stage 0 holds blocks before {cuts[0]}, stage 1 from {cuts[1]}"
        ways += [cube_way, _torch_way(cfg, m, base, cut, rank)]
        ideals[m] = _Ideal(cfg, m, base, cut, rank)
    runners = [r for m in MICROS for r in (ways[2 * MICROS.index(m)], ways[2 * MICROS.index(m) + 1], ideals[m])]
    for r in runners:
        for _ in range(args.warmup):
            r.step()
    for _ in range(args.rounds):
        for r in runners:
            for _ in range(args.steps):
                r.step(record=True)
    # the slowest rank's time of each step
    mine = {w.name: (w.pipe, w.whole, w.first_loss) for w in ways}
    mine.update({f"ideal m={m}": (ideals[m].times, None, None) for m in MICROS})
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        rows = _rows(every, cut)
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _rows(every: list, cut: int) -> List[dict]:
    def slowest(name: str, k: int) -> float:
        per_step = zip(*(ranks[name][k] for ranks in every))
        return statistics.median(max(ts) for ts in per_step) * 1e3

    rows = []
    for m in MICROS:
        a, b = (every[STAGES - 1][f"{who} 1F1B m={m}"][2] for who in ("cube", "torch"))
        if not abs(a - b) <= 1e-5 * abs(b):
            raise RuntimeError(f"m={m}: the first step's loss differs between cube ({a}) and torch ({b}): "
                               f"the two pipelines do not train the same model")
        ideal = max(statistics.median(ranks[f"ideal m={m}"][0]) for ranks in every) * 1e3
        bound = ideal * (m + STAGES - 1) / m
        got = {}
        for who in ("cube", "torch"):
            name = f"{who} 1F1B m={m}"
            pipe, whole = slowest(name, 0), slowest(name, 1)
            got[who] = whole
            rows.append({"benchmark": "pipeline", "name": name, "micro_batches": m, "ms_per_step": whole,
                         "pipeline_ms": pipe, "bound_ms": bound, "bound_share": bound / pipe,
                         "first_loss": every[STAGES - 1][name][2], "cut_block": cut,
                         **({"target": "bound_share >= 0.90"} if who == "cube" else {})})
        rows.append({"benchmark": "pipeline", "name": f"cube / torch m={m}", "micro_batches": m,
                     "time_ratio": got["cube"] / got["torch"], "target": "<= 0.95",
                     "ideal_stage_ms": ideal})
    return rows


def report(rows: List[dict], cfg: dict, nsteps: int) -> None:
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, T{cfg['seq']}, vocab {cfg['vocab']}, global batch "
          f"{cfg['batch']}, {STAGES} stages on {STAGES} ranks (gloo, CPU), median of {nsteps} steps")
    cut = next(r["cut_block"] for r in rows if "cut_block" in r)
    print(f"stages: embeddings + blocks 0..{cut - 1} | blocks {cut}..{cfg['layers'] - 1} + norm + head + loss")
    print(f"{'way':<20}{'ms/step':>10}{'pipeline':>10}{'bound':>9}{'share':>8}{'loss0':>10}")
    for r in rows:
        if "ms_per_step" in r:
            print(f"{r['name']:<20}{r['ms_per_step']:>10.1f}{r['pipeline_ms']:>10.1f}{r['bound_ms']:>9.1f}"
                  f"{r['bound_share']:>8.2f}{r['first_loss']:>10.5f}")
    for r in rows:
        if "time_ratio" in r:
            print(f"ratio {r['name']}: {r['time_ratio']:.3f} (target <= 0.95); ideal stage "
                  f"{r['ideal_stage_ms']:.1f} ms for {r['micro_batches']} micro-batches")


def main(quick: bool = False, **kwargs) -> List[dict]:
    """Runs the benchmark under torchrun (``quick``: 4 rounds), prints the table, returns the rows.

    Raises:
        RuntimeError: the torchrun job failed (its output is shown).
    """
    settings = {"steps": 1, "warmup": 1, "rounds": 4} if quick else {"steps": 1, "warmup": 2, "rounds": 20}
    settings.update({"threads": 1, **DEFAULTS})
    settings.update(kwargs)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={STAGES}",
               "--master_addr=127.0.0.1", f"--master_port={_port()}", __file__, "--worker",
               f"--cache={tmp}", f"--out={out}"] + [f"--{k}={v}" for k, v in settings.items()]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        env.pop("CUBE_MICROS", None)
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"benchmarks/pipeline.py: torchrun failed ({proc.returncode}):\n"
                               f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
        with open(out) as f:
            rows = json.load(f)
    report(rows, {k: settings[k] for k in DEFAULTS}, settings["steps"] * settings["rounds"])
    return rows


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="4 rounds (default 20)")
    p.add_argument("--steps", type=int, help="timed steps of each way per round (default 1)")
    p.add_argument("--warmup", type=int, help="untimed steps of each way before the rounds (default 2)")
    p.add_argument("--rounds", type=int)
    p.add_argument("--threads", type=int, help="intra-op threads per rank (default 1)")
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
