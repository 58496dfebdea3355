"""The simulator under ``precision="fp8"`` (``cube.sim.cluster.DeviceCosts``, ``cube.sim.float8``):
the float8 linears it prices are those the plan runs in float8 (``cube.passes.float8.float8_ops``),
their products run at the profile's fp8 peak, the passes around them are what a real
``cube.runtime.float8.linear`` call runs (counted here op by op on the CPU, whose ``_scaled_mm``
emulates CUDA's), autograd keeps what that call keeps, a profile without float8 tensor cores is
refused, and ``python -m cube.sim --precision fp8`` predicts with MFU against the bf16 peak."""
import json
import re

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import cube
from cube.passes.float8 import float8_ops
from cube.runtime import float8 as runtime_float8
from cube.sim import hardware
from cube.sim.api import simulate_policy
from cube.sim.cluster import ClusterComm, DeviceCosts
from cube.sim.simulate import build_programs
from examples.gpt.model import GPT, GPTConfig

H100 = hardware.load("dgx-h100")


def _costs(planned, precision: str, world: int = 1) -> DeviceCosts:
    """``DeviceCosts`` on dgx-h100 bound to the plan's dtypes and float8 set (by building its programs)."""
    costs = DeviceCosts(H100, precision)
    build_programs(planned.graph, world, costs, ClusterComm(H100), 0, True, planned.program)
    return costs


def _calls(planned, name: str = "linear"):
    return [c for r in sorted(planned.program.ranks) for c in planned.program[r].plan.calls
            if c.op is not None and c.op.name == name]


def test_the_float8_linears_priced_are_those_the_plan_runs_in_float8():
    """A GPT whose vocabulary (500) is not a multiple of 16: its tied output projection stays bf16,
    every other linear (six per layer) runs in float8, and those are the ones priced on the fp8
    peak, on both ranks of a data parallel plan."""
    config = GPTConfig(vocab_size=500, block_size=32, n_layer=2, n_head=4, n_embd=64)
    model = GPT(config)
    ids = torch.zeros(4, 32, dtype=torch.long)
    planned = cube.plan(model, (ids, ids), "PASData", 2, precision="fp8")
    costs = _costs(planned, "fp8", world=2)
    chosen = float8_ops(planned.graph)
    eligible = [m for m in model.modules() if isinstance(m, nn.Linear)
                and all(d % 16 == 0 for d in m.weight.shape)]
    assert len(chosen) == len(eligible) == 6 * config.n_layer   # q, k, v, output; the MLP's two
    linears = _calls(planned)
    priced = {id(c.op.root) for c in linears if costs.is_float8(c.op)}
    assert priced == chosen
    for c in linears:   # a float8 piece keeps its own 1-byte tensors; a bf16 one holds its input
        saved = costs.op_cost(c).saved
        assert all(kind == "x" for kind, _ in saved) == (id(c.op.root) in chosen), (c.op.module_path, saved)
    bf16 = cube.plan(model, (ids, ids), "PASData", 2, precision="bf16")
    assert not _costs(bf16, "bf16", world=2).float8


def test_tensor_parallel_pieces_all_reduce_their_amaxes_forward_and_backward():
    """Under tensor parallelism the pieces of a float8 linear share their scales
    (``Call.amax_ranks``): each rank's program all-reduces the two amaxes (8 bytes) before the
    forward product and the output gradient's (4 bytes) before the backward, once per such piece."""
    config = GPTConfig(vocab_size=512, block_size=32, n_layer=1, n_head=4, n_embd=64)
    ids = torch.zeros(4, 32, dtype=torch.long)
    planned = cube.plan(GPT(config), (ids, ids), "PASMegatron", 2, precision="fp8",
                        options={"tp": 2, "pp": 1, "nmicros": 1})
    costs = DeviceCosts(H100, "fp8")
    programs = build_programs(planned.graph, 2, costs, ClusterComm(H100), 0, True, planned.program)
    for r, prog in programs.items():
        shared = [c for c in planned.program[r].plan.calls if len(c.amax_ranks) > 1]
        assert shared and all(costs.is_float8(c.op) for c in shared)
        for cat, nbytes in (("forward", 8), ("backward", 4)):
            amaxes = [i for i in prog.ins if i.op == "coll" and i.cat == cat and i.nbytes == nbytes
                      and i.label.startswith("all_reduce")]
            assert len(amaxes) == len(shared), (r, cat)


