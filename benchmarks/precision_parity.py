"""How exactly the low-precision recipes' plans follow one process, on the CPU: the tables of
docs/precision.md (FP8, tensor-parallel partial sums).

    python -m benchmarks.precision_parity [--fp8] [--tp-reduce] [--flips]

``--fp8``: ``precision="fp8"`` plans of GPT (tests/models' ``gpt_nobias``) on 2 and 4 in-process
ranks against the float8 rule by hand in one process (``tests.test_float8.Float8ByHand``, the plan's
batch pieces as micro-batches), and against float32 training; tensor parallel with and without
``tp_reduce_dtype=torch.float32``, and once with every piece scaled by its own amax (the global
amax switched off) to show what the maximum over ranks buys; Hugging Face Llama (tests/models'
``hf_llama``) against float32 training.

``--tp-reduce``: ``precision="bf16"`` tensor-parallel plans (tp 2 and 4, SGD and AdamW) against the
recipe by hand (``tests.inprocess.main_params_reference``), partial sums in bf16 and in float32,
after 1 step (forward only in the loss) and after 3.

``--flips``: why float32 partial sums do not make the backward exact: the gradient of a value that
three column-parallel projections read (q, k, v of an attention), as one process makes it (each
product rounded to bf16, then the three added in bf16) and as tensor parallel over 2 ranks makes
it (each rank's partial products summed, then summed over ranks: in bf16, or in float32 and
rounded once), on random bf16 values: the share of elements that differ from one process.

Each row: the largest relative error over ranks of the losses and of the parameters (3 steps unless
said). Not timed (benchmarks/gpu.py times the recipes on a GPU).
"""
from __future__ import annotations

import argparse
import functools
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import cube  # noqa: E402

TP = "cube.policies.megatron:PASMegatronTP"
DATA = "cube.policies.data:PASData"
PIPE = "tests/extra_policies.py:PAS1F1B"
PIPE_DATA = "tests/extra_policies.py:PAS1F1BData"


def _errors(model: str, policy: str, world: int, opt: str, reference, steps: int = 3, nmicros: int = 1, **kw):
    from tests.inprocess import parity
    from tests.test_main_params import _build, _model
    m, sample = _model(model)
    errors = parity(m, sample, policy, world, steps=steps, nmicros=nmicros, opt=opt, build=_build(opt),
                    reference=reference, **kw)
    return max(e[0] for e in errors), max(e[1] for e in errors)


@contextmanager
def _local_amax():
    """Every float8 piece scaled by its own amax (the maximum over ranks switched off)."""
    f8 = cube.runtime.float8
    keep = f8.global_amax
    f8.global_amax = lambda values, ranks: keep(values, ())
    try:
        yield
    finally:
        f8.global_amax = keep


def fp8_table() -> None:
    from tests.inprocess import main_params_reference
    from tests.test_float8 import Float8ByHand

    def by_hand(shares):
        return functools.partial(main_params_reference, shares=shares, islands=Float8ByHand)
    rows = [   # (label, model, policy, world, optimizer, micro-batches, batch pieces, extra compile kw)
        ("data 2, SGD", "gpt_nobias", DATA, 2, "sgd", 1, 2, {}),
        ("data 2, AdamW", "gpt_nobias", DATA, 2, "adamw", 1, 2, {}),
        ("data 4, ZeRO-3, AdamW", "gpt_nobias", DATA, 4, "adamw", 1, 4, {"zero": 3}),
        ("1F1B 2 stages, 4 micro-batches, AdamW", "gpt_untied", PIPE, 2, "adamw", 4, 4, {}),
        ("1F1B 2 stages x data 2, ZeRO-1, SGD", "gpt_untied", PIPE_DATA, 4, "sgd", 4, 8, {"zero": 1}),
        ("tensor 2, SGD", "gpt_nobias", TP, 2, "sgd", 1, 1, {}),
        ("tensor 4, SGD", "gpt_nobias", TP, 4, "sgd", 1, 1, {}),
        ("tensor 2, AdamW", "gpt_nobias", TP, 2, "adamw", 1, 1, {}),
        ("tensor 2, SGD, tp_reduce_dtype=float32", "gpt_nobias", TP, 2, "sgd", 1, 1,
         {"tp_reduce_dtype": torch.float32}),
        ("tensor 4, SGD, tp_reduce_dtype=float32", "gpt_nobias", TP, 4, "sgd", 1, 1,
         {"tp_reduce_dtype": torch.float32}),
    ]
    print("| fp8 plan against the rule by hand | loss | parameters |")
    print("|---|---|---|")
    for label, model, policy, world, opt, nmicros, shares, kw in rows:
        loss, params = _errors(model, policy, world, opt, by_hand(shares), nmicros=nmicros, precision="fp8", **kw)
        print(f"| {label} | {loss:.1e} | {params:.1e} |", flush=True)
    for world in (2, 4):
        for steps in (1, 3):
            kw = {"tp_reduce_dtype": torch.float32}
            loss, params = _errors("gpt_nobias", TP, world, "sgd", by_hand(1), steps=steps, precision="fp8", **kw)
            with _local_amax():
                loss2, params2 = _errors("gpt_nobias", TP, world, "sgd", by_hand(1), steps=steps, precision="fp8",
                                         **kw)
            print(f"| tensor {world}, SGD, float32 sums, {steps} step(s): global amax / each piece its own | "
                  f"{loss:.1e} / {loss2:.1e} | {params:.1e} / {params2:.1e} |", flush=True)
    loss, params = _errors("gpt_nobias", DATA, 2, "sgd", None, precision="fp8")
    print(f"| against float32 training (data 2, SGD) | {loss:.1e} | {params:.1e} |")
    for policy, label in ((DATA, "data 2"), (TP, "tensor 2")):
        loss, params = _errors("hf_llama", policy, 2, "sgd", None, precision="fp8")
        print(f"| Hugging Face Llama against float32 training ({label}, SGD) | {loss:.1e} | {params:.1e} |", flush=True)
    loss, params = _errors("gpt_nobias", DATA, 2, "sgd", None, precision="bf16")
    print(f"| bf16 against float32 training (data 2, SGD), for scale | {loss:.1e} | {params:.1e} |")


