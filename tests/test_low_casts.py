"""``precision="bf16"``: a model's casts to its values' own dtype go to the weights' dtype
(``cube.trace.casts``), as in the model's bf16 copy.

Hugging Face's Llama computes its RMSNorm in float32 and casts back with ``.to(input_dtype)``, its
eager attention takes the softmax in float32 and casts back with ``.to(query.dtype)``, and rotary's
cos and sin are cast to ``x.dtype``. Traced in float32 these are casts to float32; under the recipe
they cast to bf16, so the residual stream and attention's probabilities are bf16, as in
``copy.deepcopy(model).to(torch.bfloat16)``. Models written as Megatron-LM's cast nothing to their
values' dtype: their programs do not change.
"""
import functools
import re

import pytest
import torch

import cube
from cube.ir.operator import IRFwOperation
from cube.passes.precision import low_precision
from cube.trace.casts import low_casts
from cube.trace.export import export
from tests.inprocess import main_params_reference, parity
from tests.models import build

EXACT = 1e-5
TP_TOL_SGD = 5e-4   # as tests/test_main_params.py: tensor parallel rounds partial sums to bf16


def _casts(graph):
    return [op for op in graph.select(ntype=IRFwOperation) if op.name in ("to", "_to_copy")]


def test_hf_llama_casts_to_its_values_dtype_follow_the_weights():
    """After every RMSNorm and at attention's probabilities the forward runs in bf16; the explicit
    upcasts (the norm's input, the softmax's float32) and the loss's float32 input stay."""
    m, sample = build("hf_llama")
    graph = cube.trace_model(m, sample, precision="bf16").graph
    dtypes = low_precision(graph, "cpu").dtypes
    casts = _casts(graph)
    out = {id(op): dtypes[id(op.outputs[0])] for op in casts}
    norms = [op for op in casts if op.module_path.endswith("norm") and op.source and "input_dtype" in op.source[2]]
    assert len(norms) == 5, [(op.module_path, op.source) for op in casts]   # 2 layers x 2 norms + the final norm
    assert all(out[id(op)] == torch.bfloat16 for op in norms)
    upcasts = [op for op in casts if op.source and "torch.float32" in op.source[2]]
    assert upcasts and all(out[id(op)] == torch.float32 for op in upcasts)
    softmax = [op for op in graph.select(ntype=IRFwOperation) if op.name in ("softmax", "_softmax")]
    assert len(softmax) == 2 and all(dtypes[id(op.outputs[0])] == torch.float32 for op in softmax)
    probs = [op for op in casts if op.inputs[0] in [s.outputs[0] for s in softmax]]
    assert len(probs) == 2 and all(out[id(op)] == torch.bfloat16 for op in probs)
    # the residual stream: the decoder layers' own adds
    residual = [op for op in graph.select(ntype=IRFwOperation)
                if op.name == "add" and re.fullmatch(r"model\.model\.layers\.\d+", op.module_path)]
    assert len(residual) == 4 and all(dtypes[id(op.outputs[0])] == torch.bfloat16 for op in residual)
    # every value the attention's and the MLP's products read is bf16: no cast before them
    plan = low_precision(graph, "cpu")
    linears = [op for op in graph.select(ntype=IRFwOperation) if op.name in ("linear", "matmul", "bmm")]
    assert linears and not any(plan.casts.get(id(op)) for op in linears[:-1])


@pytest.mark.slow
def test_float32_and_autocast_keep_the_traced_casts():
    m, sample = build("hf_llama")
    for precision in (None, "bf16-autocast"):
        graph = cube.trace_model(m, sample, precision=precision).graph
        targets = {a for op in _casts(graph) for a in (*op.args, *op.kwargs.values()) if isinstance(a, torch.dtype)}
        assert torch.float32 in targets and not targets & {torch.bfloat16, torch.float16}


@pytest.mark.parametrize("name", [pytest.param("gpt", marks=pytest.mark.slow), "gpt_nobias"])
def test_megatron_style_models_have_no_cast_to_retarget(name):
    """examples/gpt casts nothing to its values' dtype: the second trace matches and marks nothing."""
    m, sample = build(name)
    assert low_casts(m, sample, export(m, sample), torch.bfloat16) == 0


@pytest.mark.slow
def test_generated_code_prints_the_bf16_casts(tmp_path):
    from tests.parity import compile_step
    m, sample = build("hf_llama")
    step = compile_step(m, iter([sample, sample]), "cube.policies.single:PASSingle", tmp_path, precision="bf16")
    assert "torch.bfloat16" in step.source
    # the only float32 casts: the norms' and softmax's explicit upcasts, the loss's input
    lines = [ln for ln in step.source.splitlines() if "aten.to.dtype(" in ln]
    assert sum("torch.bfloat16" in ln for ln in lines) >= 7, "\n".join(lines)
    # the residual stream reads the norm's input, not its float32 upcast
    assert "aten.add.Tensor(embedding, " in step.source


def _build(opt: str):
    kw = {"lr": 1e-2} if opt == "sgd" else {"lr": 1e-3, "eps": 1e-6}
    cls = torch.optim.SGD if opt == "sgd" else torch.optim.AdamW
    return lambda gen: cube.build_optimizer(gen, cls, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("policy,world,nmicros,shares,opt,tol", [
    ("cube.policies.single:PASSingle", 1, 1, 1, "adamw", EXACT),
    ("cube.policies.data:PASData", 2, 1, 2, "adamw", EXACT),
    ("cube.policies.data:PASData", 2, 1, 2, "sgd", EXACT),
    ("tests/extra_policies.py:PAS1F1B", 2, 4, 4, "adamw", EXACT),   # the micro-batch's trace retargets too
    ("cube.policies.megatron:PASMegatronTP", 2, 1, 1, "sgd", TP_TOL_SGD),
], ids=["single-adamw", "data2-adamw", "data2-sgd", "pipe2-1f1b", "tensor2-sgd"])
def test_hf_llama_bf16_equals_its_bf16_copy_by_hand(policy, world, nmicros, shares, opt, tol):
    """The plan against the model's bf16 copy run by hand (its casts then go to bf16 by themselves),
    float32 main parameters and the same optimizer step, on the plan's batch pieces. The copy's
    buffers stay float32, as the plan's do (``main_params_reference``)."""
    m, sample = build("hf_llama")
    errors = parity(m, sample, policy, world, steps=3, nmicros=nmicros, opt=opt, build=_build(opt),
                    reference=functools.partial(main_params_reference, shares=shares), precision="bf16")
    assert max(max(e) for e in errors) <= tol, f"relative errors per rank (loss, parameters): {errors}"


class _ReadsItsDtype(torch.nn.Module):
    """A forward whose ops depend on its weights' dtype: its two programs cannot be matched."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.w(x.to(self.w.weight.dtype))
        if self.w.weight.dtype == torch.float32:
            h = h * 2
        return torch.nn.functional.mse_loss(h.to(x.dtype), y)


def test_programs_that_differ_keep_the_traced_casts(caplog):
    m, sample = _ReadsItsDtype(), (torch.randn(4, 8), torch.randn(4, 8))
    with caplog.at_level("INFO", logger="cube"):
        assert low_casts(m, sample, export(m, sample), torch.bfloat16) == 0
    assert "casts to its values' dtype stay float32" in caplog.text