class _Wide(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).sum()


def test_fp8_is_faster_on_large_products_and_their_forward_runs_at_the_fp8_peak():
    """Two 16384 x 16384 linears on 32768 rows (meta tensors) on dgx-h100: the step is faster in fp8
    than in bf16 (the products' savings outweigh the eager amax and cast passes); each float8
    forward product takes its FLOPs at the profile's fp8 peak times its GEMM efficiency (read from
    the profile's file here), which is bf16's product time times the ratio of the two peaks."""
    d, rows = 16384, 32768
    with torch.device("meta"):
        model = _Wide(d)
    x = torch.empty(rows, d, device="meta")
    steps = {}
    for precision in ("bf16", "fp8"):
        steps[precision] = simulate_policy(model, (x,), "PASSingle", 1, costs=DeviceCosts(H100, precision),
                                           comm=ClusterComm(H100), precision=precision).step_time
    assert steps["fp8"] < steps["bf16"], steps
    raw = json.loads((hardware.HERE / "dgx-h100.json").read_text())["device"]
    gemm = raw["efficiency"]["gemm"]
    flops = 2 * rows * d * d
    expected = flops / (raw["peak_tflops"]["fp8"] * 1e12 * gemm["max"] * flops / (flops + gemm["half_gflop"] * 1e9))
    fp8 = cube.plan(model, (x,), "PASSingle", 1, precision="fp8")
    bf16 = cube.plan(model, (x,), "PASSingle", 1, precision="bf16")
    costs8, costs16 = _costs(fp8, "fp8"), _costs(bf16, "bf16")
    ratio = raw["peak_tflops"]["bf16"] / raw["peak_tflops"]["fp8"]
    for c8, c16 in zip(_calls(fp8), _calls(bf16)):
        forward = costs8.float8_seconds(c8).products[0]
        assert forward == pytest.approx(expected, rel=1e-9)
        shapes = [tuple(t.shape) for t in c16.op.inputs], [tuple(t.shape) for t in c16.op.outputs]
        assert forward == pytest.approx(costs16.device_seconds(c16.op, *shapes)[0] * ratio, rel=1e-9)


def test_a_profile_without_float8_tensor_cores_refuses_fp8():
    a100 = hardware.load("dgx-a100-80g")
    with pytest.raises(ValueError, match=r"precision='fp8': hardware profile 'dgx-a100-80g' has no fp8 peak.*"
                                         r"precision='bf16'.*dgx-h100"):
        DeviceCosts(a100, "fp8")
    # the 500 W part's fp8 peak is the SXM datasheet's by the power law its bf16 peak follows
    capped = hardware.load("h100-hbm2e-500w")
    law = (capped.device["power_w"] / H100.device["power_w"]) ** (1 / 3)
    assert capped.peak_flops("fp8") == pytest.approx(H100.peak_flops("fp8") * law, rel=0.01)
    assert H100.peak_flops("fp8") == 1979e12
    # costs and plan at different precisions would price the float8 products wrongly: refused
    config = GPTConfig(vocab_size=512, block_size=32, n_layer=1, n_head=4, n_embd=64)
    ids = torch.zeros(2, 32, dtype=torch.long)
    for costs, plan in (("bf16", "fp8"), ("fp8", "bf16")):
        with pytest.raises(ValueError, match="pass the same precision to both"):
            simulate_policy(GPT(config), (ids, ids), "PASSingle", 1, costs=DeviceCosts(H100, costs),
                            comm=ClusterComm(H100), precision=plan)


class _Counter(TorchDispatchMode):
    """Every kernel an eager call runs (views are metadata, not kernels) and the bytes its tensors
    with dims occupy (read and written; scalars left out); ``_scaled_mm`` counted apart."""

    def __init__(self):
        super().__init__()
        self.kernels, self.bytes, self.products = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        if func is torch.ops.aten._scaled_mm.default:
            self.products += 1
            return out
        self.kernels += 1
        self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                          if isinstance(t, torch.Tensor) and t.dim() > 0)
        return out


class _NormLinear(nn.Module):
    def __init__(self, d: int, out: int):
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(d), nn.Linear(d, out)

    def forward(self, x):
        return self.proj(self.norm(x)).sum()