def tp_reduce_table() -> None:
    from tests.inprocess import main_params_reference
    ref = functools.partial(main_params_reference, shares=1)
    print("| bf16 plan against the recipe by hand | partial sums in bf16: loss | parameters "
          "| in float32: loss | parameters |")
    print("|---|---|---|---|---|")
    for world in (2, 4):
        for opt in ("sgd", "adamw"):
            for steps in (1, 3):
                before = _errors("gpt_nobias", TP, world, opt, ref, steps=steps, precision="bf16")
                after = _errors("gpt_nobias", TP, world, opt, ref, steps=steps, precision="bf16",
                                tp_reduce_dtype=torch.float32)
                print(f"| tensor {world}, {'SGD' if opt == 'sgd' else 'AdamW'}, {steps} step(s) | {before[0]:.1e} | "
                      f"{before[1]:.1e} | {after[0]:.1e} | {after[1]:.1e} |", flush=True)


def flips_table(tp: int = 2, rows: int = 64, width: int = 32) -> None:
    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    grads = [torch.randn(rows, width, generator=g).to(bf) for _ in range(3)]
    weights = [(torch.randn(width, width, generator=g) * 0.02).to(bf) for _ in range(3)]

    def mm(a, b):   # a bf16 product: float32 accumulation, rounded once
        return (a.float() @ b.float()).to(bf)

    def piece(t, r, dim):
        return t.chunk(tp, dim)[r]
    one = mm(grads[0], weights[0]) + mm(grads[1], weights[1]) + mm(grads[2], weights[2])
    exact = sum(a.double() @ b.double() for a, b in zip(grads, weights))
    in_bf16 = in_fp32 = 0
    for r in range(tp):
        ga, wa = [piece(a, r, 1) for a in grads], [piece(b, r, 0) for b in weights]
        in_bf16 = in_bf16 + (mm(ga[0], wa[0]) + mm(ga[1], wa[1]) + mm(ga[2], wa[2]))
        in_fp32 = in_fp32 + sum(a.float() @ b.float() for a, b in zip(ga, wa))
    in_fp32 = in_fp32.to(bf)

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()
    print("| gradient of a value read by 3 column-parallel products (tp 2) | elements unlike one process "
          "| relative error against one process | against the exact sum |")
    print("|---|---|---|---|")
    print(f"| one process | 0 | 0 | {rel(one, exact):.1e} |")
    for label, value in (("partial sums in bf16", in_bf16), ("partial sums in float32, rounded once", in_fp32)):
        print(f"| {label} | {(value != one).float().mean().item():.1%} | {rel(value, one):.1e} | "
              f"{rel(value, exact):.1e} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fp8", action="store_true", help="precision='fp8' plans against the rule by hand")
    p.add_argument("--tp-reduce", action="store_true", help="bf16 tensor parallel, partial sums in bf16 and float32")
    p.add_argument("--flips", action="store_true", help="one backward sum: one process against tensor parallel")
    args = p.parse_args(argv)
    if not (args.fp8 or args.tp_reduce or args.flips):
        args.fp8 = args.tp_reduce = args.flips = True
    if args.flips:
        flips_table()
    if args.tp_reduce:
        tp_reduce_table()
    if args.fp8:
        fp8_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
