"""Mixed precision recipes side by side, on the CPU: bytes per parameter each rank holds, and how
exactly the gradient accumulation choices follow float32 accumulation.

    python -m benchmarks.precision [--world 2]

Memory: a GPT (tests/models' ``gpt`` shape, wider) trained data parallel on ``--world`` in-process
ranks (``cube.debug.run``), one step with AdamW through ``cube.build_optimizer``; per rank, the
bytes of the tensors it holds right after the step, before ``zero_grad``
(``cube.runtime.memory.report``: parameters, float32 main parameters, gradients, optimizer state),
divided by the parameters it holds, for float32, ``bf16-autocast``, ``bf16`` with each
``main_grads`` choice, without ZeRO and with ZeRO-1. Printed beside the formula
(docs/precision.md).

Exactness: a 2-stage pipeline of 4 micro-batches (each rank accumulates 4 gradients), ``bf16``
with ``main_grads="fp32"`` (Megatron-LM's float32 main-gradient buffer) and ``"bf16"``
(torchtitan's: accumulate in bf16, reduce in float32), against the recipe by hand with float32
accumulation (``tests.inprocess.main_params_reference``): relative error of the parameters after
3 SGD steps. Not a timed benchmark (benchmarks/gpu.py times the recipes on a GPU).
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cube  # noqa: E402
import cube.debug  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402

RECIPES = [   # (label, precision, main_grads)
    ("float32", None, "fp32"),
    ("bf16-autocast", "bf16-autocast", "fp32"),
    ("bf16, main_grads=fp32", "bf16", "fp32"),
    ("bf16, main_grads=bf16", "bf16", "bf16"),
]


def formula(precision, main_grads: str, zero: int, dp: int) -> float:
    """Bytes per parameter: weights + main parameters + gradients + AdamW state (ZeRO-1 divides
    the optimizer's part, main parameters included, by the data parallel degree)."""
    if precision in (None, "bf16-autocast"):
        weights, main, grads = 4, 0, 4
    else:
        weights, main, grads = 2, 4, 4   # after the step both choices hold float32 main gradients
    state = 8
    share = dp if zero else 1
    return weights + grads + (main + state) / share


def model_and_batch():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=128, bias=False)
    ids = torch.randint(0, 256, (8, 32))
    return GPT(cfg), (ids, torch.roll(ids, -1, dims=1))


def memory(world: int):
    model, batch = model_and_batch()
    rows = []
    for label, precision, main_grads in RECIPES:
        for zero in (0, 1):
            cache = tempfile.mkdtemp(prefix="cube-precision-")

            def body():
                it = iter([batch] * 2)

                @cube.compile(copy.deepcopy(model), it, PAS="cube.policies.data:PASData", cache_dir=cache,
                              precision=precision)
                def step(m, dl):
                    data = next(dl)
                    loss = m(*data)
                    loss.backward()
                    return loss
                gen = cube.load_model()
                opt = cube.build_optimizer(gen, torch.optim.AdamW, zero=zero, main_grads=main_grads, lr=1e-3)
                step(gen, it)
                opt.step()
                held = cube.runtime.memory.report(gen, opt)
                numel = sum(p.numel() for p in gen.parameters())
                return {k: v / numel for k, v in held.items()}
            per = cube.debug.run(body, world)[0]
            rows.append((label, zero, per, formula(precision, main_grads, zero, world)))
    return rows


def exactness():
    from tests.inprocess import main_params_reference, parity
    model, sample = model_and_batch()
    model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())   # untied (tests/test_main_params.py)
    sample = tuple(t[:2] for t in sample)
    out = {}
    for main_grads in ("fp32", "bf16"):
        errors = parity(model, sample, "tests/extra_policies.py:PAS1F1B", 2, steps=3, nmicros=4, opt="sgd",
                        build=lambda gen, g=main_grads: cube.build_optimizer(gen, torch.optim.SGD, lr=1e-2,
                                                                             main_grads=g),
                        reference=functools.partial(main_params_reference, shares=4), precision="bf16")
        out[main_grads] = max(max(e) for e in errors)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    args = p.parse_args(argv)
    print(f"bytes per parameter held per rank after the step (data parallel over {args.world} ranks)")
    print(f"{'recipe':24} {'zero':>4} {'weights':>8} {'main':>6} {'grads':>6} {'state':>6} {'total':>6} "
          f"{'formula':>7}")
    for label, zero, per, f in memory(args.world):
        print(f"{label:24} {zero:>4} {per['params']:8.2f} {per['main_params']:6.2f} {per['grads']:6.2f} "
              f"{per['optimizer']:6.2f} {per['total']:6.2f} {f:7.2f}")
    print("\npipeline of 4 micro-batches: parameters after 3 SGD steps against float32 accumulation by hand")
    for k, v in exactness().items():
        print(f"  main_grads={k}: relative error {v:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