def test_the_passes_and_saved_tensors_priced_are_those_of_a_real_float8_linear(monkeypatch):
    """The float8 linear of a norm + linear (with a bias) plan, priced on dgx-h100 with the eager
    casts (``CUBE_FP8_FUSED=0``), against a real ``cube.runtime.float8.linear`` call at the same
    shapes on the CPU: the kernels around its products and the bytes they move, forward and
    backward, and the tensors autograd saves."""
    monkeypatch.setenv("CUBE_FP8_FUSED", "0")
    b, s, d, out = 4, 32, 64, 48
    planned = cube.plan(_NormLinear(d, out), (torch.randn(b, s, d),), "PASSingle", 1, precision="fp8")
    costs = _costs(planned, "fp8")
    call, = _calls(planned)
    got = costs.float8_seconds(call)
    assert costs.op_cost(call).saved == tuple(("x", n) for n in got.work.saved)   # tensors of its own

    x = torch.randn(b, s, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(out, d, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(out, dtype=torch.bfloat16, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    forward = _Counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward:
        y = runtime_float8.linear(x, w, bias)
    grad = torch.randn_like(y)
    backward = _Counter()
    with backward:
        y.backward(grad)
    assert (forward.products, backward.products) == (1, 2)
    assert (got.work.forward.bytes, got.work.forward.kernels) == (forward.bytes, forward.kernels)
    assert (got.work.backward.bytes, got.work.backward.kernels) == (backward.bytes, backward.kernels)
    assert got.launches == (forward.kernels + 1, backward.kernels + 2)
    assert sorted(got.work.saved) == sorted(t.numel() * t.element_size() for t in saved)
    assert {t.dtype for t in saved} == {torch.float8_e4m3fn, torch.float32}


SPEC = '''
import torch
from examples.gpt.model import GPT, GPTConfig


def build():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=512, block_size=256, n_layer=2, n_head=8, n_embd=512))
    ids = torch.zeros(16, 256, dtype=torch.long, device="meta")
    return model, (ids, ids)
'''


def test_the_command_line_predicts_fp8_with_mfu_against_the_bf16_peak(tmp_path, capsys):
    from cube.sim.__main__ import main
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    base = [str(spec), "--ngpus", "2", "--policy", "PASData", "--precision", "fp8"]
    assert main(base + ["--hardware", "dgx-h100"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"MFU [\d.]+% of dgx-h100's bf16 peak \(fp8: counted against the bf16 peak", text), text
    assert "precision fp8" in text
    assert main(base + ["--hardware", "dgx-h100", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["precision"] == "fp8" and out["mfu_peak"] == "bf16"
    assert out["tflops_per_device"] == pytest.approx(out["mfu"] * 989, rel=1e-6)
    for hw, why in (("dgx-a100-80g", "has no fp8 peak"), ("cpu-host", "measured")):
        with pytest.raises(SystemExit):
            main(base + ["--hardware", hw])
        assert why in capsys.readouterr().err


def test_fused_casts_are_priced_as_one_read_and_one_float8_write_per_operand(monkeypatch):
    """On CUDA the runtime fuses each amax and cast (``CUBE_FP8_FUSED``, default ``auto``): per
    operand of n bf16 elements the amax reads 2n bytes and the cast reads 2n and writes n, one
    kernel each, where the eager ones move 33n in seven (abs, max, the amax's float32 cast, the operand's
    float32 copy, the product by the scale, the clamp, the float8 cast)."""
    b, s, d, out = 4, 32, 64, 48
    planned = cube.plan(_NormLinear(d, out), (torch.randn(b, s, d),), "PASSingle", 1, precision="fp8")
    call, = _calls(planned)
    priced = {}
    for mode in ("0", "auto"):
        monkeypatch.setenv("CUBE_FP8_FUSED", mode)
        priced[mode] = _costs(planned, "fp8").float8_seconds(call).work
    eager, fused = priced["0"], priced["auto"]
    nx, nw, no = b * s * d, out * d, b * s * out
    forward_saving = sum(33 * n - 5 * n for n in (nx, nw))
    assert eager.forward.bytes - fused.forward.bytes == forward_saving
    assert eager.backward.bytes - fused.backward.bytes == 33 * no - 5 * no
    assert eager.forward.kernels - fused.forward.kernels == 2 * (7 - 2)
    assert eager.backward.kernels - fused.backward.kernels == 7 - 2
    assert eager.saved == fused.saved
