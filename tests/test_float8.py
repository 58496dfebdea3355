"""``precision="fp8"``: the ``"bf16"`` recipe with the linear layers' three matrix products in
float8 (dynamic tensorwise scales, torchao's recipe), on the CPU where ``torch._scaled_mm`` emulates
them.

Parity: the plan on 2 and 4 in-process ranks against one process running the same rule by hand
(``Float8ByHand``, written here from the recipe: amax, scale, saturated cast, ``_scaled_mm``) with
the plan's batch pieces as micro-batches (``tests.inprocess.main_params_reference``). Data parallel,
pipelines and ZeRO are exact (1e-5). Tensor parallel scales the pieces of a weight, input or output
gradient with their global amax, so every rank quantizes as one process; its partial products are
summed over ranks as in ``"bf16"`` (bf16 round-off, ``TP_TOL_*`` of tests/test_main_params.py).
Against float32 training the float8 round-off is ``FLOAT32_TOL``; against torchao's ``Float8Linear``
on the plain model (where torchao is installed) the numbers are equal.
"""
import functools

import pytest
import torch
import torch.nn.functional as F

import cube
from cube.policies.megatron3d import PASMegatron
from tests.inprocess import Float32Islands, main_params_reference, parity
from tests.models import build
from tests.test_main_params import EXACT, _build, _model
from tests.tiers import tiered

# tensor parallel: the partial products summed over ranks in bf16 (as "bf16", 9.5e-5 with SGD) flip
# roundings that the float8 casts of the next products then magnify (e5m2: 2 mantissa bits):
# 5.0e-4 measured with SGD, 3.2e-2 with AdamW (docs/precision.md)
TP_TOL_SGD = 2e-3
TP_TOL_ADAMW = 1e-1
# against float32 training (SGD, 3 steps): float8 operands (e4m3: 3 mantissa bits, epsilon 0.125;
# e5m2 gradients: 2 bits) over bf16 weights; 8.4e-4 measured on GPT (bf16: 1.1e-4)
FLOAT32_TOL = 2e-2


def _q(t: torch.Tensor, dtype: torch.dtype):
    """``t`` scaled by ``fp8_max / amax``, saturated and cast to ``dtype``; and the scale."""
    top = torch.finfo(dtype).max
    scale = (top / t.detach().abs().max().double().clamp(min=1e-12)).float()
    return (t.float() * scale).clamp(-top, top).to(dtype), scale


