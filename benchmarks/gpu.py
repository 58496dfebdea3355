"""cube at world size 1 vs plain eager PyTorch on one GPU: what cube's runtime costs.

    python -m benchmarks.gpu [--quick]

GPT (12 layers, d1024, 16 heads, batch 8, sequence 1024), bf16 autocast over
float32 parameters, AdamW, on ``cuda:0``: the plain model in eager mode, and the
same model compiled by cube with ``PASSingle`` and ``precision="bf16"``, run in
one process (``SINGLE_DEV_MODE``), rounds interleaved. Prints ms/step of each
and the ratio cube / eager (target <= 1.02). Without CUDA it says so and
returns no measurement. ``--quick`` uses 4 layers and sequence 512.
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


def main(quick: bool = False, **settings) -> List[dict]:
    """Runs the comparison; returns rows (ms per step of each way and the ratio)."""
    import torch
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; nothing measured")
        return [{"benchmark": "gpu", "name": "cube world size 1 / eager", "skipped": "no CUDA device"}]
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
        train_iter, model = compile_gpt(copy.deepcopy(base).to(dev), loader, "policies.single:PASSingle", cache,
                                        precision="bf16")
        opt = cube.build_optimizer(model, torch.optim.AdamW, lr=1e-4)

        def cube_step():
            train_iter(model, loader)
            opt.step()
            opt.zero_grad(set_to_none=True)

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
    return [{"benchmark": "gpu", "name": n, "ms_per_step": med[n] * 1e3} for n in med] + [
        {"benchmark": "gpu", "name": "cube world size 1 / eager", "time_ratio": ratio, "target": "<= 1.02"}]


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    main(p.parse_args().quick)
