"""``precision="bf16"``: low-precision weights, float32 main parameters and gradient accumulation
(Megatron-LM's recipe), against the same recipe run by hand in one process
(``tests.inprocess.main_params_reference``) on 2 and 4 in-process ranks.

The reference runs each global batch as the plan's batch pieces (data parallel degree x
micro-batches), so data parallel, pipelines and ZeRO see the same low-precision arithmetic and only
the float32 sums differ: 1e-5. Tensor parallel plans split a matrix product's reduction and sum
the low-precision partial products over ranks (as Megatron-LM), a rounding the single process
does not make: bf16's tolerance, ``TP_TOL`` (docs/precision.md).
"""
import functools

import pytest
import torch

import cube
from tests.inprocess import main_params_reference, parity
from tests.models import build

EXACT = 1e-5
# A weight tied across pipeline stages (GPT's embedding and head) gets one low-precision gradient
# per stage, each added to its float32 main gradient (Megatron-LM's shared embedding); one process
# adds the two uses in bf16 inside autograd first. The pipeline cases untie it ("gpt_untied").
# tensor parallel: each rank rounds its partial product to bf16 before the sum (docs/precision.md):
# 1e-4 measured with SGD; AdamW turns the flipped roundings of near-zero gradients into updates of
# size lr (1.3e-2 measured)
TP_TOL_SGD = 5e-4
TP_TOL_ADAMW = 5e-2
# against float32 training (SGD, 3 steps): bf16 weights and activations
FLOAT32_TOL = 2e-2


def _model(name: str):
    if name != "gpt_untied":
        return build(name)
    m, sample = build("gpt_nobias")
    m.lm_head.weight = torch.nn.Parameter(m.wte.weight.detach().clone())
    return m, sample


def _build(opt: str):
    kw = {"lr": 1e-2} if opt == "sgd" else {"lr": 1e-3, "eps": 1e-6}
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW
    return lambda gen: cube.build_optimizer(gen, cls, **kw)


CASES = [
    # (id, model, policy, world, micro-batches (global batch / sample's), batch pieces, zero, optimizer, tol)
    ("data2-adamw", "gpt_nobias", "policies.data:PASData", 2, 1, 2, 0, "adamw", EXACT),
    ("data2-sgd", "gpt_nobias", "policies.data:PASData", 2, 1, 2, 0, "sgd", EXACT),
    ("data4-zero1", "gpt_nobias", "policies.data:PASData", 4, 1, 4, 1, "adamw", EXACT),
    ("data2-zero2", "gpt_nobias", "policies.data:PASData", 2, 1, 2, 2, "adamw", EXACT),
    ("data4-zero3", "gpt_nobias", "policies.data:PASData", 4, 1, 4, 3, "adamw", EXACT),
    # the test pipelines cut each global batch into 4 micro-batches
    ("pipe2-1f1b", "gpt_untied", "tests/extra_policies.py:PAS1F1B", 2, 4, 4, 0, "adamw", EXACT),
    ("pipe4-1f1b-data-zero1", "gpt_untied", "tests/extra_policies.py:PAS1F1BData", 4, 4, 8, 1, "adamw", EXACT),
    ("tensor2-sgd", "gpt_nobias", "policies.megatron:PASMegatronTP", 2, 1, 1, 0, "sgd", TP_TOL_SGD),
    ("tensor4-sgd", "gpt_nobias", "policies.megatron:PASMegatronTP", 4, 1, 1, 0, "sgd", TP_TOL_SGD),
    ("tensor2-adamw", "gpt_nobias", "policies.megatron:PASMegatronTP", 2, 1, 1, 0, "adamw", TP_TOL_ADAMW),
]


@pytest.mark.parametrize("model,policy,world,nmicros,shares,zero,opt,tol", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_main_params_equal_the_recipe_by_hand(model, policy, world, nmicros, shares, zero, opt, tol):
    m, sample = _model(model)
    errors = parity(m, sample, policy, world, steps=3, nmicros=nmicros, opt=opt, build=_build(opt),
                    reference=functools.partial(main_params_reference, shares=shares),
                    precision="bf16", zero=zero)
    worst = max(max(e) for e in errors)
    assert worst <= tol, f"relative errors per rank (loss, parameters): {errors}"


def test_main_params_against_float32_training():
    """The recipe against plain float32 training: within bf16's documented tolerance (docs/precision.md)."""
    m, sample = build("gpt_nobias")
    errors = parity(m, sample, "policies.data:PASData", 2, steps=3, opt="sgd", build=_build("sgd"),
                    precision="bf16")
    worst = max(max(e) for e in errors)
    assert worst <= FLOAT32_TOL, errors
