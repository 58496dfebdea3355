"""Spatial partitioning of the stencil model (examples/spatial): memory, halo bytes and speed.

    python -m benchmarks.spatial [--quick] [--size 1024] [--steps 10]

A 1024 x 1024 field of 4 variables advanced by 4 learnable 3 x 3 stencils (AdamW):

- memory: the activation bytes each rank keeps for backward (``saved_tensors_hooks``, parameters
  excluded) split 2 x 2 over 4 ranks, against the single-device model (target <= 0.3x);
- halo bytes per step on a rank of the 2 x 2 grid, measured at the exchange, next to the
  geometry's formula (per conv, forward and backward: one row of the block to the H neighbour,
  one column of the H window, block + 2 rows, to the W neighbour; no backward through the first
  conv, whose input needs no gradient);
- speed: the median step time of cube's 2-way H split against one process and against a
  hand-written halo exchange with ``torch.distributed`` (the same split, blocks and gradient sum
  written by hand; target: cube within 1.1x).

On this machine the ranks are processes sharing the CPU cores, so speed-ups depend on the cores.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import kept_bytes, run_rows, worker_cli  # noqa: E402

DEFAULTS = {"size": 1024, "steps": 10, "channels": 4, "layers": 4, "batch": 1}
QUICK = {"size": 512, "steps": 4}


def _model(cfg):
    from examples.spatial.model import Stencil
    torch.manual_seed(0)
    return Stencil(channels=cfg["channels"], steps=cfg["layers"])


def _batches(cfg, n):
    gen = torch.Generator().manual_seed(1)
    shape = (cfg["batch"], cfg["channels"], cfg["size"], cfg["size"])
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(n)]


def _median_step(step, n: int) -> float:
    step()   # warm-up
    times = []
    for _ in range(n):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved(steps, n: int):
    """Median step time of each of ``steps``, timed in alternation so machine noise hits all alike."""
    for step in steps:
        step()   # warm-up
    times = [[] for _ in steps]
    for _ in range(n):
        for k, step in enumerate(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _cube(cfg, dims, cache):
    import functools

    import cube
    from cube.policies.spatial import PASSpatial
    batches = _batches(cfg, cfg["steps"] + 3)
    it = iter(batches)

    @cube.compile(_model(cfg), it, PAS=functools.partial(PASSpatial, dims=dims), cache_dir=cache)
    def train_iter(model, dataloader):
        loss = model(*next(dataloader))
        loss.backward()
        return loss
    gen = cube.load_model()
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)

    def step():
        train_iter(gen, it)
        opt.step()
        opt.zero_grad()
    return gen, step, batches


class _Halo(torch.autograd.Function):
    """Hand-written: one row from each H neighbour (zeros at the borders); backward sends the
    halo rows' gradients back."""

    @staticmethod
    def forward(ctx, x, rank, world):
        ctx.rank, ctx.world = rank, world
        up, down = torch.zeros_like(x[:, :, :1]), torch.zeros_like(x[:, :, :1])
        ops = []
        if rank > 0:
            ops += [dist.P2POp(dist.isend, x[:, :, :1].contiguous(), rank - 1), dist.P2POp(dist.irecv, up, rank - 1)]
        if rank < world - 1:
            ops += [dist.P2POp(dist.isend, x[:, :, -1:].contiguous(), rank + 1),
                    dist.P2POp(dist.irecv, down, rank + 1)]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        return torch.cat([up, x, down], dim=2)

    @staticmethod
    def backward(ctx, g):
        rank, world = ctx.rank, ctx.world
        gx = g[:, :, 1:-1].clone()
        from_up, from_down = torch.zeros_like(gx[:, :, :1]), torch.zeros_like(gx[:, :, :1])
        ops = []
        if rank > 0:
            ops += [dist.P2POp(dist.isend, g[:, :, :1].contiguous(), rank - 1),
                    dist.P2POp(dist.irecv, from_up, rank - 1)]
        if rank < world - 1:
            ops += [dist.P2POp(dist.isend, g[:, :, -1:].contiguous(), rank + 1),
                    dist.P2POp(dist.irecv, from_down, rank + 1)]
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
        gx[:, :, :1] += from_up
        gx[:, :, -1:] += from_down
        return gx, None, None


