"""cube at world size 1 vs plain eager PyTorch on one GPU: what cube's runtime costs.

    python -m benchmarks.gpu [--quick]

GPT (12 layers, d1024, 16 heads, batch 8, sequence 1024), bf16 autocast over
float32 parameters, AdamW, on ``cuda:0``: the plain model in eager mode, and the
same model compiled by cube with ``PASSingle`` and ``precision="bf16-autocast"`` (the same
recipe as the eager step), run in
one process (``SINGLE_DEV_MODE``), rounds interleaved. Prints ms/step of each
and the ratio cube / eager (target <= 1.02). Without CUDA it says so and
returns no measurement. ``--quick`` uses 4 layers and sequence 512.

``--predict PROFILE.json`` also simulates the same step with the simulator on
that hardware profile (``python -m cube.sim.calibrate --out PROFILE.json`` fits
one on this GPU) and prints the predicted step time beside the measured one.
``--kernels DIR`` writes the torch profiler's table of each way's step (GPU time
per op) to ``DIR``. ``build()`` is the simulator's spec of this benchmark:
``python -m cube.sim benchmarks/gpu.py --hardware PROFILE --ngpus 1 --policy
PASSingle --precision bf16 --estimate``.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt  # noqa: E402

FULL = {"layers": 12, "dim": 1024, "heads": 16, "batch": 8, "seq": 1024, "vocab": 50304, "steps": 10, "rounds": 3}
QUICK = {"layers": 4, "seq": 512, "steps": 5, "rounds": 2}


def build(meta: bool = True, quick: bool = False, **settings):
    """The benchmark's model and one batch, for ``python -m cube.sim benchmarks/gpu.py --hardware ...``.

    On the meta device by default (the simulator needs shapes, not values); ``settings`` override
    the sizes as in ``main``.
    """
    import torch
    from examples.gpt.model import GPT, GPTConfig
    cfg = {**FULL, **(QUICK if quick else {}), **settings}
    config = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=cfg["heads"],
                       n_embd=cfg["dim"], bias=False)
    with torch.device("meta" if meta else "cpu"):
        model = GPT(config)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
    return model, (ids, torch.roll(ids, -1, dims=1))


def _timed(step, n: int) -> List[float]:
    import torch
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def predict(profile: str, quick: bool = False, **settings) -> dict:
    """The simulator's prediction of this benchmark's cube step on ``profile`` (its JSON report)."""
    import json
    from cube.sim.__main__ import main as simulate
    with tempfile.TemporaryDirectory() as tmp:
        out, spec = Path(tmp) / "prediction.json", Path(tmp) / "spec.py"
        spec.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom benchmarks.gpu import build\n\n\n"
                        f"def spec():\n    return build(quick={quick!r}, **{settings!r})\n")
        simulate([f"{spec}:spec", "--hardware", profile, "--ngpus", "1", "--policy", "PASSingle", "--precision",
                  "bf16", "--estimate", "--json", str(out)])
        return json.loads(out.read_text())


def _host_times(train_iter, model, loader, opt, steps: int = 5) -> dict:
    """Seconds the host takes to issue cube's forward and backward, and the optimizer step, each
    started on an idle device (the host never waits for it in between): medians of ``steps``."""
    import torch
    fwbw, optim = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_iter(model, loader)
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        fwbw.append(t1 - t0)
        optim.append(t2 - t1)
    return {"forward_backward": statistics.median(fwbw), "optimizer": statistics.median(optim)}


def _kernel_table(step, path: Path, steps: int = 3) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=80, max_name_column_width=60)
    path.write_text(f"{steps} steps\n{table}\n")


def _gpt_on_gpu(quick: bool, settings: dict):
    """One process (``SINGLE_DEV_MODE``): cube, the settings, the GPT (seeded) and one batch on ``cuda:0``."""
    import torch
    os.environ["SINGLE_DEV_MODE"] = "1"
    import cube
    from examples.gpt.model import GPT, GPTConfig
    cfg = {**FULL, **(QUICK if quick else {}), **settings}
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=cfg["heads"],
                       n_embd=cfg["dim"], bias=False)
    base = GPT(config)
    dev = torch.device("cuda", 0)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dev)
    batch = (ids, torch.roll(ids, -1, dims=1))
    return cube, cfg, base, dev, batch


def main(quick: bool = False, predict_on: str = None, kernels: str = None, **settings) -> List[dict]:
    """Runs the comparison; returns rows (ms per step of each way and the ratio)."""
    import torch
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; nothing measured")
        return [{"benchmark": "gpu", "name": "cube world size 1 / eager", "skipped": "no CUDA device"}]
    cube, cfg, base, dev, batch = _gpt_on_gpu(quick, settings)

    eager = copy.deepcopy(base).to(dev)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)

    def eager_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = eager(*batch)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)

    loader = iter(lambda: batch, None)
    with tempfile.TemporaryDirectory() as cache:
        train_iter, model = compile_gpt(copy.deepcopy(base).to(dev), loader, "cube.policies.single:PASSingle", cache,
                                        precision="bf16-autocast")
        opt = cube.build_optimizer(model, torch.optim.AdamW, lr=1e-4)

        def cube_step():
            train_iter(model, loader)
            opt.step()
            opt.zero_grad(set_to_none=True)

        host = _host_times(train_iter, model, loader, opt)
        if kernels:
            Path(kernels).mkdir(parents=True, exist_ok=True)
            _kernel_table(eager_step, Path(kernels) / "kernels_eager.txt")
            _kernel_table(cube_step, Path(kernels) / "kernels_cube.txt")
        times = {"eager": [], "cube": []}
        for _ in range(cfg["rounds"]):
            for name, step in (("eager", eager_step), ("cube", cube_step)):
                _timed(step, 2)   # warm-up
                times[name] += _timed(step, cfg["steps"])
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["cube"] / med["eager"]
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, batch {cfg['batch']}, T{cfg['seq']}, bf16, "
          f"{torch.cuda.get_device_name(0)}")
    print(f"eager {med['eager'] * 1e3:.1f} ms/step, cube {med['cube'] * 1e3:.1f} ms/step, "
          f"ratio {ratio:.3f} (target <= 1.02)")
    print(f"cube's host: {host['forward_backward'] * 1e3:.1f} ms issuing forward and backward, "
          f"{host['optimizer'] * 1e3:.1f} ms the optimizer step")
    rows = [{"benchmark": "gpu", "name": n, "ms_per_step": med[n] * 1e3} for n in med] + [
        {"benchmark": "gpu", "name": "cube world size 1 / eager", "time_ratio": ratio, "target": "<= 1.02"}]
    if predict_on:
        got = predict(predict_on, quick, **settings)
        error = got["step_time_s"] / med["cube"] - 1
        print(f"simulator on {predict_on}: predicted {got['step_time_s'] * 1e3:.1f} ms/step against cube's "
              f"measured {med['cube'] * 1e3:.1f}: error {error:+.1%} (target within 10%)")
        rows.append({"benchmark": "gpu", "name": "simulator prediction / measured cube step",
                     "predicted_ms": got["step_time_s"] * 1e3, "measured_ms": med["cube"] * 1e3,
                     "error": error, "target": "within 10%"})
    return rows


def recipe_steps(base, batch, cache: str, device, fp8: bool = False) -> dict:
    """Name -> a training step (forward, backward, AdamW) of ``base``'s copy on ``device``, one per way:
    cube's ``precision="bf16"`` and ``"bf16-autocast"``; with ``fp8``, cube's ``"fp8"``, and the plain
    model in bf16 with and without torchao's float8 linear layers
    (``torchao.float8.convert_to_float8_training``, its default tensorwise recipe; left out, with a
    line saying so, where torchao is not installed). Runs on any device (the CPU emulates float8)."""
    import torch

    import cube
    loader = iter(lambda: batch, None)
    steps = {}
    for precision in ("bf16", "bf16-autocast") + (("fp8",) if fp8 else ()):
        train_iter, model = compile_gpt(copy.deepcopy(base).to(device), loader, "cube.policies.single:PASSingle",
                                        cache, precision=precision)
        opt = cube.build_optimizer(model, torch.optim.AdamW, lr=1e-4)

        def step(t=train_iter, m=model, o=opt):
            t(m, loader)
            o.step()
            o.zero_grad(set_to_none=True)
        steps[f"cube {precision}"] = step
    if fp8:
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError:
            print("torchao is not installed (pip install torchao): no torchao float8 rows")
            return steps
        for name, convert in (("eager bf16", False), ("torchao fp8", True)):
            m = copy.deepcopy(base).to(device).to(torch.bfloat16)
            if convert:
                convert_to_float8_training(m)
            o = torch.optim.AdamW(m.parameters(), lr=1e-4)

            def step(m=m, o=o):
                m(*batch).backward()
                o.step()
                o.zero_grad(set_to_none=True)
            steps[name] = step
    return steps


RATIOS = [   # (numerator, denominator): the ratios --recipes prints where both were timed
    ("cube bf16", "cube bf16-autocast"),
    ("cube fp8", "cube bf16"),
    ("torchao fp8", "eager bf16"),
    ("cube fp8", "torchao fp8"),
]


def recipes(quick: bool = False, fp8: bool = False, **settings) -> list:
    """``--recipes``: one-GPU step time of cube's ``precision="bf16"`` (bf16 weights, float32 main
    parameters) against ``"bf16-autocast"`` on the GPT above, AdamW (docs/precision.md); with
    ``--fp8``, also cube's ``"fp8"`` against cube's ``"bf16"``, and the plain bf16 model with
    torchao's float8 linear layers against it without them (an Ada or Hopper GPU: compute
    capability 8.9 and up). cube's recipes keep float32 main parameters, the plain models step
    their bf16 weights: compare cube with cube and the plain model with itself; "cube fp8 / torchao
    fp8" sets the two float8 steps side by side, recipes and all."""
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return [{"benchmark": "gpu", "name": "bf16 / bf16-autocast", "skipped": "no CUDA device"}]
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        print(f"--fp8 needs compute capability 8.9 or newer (Ada, Hopper); {torch.cuda.get_device_name()} is "
              f"{'.'.join(map(str, torch.cuda.get_device_capability()))}: timing the bf16 recipes only")
        fp8 = False
    cube, cfg, base, dev, batch = _gpt_on_gpu(quick, settings)
    times = {}
    with tempfile.TemporaryDirectory() as cache:
        steps = recipe_steps(base, batch, cache, dev, fp8=fp8)
        for name in steps:
            times[name] = []
        for _ in range(cfg["rounds"]):
            for name, step in steps.items():
                _timed(step, 2)
                times[name] += _timed(step, cfg["steps"])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [{"benchmark": "gpu", "name": n, "ms_per_step": med[n] * 1e3} for n in med]
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, {torch.cuda.get_device_name(0)}: "
          + ", ".join(f"{n} {v * 1e3:.1f} ms/step" for n, v in med.items()))
    for a, b in RATIOS:
        if a in med and b in med:
            print(f"{a} / {b}: {med[a] / med[b]:.3f}")
            rows.append({"benchmark": "gpu", "name": f"{a} / {b}", "time_ratio": med[a] / med[b]})
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--predict", metavar="PROFILE", default=None,
                   help="also predict the cube step on this hardware profile (python -m cube.sim.calibrate)")
    p.add_argument("--kernels", metavar="DIR", default=None, help="write each way's profiler table here")
    p.add_argument("--recipes", action="store_true", help="time cube's bf16 against bf16-autocast instead")
    p.add_argument("--fp8", action="store_true", help="with --recipes: also cube's fp8 and torchao float8 on the "
                                                      "plain model (compute capability 8.9 and up)")
    for key in ("layers", "dim", "heads", "batch", "seq", "steps", "rounds"):
        p.add_argument(f"--{key}", type=int, default=None)
    a = vars(p.parse_args())
    if a.pop("recipes"):
        fp8 = a.pop("fp8")
        a.pop("predict"), a.pop("kernels")
        recipes(a.pop("quick"), fp8=fp8, **{k: v for k, v in a.items() if v is not None})
        sys.exit(0)
    a.pop("fp8")
    main(a.pop("quick"), predict_on=a.pop("predict"), kernels=a.pop("kernels"),
         **{k: v for k, v in a.items() if v is not None})