class _LinearByHand(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        x8, sx = _q(x.reshape(-1, x.shape[-1]), torch.float8_e4m3fn)
        w8, sw = _q(w, torch.float8_e4m3fn)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.shape = x.shape
        out = torch._scaled_mm(x8, w8.t(), scale_a=1 / sx, scale_b=1 / sw, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = _q(grad.reshape(-1, grad.shape[-1]), torch.float8_e5m2)
        grad_x = torch._scaled_mm(g8, w8, scale_a=1 / sg, scale_b=1 / sw, out_dtype=grad.dtype)
        grad_w = torch._scaled_mm(g8.t().contiguous(), x8, scale_a=1 / sg, scale_b=1 / sx, out_dtype=grad.dtype)
        return grad_x.reshape(ctx.shape), grad_w


class Float8ByHand(Float32Islands):
    """cube's float32 islands, and every ``F.linear`` on a parameter with both dims divisible by 16
    in float8 by hand (bias added after)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(w, torch.nn.Parameter) and all(d % 16 == 0 for d in w.shape):
                out = _LinearByHand.apply(x.to(self.low), w)
                return out if bias is None else out + bias.to(out.dtype)
        return super().__torch_function__(func, types, args, kwargs)


def _reference(shares: int):
    return functools.partial(main_params_reference, shares=shares, islands=Float8ByHand)


CASES = [
    # (id, model, policy, world, micro-batches, batch pieces, zero, optimizer, tol)
    ("data2-sgd", "gpt_nobias", "cube.policies.data:PASData", 2, 1, 2, 0, "sgd", EXACT),
    ("data2-adamw", "gpt_nobias", "cube.policies.data:PASData", 2, 1, 2, 0, "adamw", EXACT),
    ("data4-zero3", "gpt_nobias", "cube.policies.data:PASData", 4, 1, 4, 3, "adamw", EXACT),
    ("data4-zero1-sgd", "gpt_nobias", "cube.policies.data:PASData", 4, 1, 4, 1, "sgd", EXACT),
    ("pipe2-1f1b", "gpt_untied", "tests/extra_policies.py:PAS1F1B", 2, 4, 4, 0, "adamw", EXACT),
    ("pipe4-1f1b-data-zero1", "gpt_untied", "tests/extra_policies.py:PAS1F1BData", 4, 4, 8, 1, "sgd", EXACT),
    ("tensor2-sgd", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, 1, 1, 0, "sgd", TP_TOL_SGD),
    ("tensor4-sgd", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 4, 1, 1, 0, "sgd", TP_TOL_SGD),
    ("tensor2-adamw", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, 1, 1, 0, "adamw", TP_TOL_ADAMW),
]
# default tier: data2-sgd (and the first-step tensor parallel test below)
SLOW = {"data2-adamw", "data4-zero3", "data4-zero1-sgd", "pipe2-1f1b", "pipe4-1f1b-data-zero1", "tensor2-sgd",
        "tensor4-sgd", "tensor2-adamw"}


@pytest.mark.parametrize("model,policy,world,nmicros,shares,zero,opt,tol",
                         tiered([c[1:] for c in CASES], [c[0] for c in CASES], SLOW))
def test_fp8_equals_the_rule_by_hand(model, policy, world, nmicros, shares, zero, opt, tol):
    m, sample = _model(model)
    errors = parity(m, sample, policy, world, steps=3, nmicros=nmicros, opt=opt, build=_build(opt),
                    reference=_reference(shares), precision="fp8", zero=zero)
    worst = max(max(e) for e in errors)
    assert worst <= tol, f"relative errors per rank (loss, parameters): {errors}"


@pytest.mark.parametrize("policy", tiered(
    [("cube.policies.megatron:PASMegatronTP",),
     (functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True),)],
    ["tensor2", "sequence2"], {"sequence2"}))
def test_fp8_tensor_parallel_forward_is_exact_with_float32_sums(policy):
    """With the partial products summed in float32 (all-reduced, or reduce-scattered under sequence
    parallelism) the first step's loss (the forward alone) equals one process's: every piece of a
    split weight, input and output gradient is scaled with the global amax (each piece scaled
    alone reads 9.5e-5, benchmarks/precision_parity.py)."""
    m, sample = build("gpt_nobias")
    errors = parity(m, sample, policy, 2, steps=1, opt="sgd", build=_build("sgd"),
                    reference=_reference(1), precision="fp8", tp_reduce_dtype=torch.float32)
    assert max(e[0] for e in errors) <= EXACT, errors
    assert max(e[1] for e in errors) <= TP_TOL_SGD, errors


@pytest.mark.slow
def test_fp8_against_float32_training():
    m, sample = build("gpt_nobias")
    errors = parity(m, sample, "cube.policies.data:PASData", 2, steps=3, opt="sgd", build=_build("sgd"),
                    precision="fp8")
    worst = max(max(e) for e in errors)
    assert worst <= FLOAT32_TOL, errors


def test_fp8_equals_torchao_float8_linear():
    """One rank of cube's fp8 against the plain model whose linear layers torchao converted
    (``convert_to_float8_training``, its default tensorwise recipe), the same bf16 main-parameter recipe."""
    float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install torchao)")
    m, sample = build("gpt_nobias")
    converted = float8.convert_to_float8_training(__import__("copy").deepcopy(m))
    assert any(type(x).__name__ == "Float8Linear" for x in converted.modules())

    class LossIslands(Float32Islands):   # the islands but the products: torchao runs those
        LOW = set()

    def reference(model, batches, make):
        return main_params_reference(converted, batches, make, shares=1, islands=LossIslands)
    errors = parity(m, sample, "cube.policies.single:PASSingle", 1, steps=3, opt="adamw", build=_build("adamw"),
                    reference=reference, precision="fp8")
    assert max(max(e) for e in errors) <= EXACT, errors


def test_float8_linear_is_the_recipe():
    """``cube.runtime.float8.linear`` (one piece) against the rule by hand: forward and both gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 32, generator=g).to(torch.bfloat16).requires_grad_()
    w = torch.nn.Parameter(torch.randn(48, 32, generator=g).to(torch.bfloat16))
    b = torch.randn(48, generator=g).to(torch.bfloat16)
    up = torch.randn(3, 5, 48, generator=g).to(torch.bfloat16)
    out = cube.runtime.float8.linear(x, w, b)
    out.backward(up)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = _LinearByHand.apply(x2, w2) + b
    ref.backward(up)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref)
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
    wide = cube.runtime.float8.linear(x, w, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide.to(torch.bfloat16), cube.runtime.float8.linear(x, w))