def _hand(cfg):
    """The stencil model split along H by hand: blocks, halo rows, padding only along W, the loss's
    partial sums and the gradients all-reduced."""
    model = _model(cfg)
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches(cfg, cfg["steps"] + 3)
    rows = cfg["size"] // world
    blocks = [tuple(t[:, :, rank * rows:(rank + 1) * rows].contiguous() for t in b) for b in batches]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(blocks)
    count = batches[0][0].numel()

    def step():
        x, target = next(it)
        for conv in model.stencils:
            w = _Halo.apply(x, rank, world)
            x = x + model.dt * torch.tanh(F.conv2d(w, conv.weight, conv.bias, padding=(0, 1)))
        loss = F.mse_loss(x, target, reduction="sum") / count
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        total = loss.detach().clone()
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
    return step


def _count_halo_bytes():
    """Wraps the runtime's exchange to count the bytes this rank sends."""
    import cube.runtime.halo as halo
    sent = [0]
    original = halo._exchange

    def counting(sends, recvs):
        sent[0] += sum(t.numel() * t.element_size() for _, t in sends)
        return original(sends, recvs)
    halo._exchange = counting
    return sent


def worker(args) -> None:
    """One rank of a torchrun job (``--mode grid``: 2 x 2 memory and halo bytes; ``split``: speed)."""
    cfg, cache, out = vars(args), args.cache, args.out
    rank = int(__import__("os").environ.get("RANK", "0"))
    rows = []
    if cfg["mode"] == "grid":
        gen, step, batches = _cube(cfg, "HW", cache)
        sent = _count_halo_bytes()
        step()
        per_step = sent[0]
        kept = kept_bytes(lambda: gen(*[t for t in batches[1]]), list(gen.parameters()))
        rows.append({"rank": rank, "kept": kept, "halo": per_step})
    else:
        _, step, _ = _cube(cfg, "H", cache)
        hand = _hand(cfg)
        cube_t, hand_t = _interleaved([step, hand], cfg["steps"])
        rows.append({"rank": rank, "cube": cube_t, "hand": hand_t})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)


def _single(cfg):
    model = _model(cfg)
    batches = _batches(cfg, cfg["steps"] + 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(batches)

    def step():
        model(*next(it)).backward()
        opt.step()
        opt.zero_grad()
    kept = kept_bytes(lambda: model(*batches[0]), list(model.parameters()))
    model.zero_grad()
    return kept, _median_step(step, cfg["steps"])


def main(quick: bool = False, **overrides):
    cfg = dict(DEFAULTS, **(QUICK if quick else {}), **overrides)
    n, b, c, layers = cfg["size"], cfg["batch"], cfg["channels"], cfg["layers"]
    kept1, single_t = _single(cfg)
    grid = run_rows(Path(__file__), dict(cfg, nproc=4, mode="grid"))[0]
    split = run_rows(Path(__file__), dict(cfg, nproc=2, mode="split"))[0]
    # forward through every conv, backward through all but the first (the field needs no gradient)
    formula = (2 * layers - 1) * b * c * ((n // 2) + (n // 2 + 2)) * 4
    rows = [
        {"metric": "kept activations, rank 0 of 2 x 2 / single device", "value": grid["kept"] / kept1,
         "detail": f"{grid['kept'] / 2**20:.1f} MiB / {kept1 / 2**20:.1f} MiB (target <= 0.3)"},
        {"metric": "halo bytes per step, rank 0 of 2 x 2", "value": grid["halo"],
         "detail": f"formula ({layers} fw + {layers - 1} bw) x {b}x{c} x ({n // 2} + {n // 2 + 2}) x 4 B = {formula}"},
        {"metric": "step time, cube H split 2 / one process", "value": split["cube"] / single_t,
         "detail": f"{split['cube'] * 1e3:.1f} ms / {single_t * 1e3:.1f} ms"},
        {"metric": "step time, cube / hand-written halo exchange (2 ranks)", "value": split["cube"] / split["hand"],
         "detail": f"{split['cube'] * 1e3:.1f} ms / {split['hand'] * 1e3:.1f} ms (target <= 1.1)"},
    ]
    print(f"stencil model {b}x{c}x{n}x{n}, {layers} 3x3 stencils, AdamW")
    for r in rows:
        v = r["value"]
        print(f"  {r['metric']:<58} {v:>10.3f}   {r['detail']}" if isinstance(v, float) else
              f"  {r['metric']:<58} {v:>10}   {r['detail']}")
    return rows


if __name__ == "__main__":
    sys.exit(worker_cli(__doc__, dict(DEFAULTS, mode="grid"), "a 512 x 512 field, 4 timed steps",
                        worker, lambda quick, **kw: main(quick, **{k: v for k, v in kw.items() if k != "mode"})))
