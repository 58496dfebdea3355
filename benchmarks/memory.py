"""cube's activation recompute side by side with torch.utils.checkpoint, in one process.

    python -m benchmarks.memory [--quick] [--steps 10] [--rounds 3]

Trains the same GPT (4 layers, d256, T64, batch 16, AdamW) four ways,
interleaved round by round so machine noise hits all alike:

- plain torch                 vs cube ``PASSingle``
- torch ``checkpoint`` around each block (use_reentrant=False, by hand)
                              vs cube ``PASSingle`` with every block recomputed
                              (``recompute_blocks(graph, "all")``, what ``CUBE_RECOMPUTE=all`` does)

and prints the median step time of each, the activation bytes each forward
keeps for backward, and the ratios cube / torch (lower is better for cube). A
step is forward, backward and the optimizer.

Kept bytes are those of the distinct storages autograd packs for backward
(``saved_tensors_hooks``; parameters excluded) plus the inputs
``torch.utils.checkpoint`` holds to recompute from (inside a checkpoint
nothing is packed: that is what it saves).
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, List, Tuple

import torch
import torch.utils.checkpoint

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # python benchmarks/memory.py as well as python -m benchmarks.memory
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import adamw_step  # noqa: E402

DEFAULTS = {"layers": 4, "dim": 256, "heads": 8, "seq": 64, "batch": 16, "vocab": 2048}


def _gpt(cfg: dict):
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"],
                         n_head=cfg["heads"], n_embd=cfg["dim"], bias=False))


def _batches(cfg: dict, n: int, device):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
        out.append((ids.to(device), torch.roll(ids, -1, dims=1).to(device)))
    return out


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Checkpointed(torch.nn.Module):
    """A block run through ``torch.utils.checkpoint`` (what one writes by hand)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def kept_bytes(forward: Callable[[], torch.Tensor], params) -> Tuple[torch.Tensor, int]:
    """Runs ``forward()``; returns its result and the bytes of activations it keeps for backward.

    Counts each storage once: those autograd packs (parameters excluded) and
    those passed to ``torch.utils.checkpoint.checkpoint`` (looked up at call
    time by cube's generated code and by :class:`_Checkpointed` alike).
    """
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def note(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()

    def pack(t):
        note(t)
        return t

    original = torch.utils.checkpoint.checkpoint

    def counting(fn, *args, **kwargs):
        for a in args:
            if isinstance(a, torch.Tensor):
                note(a)
        return original(fn, *args, **kwargs)

    torch.utils.checkpoint.checkpoint = counting
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward()
    finally:
        torch.utils.checkpoint.checkpoint = original
    return out, sum(seen.values())


class _Way:
    """One way of training: ``step()`` runs one full step on the next batch; ``kept`` is measured once."""

    def __init__(self, name: str, model, forward, step, device):
        self.name, self.times, self.device = name, [], device
        sample_loss, self.kept = kept_bytes(forward, list(model.parameters()))
        sample_loss.backward()
        for p in model.parameters():
            p.grad = None
        self.step = step

    def timed(self, n: int) -> None:
        for _ in range(n):
            _sync(self.device)
            t0 = time.perf_counter()
            self.step()
            _sync(self.device)
            self.times.append(time.perf_counter() - t0)


def _torch_way(name: str, model, batches, device) -> _Way:
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(batches)

    def step():
        loss = model(*next(it))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return _Way(name, model, lambda: model(*batches[0]), step, device)


def _cube_way(name: str, model, batches, policy, cache: str, device) -> _Way:
    step, gen = adamw_step(model, batches, policy, cache)
    return _Way(name, gen, lambda: gen(*batches[0]), step, device)


def PASRecomputeAll(graph, resource):
    """PASSingle with every transformer block recomputed."""
    from cube.ir.blocks import recompute_blocks
    from cube.policies.single import PASSingle
    PASSingle(graph, resource)
    recompute_blocks(graph, "all")
    return graph


def run(steps: int = 10, warmup: int = 2, rounds: int = 3, **cfg) -> List[dict]:
    """Measures the four ways; returns one row per way and one of ratios (see the module doc)."""
    import cube
    from cube.policies.single import PASSingle
    device = cube.init().device   # cube runs on the GPU when there is one: torch does too
    cfg = {**DEFAULTS, **cfg}
    total = rounds * (steps + warmup) + 1
    base = _gpt(cfg)
    wrapped = copy.deepcopy(base)
    wrapped.layers = torch.nn.ModuleList(_Checkpointed(b) for b in wrapped.layers)
    with tempfile.TemporaryDirectory() as cache:
        ways = [
            _torch_way("torch", copy.deepcopy(base), _batches(cfg, total, device), device),
            _cube_way("cube PASSingle", copy.deepcopy(base), _batches(cfg, total, device), PASSingle, cache, device),
            _torch_way("torch checkpoint", wrapped, _batches(cfg, total, device), device),
            _cube_way("cube recompute", copy.deepcopy(base), _batches(cfg, total, device), PASRecomputeAll, cache,
                      device),
        ]
    for _ in range(rounds):
        for w in ways:
            for _ in range(warmup):
                w.step()
            w.timed(steps)
    rows = [{"benchmark": "memory", "name": w.name, "ms_per_step": statistics.median(w.times) * 1e3,
             "kept_mib": w.kept / 2**20} for w in ways]
    by = {r["name"]: r for r in rows}
    for cube_name, torch_name in (("cube recompute", "torch checkpoint"), ("cube PASSingle", "torch")):
        a, b = by[cube_name], by[torch_name]
        rows.append({"benchmark": "memory", "name": f"{cube_name} / {torch_name}",
                     "time_ratio": a["ms_per_step"] / b["ms_per_step"], "kept_ratio": a["kept_mib"] / b["kept_mib"]})
    return rows


def report(rows: List[dict], cfg: dict, nsteps: int) -> None:
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, T{cfg['seq']}, batch {cfg['batch']}, one process "
          f"({where}), median of {nsteps} steps")
    print(f"{'way':<20}{'ms/step':>10}{'kept MiB':>10}")
    for r in rows:
        if "ms_per_step" in r:
            print(f"{r['name']:<20}{r['ms_per_step']:>10.1f}{r['kept_mib']:>10.2f}")
    for r in rows:
        if "time_ratio" in r:
            print(f"ratio {r['name']}:  time {r['time_ratio']:.3f}  kept {r['kept_ratio']:.3f}")


def main(quick: bool = False, **kwargs) -> List[dict]:
    """Runs the benchmark (``quick``: 1 round of 3 steps), prints the table, returns the rows."""
    settings = {"steps": 3, "warmup": 1, "rounds": 1} if quick else {"steps": 10, "warmup": 2, "rounds": 3}
    settings.update(kwargs)
    rows = run(**settings)
    cfg = {k: settings.get(k, v) for k, v in DEFAULTS.items()}
    report(rows, cfg, settings["steps"] * settings["rounds"])
    return rows


def _cli() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 round of 3 steps")
    p.add_argument("--steps", type=int, help="timed steps per round")
    p.add_argument("--warmup", type=int, help="untimed steps before each round")
    p.add_argument("--rounds", type=int)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (default: torch's)")
    for k, v in DEFAULTS.items():
        p.add_argument(f"--{k}", type=int, default=v)
    args = vars(p.parse_args())
    quick, threads = args.pop("quick"), args.pop("threads")
    if threads:
        torch.set_num_threads(threads)
    main(quick, **{k: v for k, v in args.items() if v is not None})


if __name__ == "__main__":
    _cli()
