"""cube with ``backend=`` (``torch.compile`` of the generated compute) vs eager, on one device.

    python -m benchmarks.compiled [--backend inductor] [--quick] [--cpu] [--layers N --dim D ...]

GPT (12 layers, d1024, 16 heads, batch 8, sequence 1024, vocab 50304), bf16
autocast over float32 parameters, AdamW, on ``cuda:0``, in one process
(``SINGLE_DEV_MODE``), three ways from the same weights on the same batch: the
plain model in eager mode, cube (``PASSingle``, ``precision="bf16"``) eager, and
the same cube step compiled with ``backend=``. Rounds interleaved after
warm-up (the compiled step's first call compiles; its seconds are printed).
Prints ms/step of each, the ratios cube compiled / torch eager (target <= 0.85)
and cube compiled / cube eager, and how far the compiled step's losses are from
the eager cube step's (the same training, so equal up to the backend's
round-off). ``--quick``: 4 layers, sequence 512.

Without CUDA (or with ``--cpu``) it runs on the CPU at a tiny size (2 layers,
d128, sequence 64, float32) to show that it works; CPU numbers say nothing
about the GPU target (inductor's CPU kernels, 2 cores).
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
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt  # noqa: E402

FULL = {"layers": 12, "dim": 1024, "heads": 16, "batch": 8, "seq": 1024, "vocab": 50304, "steps": 10, "rounds": 3,
        "precision": "bf16"}
QUICK = {"layers": 4, "seq": 512, "steps": 5, "rounds": 2}
CPU = {"layers": 2, "dim": 128, "heads": 4, "batch": 4, "seq": 64, "vocab": 512, "steps": 10, "rounds": 3,
       "precision": None}
CPU_QUICK = {"steps": 5, "rounds": 2}
TARGET = 0.85


def _timer(cuda: bool) -> Callable[[Callable[[], float], int], List[float]]:
    import torch

    def timed(step, n: int) -> List[float]:
        out = []
        for _ in range(n):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out
    return timed


def main(quick: bool = False, backend: str = "inductor", cpu: bool = False, **settings) -> List[dict]:
    """Runs the comparison; returns rows (ms per step of each way, the ratios, the loss difference).

    Args:
        quick: the short version (fewer layers and steps).
        backend: the ``torch.compile`` backend of the compiled cube step.
        cpu: run on the CPU at the tiny size even where CUDA is available.
        settings: overrides of the sizes (``layers``, ``dim``, ``heads``, ``batch``, ``seq``,
            ``vocab``, ``steps``, ``rounds``, ``precision``).
    """
    import torch
    os.environ["SINGLE_DEV_MODE"] = "1"
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # before CUDA starts: cube's device follows it
    import cube
    from examples.gpt.model import GPT, GPTConfig
    cuda = torch.cuda.is_available() and not cpu
    if cuda:
        cfg = {**FULL, **(QUICK if quick else {})}
    else:
        cfg = {**FULL, **CPU, **(CPU_QUICK if quick else {})}
    cfg.update({k: v for k, v in settings.items() if v is not None})
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[cfg["precision"]]
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=cfg["heads"],
                       n_embd=cfg["dim"], bias=False)
    base = GPT(config)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dev)
    batch = (ids, torch.roll(ids, -1, dims=1))
    losses: Dict[str, List[float]] = {"torch eager": [], "cube eager": [], "cube compiled": []}

    eager = copy.deepcopy(base).to(dev)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)

    def eager_step():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = eager(*batch)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        losses["torch eager"].append(loss.detach())

    loader = iter(lambda: batch, None)
    steps = {"torch eager": eager_step}
    compile_s = 0.0
    with tempfile.TemporaryDirectory() as cache:
        for name, chosen in (("cube eager", None), ("cube compiled", backend)):
            train_iter, model = compile_gpt(copy.deepcopy(base).to(dev), loader, "cube.policies.single:PASSingle", cache,
                                            precision=cfg["precision"], backend=chosen)
            opt = cube.build_optimizer(model, torch.optim.AdamW, lr=1e-4)

            def cube_step(train_iter=train_iter, model=model, opt=opt, name=name):
                loss = train_iter(model, loader)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[name].append(loss.detach())
            steps[name] = cube_step
        timed = _timer(cuda)
        compile_s = timed(steps["cube compiled"], 1)[0]   # the first call compiles
        for name in ("torch eager", "cube eager"):
            timed(steps[name], 1)
        times: Dict[str, List[float]] = {name: [] for name in steps}
        for _ in range(cfg["rounds"]):
            for name, step in steps.items():
                timed(step, 2)   # warm-up
                times[name] += timed(step, cfg["steps"])
    med = {k: statistics.median(v) for k, v in times.items()}
    vs_torch = med["cube compiled"] / med["torch eager"]
    vs_cube = med["cube compiled"] / med["cube eager"]
    # every way took the same steps on the same batch from the same weights: compare step by step
    rel_diffs = [abs(a.item() - b.item()) / max(abs(b.item()), 1e-12)
                 for a, b in zip(losses["cube compiled"], losses["cube eager"])]
    diff, first = max(rel_diffs), rel_diffs[0]
    where = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, batch {cfg['batch']}, T{cfg['seq']}, vocab {cfg['vocab']}, "
          f"{cfg['precision'] or 'float32'}, {where}, backend {backend!r} (compiled in {compile_s:.1f} s)")
    print("  " + ", ".join(f"{name} {med[name] * 1e3:.1f} ms/step" for name in steps))
    print(f"  cube compiled / torch eager {vs_torch:.3f} (target <= {TARGET} on a GPU), "
          f"cube compiled / cube eager {vs_cube:.3f}; largest relative loss difference compiled vs eager "
          f"cube over {len(losses['cube eager'])} steps: {diff:.1e} (first step: {first:.1e})")
    rows = [{"benchmark": "compiled", "name": n, "ms_per_step": med[n] * 1e3} for n in steps]
    rows += [{"benchmark": "compiled", "name": f"cube {backend} / torch eager", "time_ratio": vs_torch,
              "target": f"<= {TARGET}" if cuda else "(CPU: no target)", "device": where},
             {"benchmark": "compiled", "name": f"cube {backend} / cube eager", "time_ratio": vs_cube,
              "loss_rel_diff": diff, "first_loss_rel_diff": first, "compile_s": compile_s}]
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--quick", action="store_true", help="fewer layers and steps")
    p.add_argument("--cpu", action="store_true", help="the tiny CPU run even where CUDA is available")
    for key in ("layers", "dim", "heads", "batch", "seq", "vocab", "steps", "rounds"):
        p.add_argument(f"--{key}", type=int, default=None)
    p.add_argument("--precision", choices=["bf16", "fp16"], default=None,
                   help="mixed precision (default: bf16 on a GPU, float32 on the CPU)")
    args = vars(p.parse_args())
    main(**args)
