"""An imported ONNX model against the PyTorch module it was exported from: step time measured in one
process, and the simulator's prediction of each.

    python -m benchmarks.onnx_import [--quick]

``examples/gpt``'s GPT (4 layers, d256, 4 heads, sequence 64, batch 16, vocab 512; ``--quick``: 2
layers, d128) is exported with ``torch.onnx.export(dynamo=True, optimize=False)`` and imported with
``cube.onnx.load``. Both train with AdamW in one process, eagerly (the module itself: the import's
cost is its interpreter, not cube's plan), rounds interleaved after warm-up; then the simulator
predicts one step of each under ``PASSingle`` on this host (ops profiled here, as ``python -m
cube.sim`` does). Prints ms/step measured and predicted, ``imported/native ratio`` of each, and each
prediction's error against its measurement.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FULL = {"layers": 4, "dim": 256, "heads": 4, "seq": 64, "batch": 16, "steps": 10, "rounds": 3}
QUICK = {"layers": 2, "dim": 128, "heads": 4, "seq": 64, "batch": 8, "steps": 5, "rounds": 2}


def _models(cfg):
    import torch

    import cube.onnx
    from examples.gpt.model import GPT, GPTConfig
    from examples.gpt.train import StepBatches
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=cfg["seq"], n_layer=cfg["layers"], n_head=cfg["heads"],
                       n_embd=cfg["dim"])
    native = GPT(config)
    batch = next(StepBatches(config, cfg["batch"]))
    path = Path(tempfile.mkdtemp(prefix="cube-onnx-bench-")) / "gpt.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(native.eval(), batch, str(path), input_names=["idx", "targets"], dynamo=True,
                          optimize=False, verbose=False)
    return {"native": native.train(), "imported": cube.onnx.load(path).train()}, batch


def _measure(models, batch, steps: int, rounds: int):
    import torch
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(k):
        loss = models[k](*batch)
        loss.backward()
        opts[k].step()
        opts[k].zero_grad()
    for k in models:   # warm-up
        for _ in range(2):
            step(k)
    times = {k: [] for k in models}
    for _ in range(rounds):
        for k in models:
            t0 = time.perf_counter()
            for _ in range(steps):
                step(k)
            times[k].append((time.perf_counter() - t0) / steps)
    return {k: statistics.median(v) for k, v in times.items()}


def main(quick: bool = False):
    from cube.sim.api import default_models, simulate_policy
    cfg = QUICK if quick else FULL
    models, batch = _models(cfg)
    measured = _measure(models, batch, cfg["steps"], cfg["rounds"])
    costs, comm, host = default_models(1)
    predicted = {k: simulate_policy(m, batch, "PASSingle", 1, costs=costs, comm=comm, host=host).step_time
                 for k, m in models.items()}
    print(f"GPT {cfg['layers']} layers, d{cfg['dim']}, sequence {cfg['seq']}, batch {cfg['batch']}, one process")
    print(f"{'model':<10} {'measured ms':>12} {'predicted ms':>13} {'predicted/measured':>19}")
    for k in models:
        print(f"{k:<10} {measured[k] * 1e3:>12.2f} {predicted[k] * 1e3:>13.2f} {predicted[k] / measured[k]:>19.2f}")
    row = {"benchmark": "onnx_import", "name": "imported/native GPT",
           "measured_ratio": round(measured["imported"] / measured["native"], 3),
           "predicted_ratio": round(predicted["imported"] / predicted["native"], 3),
           "native_prediction_error": round(predicted["native"] / measured["native"] - 1, 3),
           "imported_prediction_error": round(predicted["imported"] / measured["imported"] - 1, 3)}
    print(f"imported/native: measured {row['measured_ratio']:.2f}, predicted {row['predicted_ratio']:.2f}")
    return [row]


if __name__ == "__main__":
    main("--quick" in sys.argv)
