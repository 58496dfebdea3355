"""What the second trace of ``cube.trace.casts`` costs: ``cube.trace_model``'s trace phase under
``precision="bf16"`` (two exports) against ``precision=None`` (one), on the CPU.

    python -m benchmarks.low_casts [--repeat 3]

Models: the tiny Hugging Face Llama of the tests (``tests.models.build("hf_llama")``, a real
model) and the Llama of ``examples/bigmodel`` (built on the meta device). Each trace is run
``--repeat`` times after one warm-up; the median is printed, with the ratio and how many casts
went to bf16.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import cube
from cube.ir.operator import IRFwOperation


def _models():
    from tests.models import build
    from examples.bigmodel.train import build as bigmodel
    yield "tiny HF Llama (tests.models hf_llama)", build("hf_llama")
    yield "examples/bigmodel Llama (meta)", bigmodel()


def _trace(model, sample, precision):
    timings = {}
    start = time.perf_counter()
    graph = cube.trace_model(model, sample, precision=precision, timings=timings).graph
    return time.perf_counter() - start, timings["trace"], graph


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    print("| model | trace, float32 (s) | trace, bf16 (s) | ratio | casts to bf16 |")
    print("|---|---|---|---|---|")
    for name, (model, sample) in _models():
        _trace(model, sample, "bf16")   # warm-up
        f32 = statistics.median(_trace(model, sample, None)[1] for _ in range(args.repeat))
        runs = [_trace(model, sample, "bf16") for _ in range(args.repeat)]
        low = statistics.median(r[1] for r in runs)
        graph = runs[0][2]
        n = sum(1 for op in graph.select(ntype=IRFwOperation) if op.name in ("to", "_to_copy")
                and torch.bfloat16 in (*op.args, *op.kwargs.values()))
        print(f"| {name} | {f32:.2f} | {low:.2f} | {low / f32:.2f} | {n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
