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
    ("data2-adamw", "gpt_nobias", "cube.policies.data:PASData", 2, 1, 2, 0, "adamw", EXACT),
    ("data2-sgd", "gpt_nobias", "cube.policies.data:PASData", 2, 1, 2, 0, "sgd", EXACT),
    ("data4-zero1", "gpt_nobias", "cube.policies.data:PASData", 4, 1, 4, 1, "adamw", EXACT),
    ("data2-zero2", "gpt_nobias", "cube.policies.data:PASData", 2, 1, 2, 2, "adamw", EXACT),
    ("data4-zero3", "gpt_nobias", "cube.policies.data:PASData", 4, 1, 4, 3, "adamw", EXACT),
    # the test pipelines cut each global batch into 4 micro-batches
    ("pipe2-1f1b", "gpt_untied", "tests/extra_policies.py:PAS1F1B", 2, 4, 4, 0, "adamw", EXACT),
    ("pipe4-1f1b-data-zero1", "gpt_untied", "tests/extra_policies.py:PAS1F1BData", 4, 4, 8, 1, "adamw", EXACT),
    ("tensor2-sgd", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, 1, 1, 0, "sgd", TP_TOL_SGD),
    ("tensor4-sgd", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 4, 1, 1, 0, "sgd", TP_TOL_SGD),
    ("tensor2-adamw", "gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2, 1, 1, 0, "adamw", TP_TOL_ADAMW),
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
    errors = parity(m, sample, "cube.policies.data:PASData", 2, steps=3, opt="sgd", build=_build("sgd"),
                    precision="bf16")
    worst = max(max(e) for e in errors)
    assert worst <= FLOAT32_TOL, errors


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_checkpoints_hold_the_float32_main_parameters(zero, tmp_path):
    """Saved values are the main parameters (merge gives float32 values a plain model loads), and a
    resumed run continues as the run that saved."""
    import copy
    import tempfile

    import cube.debug
    from tests.parity import global_batches
    m, sample = build("gpt_nobias")
    batches = global_batches(sample, 4)
    cache = tempfile.mkdtemp(prefix="cube-main-ckpt-")
    path = str(tmp_path / "ckpt")

    def body():
        def compiled(start=0):
            it = iter(batches[start:])

            @cube.compile(copy.deepcopy(m), it, PAS="cube.policies.data:PASData", cache_dir=cache, precision="bf16",
                          zero=zero)
            def train_iter(model, dataloader):
                data = next(dataloader)
                loss = model(*data)
                loss.backward()
                return loss
            gen = cube.load_model()
            return train_iter, gen, cube.build_optimizer(gen, torch.optim.AdamW, lr=1e-3), it
        step, gen, opt, it = compiled()
        for _ in range(2):
            step(gen, it)
            opt.step()
            opt.zero_grad()
        cube.save_checkpoint(path, gen, opt)
        with cube.runtime.zero.whole_parameters(gen):
            saved = {gen.PARAMS[k][0][0]: p.detach().clone() for k, p in gen.named_parameters()}
        losses = [float(step(gen, it))]
        opt.step()
        opt.zero_grad()
        step2, gen2, opt2, it2 = compiled(start=2)   # after the batches the saved run consumed
        cube.load_checkpoint(path, gen2, opt2)
        losses.append(float(step2(gen2, it2)))
        opt2.step()
        opt2.zero_grad()
        with cube.runtime.zero.whole_parameters(gen), cube.runtime.zero.whole_parameters(gen2):
            same = all(torch.equal(a, b) for a, b in zip(gen.parameters(), gen2.parameters()))
        return saved, losses, same
    results = cube.debug.run(body, 2)
    state, _ = cube.merge_checkpoint(path)
    saved = results[0][0]
    for name, value in saved.items():
        assert value.dtype == torch.float32 and state[name].dtype == torch.float32
        assert torch.equal(state[name], value), name
    for _, losses, same in results:
        assert losses[0] == losses[1] and same


class _Islands(torch.nn.Module):
    """A float32 buffer scaling the float32 batch before a projection, a norm, log_softmax and a loss."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.proj = torch.nn.Linear(d, d)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x, y):
        h = self.norm(self.proj(x * self.scale))
        return torch.nn.functional.nll_loss(torch.nn.functional.log_softmax(h, dim=-1), y)


def test_forward_runs_in_the_weights_dtype_with_float32_islands(tmp_path):
    """No autocast: the generated forward computes in bf16 and prints its only casts: the float32
    product of batch and buffer read by the projection in bf16, log_softmax in float32 on the CPU
    (rounded back), the loss's input widened. The plan equals the recipe by hand on 2 ranks."""
    from tests.parity import compile_step
    m, sample = _Islands(), (torch.randn(8, 16), torch.randint(0, 16, (8,)))
    step = compile_step(m, iter([sample, sample]), "cube.policies.single:PASSingle", tmp_path, precision="bf16")
    src = step.source
    assert "autocast" not in src
    assert "aten.linear.default(mul.to(torch.bfloat16), " in src
    assert "aten.log_softmax.int(layer_norm.to(torch.float32), -1).to(torch.bfloat16)" in src
    assert "aten.nll_loss_nd.default(log_softmax.to(torch.float32), y)" in src
    model = cube.load_model()
    cube.build_optimizer(model, torch.optim.SGD, lr=0.1)
    loss = step(model, iter([sample]))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    errors = parity(_Islands(), sample, "cube.policies.data:PASData", 2, steps=3, opt="adamw", build=_build("adamw"),
                    reference=functools.partial(main_params_reference, shares=2), precision="bf16")
    assert max(max(e) for e in errors) <= EXACT, errors


def test_tp_reduce_dtype_sums_partial_products_in_float32():
    """``tp_reduce_dtype=torch.float32``: a row-parallel product reads float32 inputs, is summed in
    float32 and rounded to bf16 where it is read (the generated code prints the casts)."""
    m, sample = build("gpt_nobias")
    src = cube.plan(m, sample, "cube.policies.megatron:PASMegatronTP", 2, precision="bf16",
                    tp_reduce_dtype=torch.float32).sources()[0]
    assert ("linear_3 = aten.linear.default(view_3.to(torch.float32), "
            "self.layers_0_attn_c_proj_weight.to(torch.float32))") in src
    assert "runtime.collectives.all_reduce(linear_3, ranks=(0, 1), inplace=True)" in src
    assert "aten.add.Tensor(add, linear_3_sum.to(torch.bfloat16))" in src
    assert "aten.linear.default(layer_norm_f, self.layers_0_attn_q_proj_weight)" in src   # column-parallel: whole sums


@pytest.mark.parametrize("dtype,precision,match", [
    (torch.bfloat16, "bf16", "tp_reduce_dtype must be None"),
    (torch.float32, None, "precision=None has none"),
    (torch.float32, "bf16-autocast", "precision='bf16-autocast' has none"),
])
def test_tp_reduce_dtype_refusals(dtype, precision, match):
    with pytest.raises(ValueError, match=match):
        cube.compile(torch.nn.Linear(2, 2), iter([]), PAS="cube.policies.single:PASSingle", precision=precision,
                     tp_reduce_dtype=dtype)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_tp_reduce_dtype_makes_the_forward_exact(world):
    """Summed in float32, the first step's loss (the forward alone) equals the recipe by hand; the
    backward's partial sums (the gradient of a value several column-parallel products read) still
    round otherwise than one process's (docs/precision.md): parameters within ``TP_TOL_SGD``."""
    m, sample = build("gpt_nobias")
    errors = parity(m, sample, "cube.policies.megatron:PASMegatronTP", world, steps=1, opt="sgd", build=_build("sgd"),
                    reference=functools.partial(main_params_reference, shares=1), precision="bf16",
                    tp_reduce_dtype=torch.float32)
    assert max(e[0] for e in errors) <= EXACT, errors
    assert max(e[1] for e in errors) <= TP_TOL_SGD, errors