class _Odd(torch.nn.Module):
    """A linear layer cube converts (32 -> 48) and one it leaves in bf16 (48 -> 24: 24 % 16 != 0)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 48)
        self.down = torch.nn.Linear(48, 24)

    def forward(self, x, y):
        return F.cross_entropy(self.down(torch.relu(self.up(x))), y)


def test_fp8_converts_linear_layers_whose_dims_divide_by_16():
    sample = (torch.randn(8, 32), torch.randint(0, 24, (8,)))
    src = cube.plan(_Odd(), sample, "cube.policies.single:PASSingle", 1, precision="fp8").sources()[0]
    assert "runtime.float8.linear(x.to(torch.bfloat16), self.up_weight, self.up_bias)" in src
    assert "aten.linear.default(relu, self.down_weight, self.down_bias)" in src


@pytest.mark.slow
def test_fp8_tensor_parallel_scales_with_the_global_amax():
    """A split weight's pieces take the maximum amax over the ranks holding them; replicas none."""
    m, sample = build("gpt_nobias")
    src = cube.plan(m, sample, "cube.policies.megatron:PASMegatronTP", 2, precision="fp8").sources()[0]
    assert "runtime.float8.linear(layer_norm_f, self.layers_0_attn_q_proj_weight, ranks=(0, 1))" in src
    assert "runtime.float8.linear(layer_norm_4, self.wte_weight)" in src   # lm_head: replicated


def test_fp8_is_refused_on_gpus_older_than_ada(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"precision='fp8'.*compute capability 8.9 or newer.*A100.* 8\.0"):
        cube.compile(torch.nn.Linear(2, 2), iter([]), PAS="cube.policies.single:PASSingle", precision="fp8")


@pytest.mark.slow
def test_fp8_refuses_schedules_that_split_the_backward():
    m, sample = _model("gpt_untied")
    batch = tuple(torch.cat([t] * 4) for t in sample)
    with pytest.raises(ValueError, match=r"precision='fp8': op 'linear' \(module 'layers\..*runtime\.zb\.linear"):
        cube.plan(m, batch, "cube.policies.pipeline:PASZBH1", 2, precision="fp8", options={"nmicros": 4}).sources()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["cube.policies.data:PASData", "cube.policies.megatron:PASMegatronTP"])
def test_fp8_on_hf_llama(policy):
    """Hugging Face Llama as shipped: every nn.Linear with dims divisible by 16 runs in float8, and
    training follows float32 training within the float8 tolerance."""
    m, sample = build("hf_llama")
    linears = sum(1 for x in m.modules() if isinstance(x, torch.nn.Linear)
                  and x.in_features % 16 == 0 and x.out_features % 16 == 0)
    src = cube.plan(m, sample, policy, 2, precision="fp8").sources()[0]
    assert src.count("runtime.float8.linear(") == linears > 0
    errors = parity(m, sample, policy, 2, steps=3, opt="sgd", build=_build("sgd"), precision="fp8")
    assert max(max(e) for e in errors) <= FLOAT32_TOL, errors


def test_fp8_refuses_pieces_cuda_cannot_multiply(monkeypatch):
    """On CUDA a float8 piece needs a weight with dims divisible by 16 and input rows divisible by 16."""
    import cube.passes.program as program
    monkeypatch.setattr(program, "device_type", lambda: "cuda")
    sample = (torch.randn(8, 32), torch.randint(0, 24, (8,)))   # 8 rows
    with pytest.raises(ValueError, match=r"op 'linear' \(module 'up'.*8 rows on rank 0.*divisible by 16"):
        cube.plan(_Odd(), sample, "cube.policies.single:PASSingle", 1, precision="fp8").sources()
    sample = (torch.randn(16, 32), torch.randint(0, 24, (16,)))
    assert "runtime.float8.linear(" in cube.plan(_Odd(), sample, "cube.policies.single:PASSingle", 1,
                                                 precision="fp8").sources()[0]


def _linear_step(x, w, b, up):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = cube.runtime.float8.linear(x, w, b)
    out.backward(up)
    return out, x.grad, w.grad


def _operands():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 8, 32, generator=g) * 40).to(torch.bfloat16)   # 32 rows: CUDA multiplies multiples of 16
    x.view(-1)[5] = 3e4   # saturates e4m3 once scaled
    return (x, torch.randn(48, 32, generator=g).to(torch.bfloat16), torch.randn(48, generator=g).to(torch.bfloat16),
            torch.randn(4, 8, 48, generator=g).to(torch.bfloat16))


@pytest.fixture
def fresh_kernels(monkeypatch):
    """cube.runtime.float8 with no fused kernel built yet and no failure recorded."""
    f8 = cube.runtime.float8
    monkeypatch.setattr(f8, "_FUSED", {})
    monkeypatch.setattr(f8, "_fused_failed", False)
    return f8


@pytest.mark.slow   # torch.compile builds three CPU kernels (about 20 s)
def test_fused_float8_casts_equal_the_eager_ones(monkeypatch, fresh_kernels):
    """``CUBE_FP8_FUSED=1`` (the default on CUDA) compiles the amax and the scale-and-cast; bit for bit
    the eager kernels' values, forward and both gradients, saturation included."""
    ops = _operands()
    monkeypatch.setenv("CUBE_FP8_FUSED", "0")
    eager = _linear_step(*ops)
    monkeypatch.setenv("CUBE_FP8_FUSED", "1")
    fused = _linear_step(*ops)
    assert set(fresh_kernels._FUSED) == {"amax", torch.float8_e4m3fn, torch.float8_e5m2}
    assert not fresh_kernels._fused_failed
    assert all(torch.equal(a, b) for a, b in zip(eager, fused))


def test_float8_casts_run_eagerly_where_compile_fails(monkeypatch, fresh_kernels, caplog):
    """A device where ``torch.compile`` cannot build the fused kernels (no Triton) runs the eager ones:
    the same values, one warning naming the switch."""
    def broken(fn, **kw):
        def call(*a):
            raise RuntimeError("no triton here")
        return call
    ops = _operands()
    monkeypatch.setenv("CUBE_FP8_FUSED", "0")
    eager = _linear_step(*ops)
    monkeypatch.setenv("CUBE_FP8_FUSED", "1")
    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level("WARNING", logger="cube"):
        fallback = _linear_step(*ops)
        _linear_step(*ops)
    assert all(torch.equal(a, b) for a, b in zip(eager, fallback))
    warned = [r for r in caplog.records if "could not fuse the float8 casts" in r.getMessage()]
    assert len(warned) == 1 and "CUBE_FP8_FUSED=0" in warned[0].getMessage()


def test_fp8_fused_setting(monkeypatch, fresh_kernels):
    """``auto`` fuses on CUDA only (a CPU emulates float8: eager kernels); anything else is refused."""
    x = torch.ones(4, dtype=torch.bfloat16)
    monkeypatch.setenv("CUBE_FP8_FUSED", "auto")
    assert fresh_kernels._kernel("amax", x) is fresh_kernels._EAGER["amax"]
    monkeypatch.setenv("CUBE_FP8_FUSED", "yes")
    with pytest.raises(ValueError, match="CUBE_FP8_FUSED must be 'auto', '1' or '0'"):
        fresh_kernels._kernel("amax", x)
