"""Data parallel on Hugging Face MoE models as shipped (``grouped_mm`` experts kernel): a split of
the batch first fuses each MoE layer that cube proves token-local into one ``moe_experts`` op
(``cube.toolkit.data_parallel`` -> ``cube.ir.experts.fuse_local``), so every rank runs its own
tokens through every expert, no token gathered, and trains exactly like the plain model on the
whole batch. A split of the sequence (context or sequence parallel) fuses them too, on the
tokens' own ``(B, S)`` dims."""
from __future__ import annotations

import functools
import re

import pytest

import cube
import cube.ir.experts
from cube.policies.data import PASData
from cube.policies.megatron3d import PASMegatron
from tests.inprocess import assert_exact, parity
from tests.test_expert_parallel_hf import _model

_TP2 = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1)


def _assert_token_local(model, sample, policy, world: int) -> None:
    """No split is lost (the MoE layers' tokens are not gathered) and each rank's code calls the
    fused experts on its own tokens. Under tensor parallel the one gather is a router's: its weight
    is split over the experts and its small output, the logits, gathered (docs/models.md)."""
    plan = cube.plan(model, sample, policy, world)
    assert plan.lost == [], [r.describe() for r in plan.lost]
    for rank, src in plan.sources().items():
        assert "runtime.experts.moe(" in src, rank
        made = dict(re.findall(r"^\s*(\w+) = (.*)$", src, re.M))
        gathered = re.findall(r"= runtime\.collectives\.all_gather\((\w+),", src)
        assert all("gate_weight" in made.get(g, "") for g in gathered), (rank, [made.get(g) for g in gathered])


@pytest.mark.parametrize("name,policy,world,opt", [
    ("mixtral", "data", 2, "adamw"),
    pytest.param("mixtral", "data", 4, "sgd", marks=pytest.mark.slow),
    pytest.param("mixtral", "tp2", 4, "adamw", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "data", 2, "sgd", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "data", 4, "adamw", marks=pytest.mark.slow),
    pytest.param("qwen2_moe", "tp2", 4, "sgd", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "data", 2, "adamw", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "data", 4, "sgd", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "tp2", 4, "adamw", marks=pytest.mark.slow),
])
def test_moe_layers_stay_data_parallel_and_exact(name, policy, world, opt):
    """PASData on 2 and 4 ranks, PASMegatron dp2 x tp2 on 4: loss and every parameter after 2 steps
    equal the plain model's, and no MoE layer runs on gathered tokens."""
    model, sample = _model(name)
    pas = PASData if policy == "data" else _TP2
    _assert_token_local(model, sample, pas, world)
    assert_exact(parity(model, sample, pas, world, steps=2, opt=opt))


_SP = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True)


@pytest.mark.parametrize("name,policy,world,opt", [
    ("mixtral", "cp", 2, "sgd"),
    ("mixtral_bmm", "sp", 2, "sgd"),   # the batched_mm kernel: (token, expert) pairs as (B, S, k, .)
    # group-limited routing along the experts (view to groups, topk, scatter, expand, masked_fill, gather)
    ("deepseek_v3", "cp", 2, "sgd"),
    pytest.param("qwen2_moe", "sp", 4, "sgd", marks=pytest.mark.slow),      # dp2 x tp2, sequence parallel
    pytest.param("qwen3_moe", "cp", 4, "adamw", marks=pytest.mark.slow),    # dp2 x cp2
])
def test_moe_layers_keep_the_sequence_split(name, policy, world, opt):
    """Under context and sequence parallel the fused layer and its router run on ``(B, S, .)``
    tokens, where the model viewed them as ``(B * S, .)`` rows (``cube.ir.experts.unflatten``): no
    split is lost with ``strict=True`` and the step equals the plain model's."""
    from cube.policies.context import PASContext
    from tests.zoo import PARAM_FLOOR, build
    zoo = name.endswith("_bmm") or name == "deepseek_v3"
    model, sample = build(name, 4) if zoo else _model(name)
    pas = functools.partial(PASContext, cp=2) if policy == "cp" else _SP
    plan = cube.plan(model, sample, pas, world)
    assert plan.lost == [], [r.describe() for r in plan.lost]
    fused = "runtime.experts.moe(" if not name.endswith("_bmm") else "aten.matmul.default("
    assert all(fused in src and ("lead=2" in src or "_bmm" in name) for src in plan.sources().values())
    floor = dict(param_floor=PARAM_FLOOR) if name == "deepseek_v3" else {}   # as tests.zoo compares it
    assert_exact(parity(model, sample, pas, world, steps=2, opt=opt, strict=True, **floor))


@pytest.mark.slow
def test_pipeline_stages_cut_after_the_fusion():
    """PASMegatron dp2 x pp2 (1F1B, 2 micro-batches) fuses before it cuts its stages: each
    micro-batch's tokens of each data-parallel rank run the fused layer, exactly."""
    model, sample = _model("mixtral")
    pas = functools.partial(PASMegatron, tp=1, pp=2, nmicros=2)
    plan = cube.plan(model, sample, pas, 4)
    assert plan.lost == [] and all("runtime.experts.moe(" in src for src in plan.sources().values())
    assert_exact(parity(model, sample, pas, 4, steps=2, nmicros=2, opt="adamw"))


@pytest.mark.slow
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_the_load_balancing_loss_stays_the_whole_batchs(opt):
    """Mixtral's router auxiliary loss (``output_router_logits=True``) reads every token's router
    probabilities; it is the single device's under PASData on 4 ranks."""
    model, sample = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.1)
    assert_exact(parity(model, sample, PASData, 4, steps=2, opt=opt))


@pytest.mark.slow
def test_a_layer_cube_cannot_fuse_stays_gathered_reported_and_exact(monkeypatch):
    """A proved region that the fusion refuses keeps today's plan: it runs whole on the tokens
    gathered, each of its ops reported as a lost split, and the step is still exact."""
    def refuse(graph, region, capacity_factor=None):
        raise ValueError("refused")
    monkeypatch.setattr(cube.ir.experts, "_fuse", refuse)
    model, sample = _model("mixtral")
    plan = cube.plan(model, sample, PASData, 2)
    assert {r.op for r in plan.lost} == {"sort", "index"}
    assert all("runtime.experts.moe" not in src and "runtime.collectives.all_gather" in src
               for src in plan.sources().values())
    assert_exact(parity(model, sample, PASData, 2, steps=2, opt="sgd"))


@pytest.mark.slow
def test_deepseek_v2_moe_layers_stay_data_parallel():
    """DeepSeek-V2 (tests.zoo's tiny config: shared experts, a first dense layer) under PASData on
    2 ranks: its MoE layer is fused, nothing gathered, exact (parameters with the zoo's floor)."""
    from tests.zoo import PARAM_FLOOR, build
    model, sample = build("deepseek_v2")
    _assert_token_local(model, sample, PASData, 2)
    assert_exact(parity(model, sample, PASData, 2, steps=2, opt="sgd", param_floor=PARAM_FLOOR))


def test_per_expert_biases_gathered_by_id_stay_data_parallel_and_refuse_an_expert_split():
    """GPT-OSS adds per-expert biases gathered by the sorted expert ids (``bias[ids]``) inside its
    experts: the fused layer reads them as rows of its pairs, so PASData keeps the tokens split
    (exact, nothing gathered), and expert parallel, which would run the experts on rows other ranks
    sorted, is refused naming the layer."""
    from tests.test_expert_parallel_hf import _ep
    from tests.zoo import PARAM_FLOOR, build
    model, sample = build("gpt_oss")
    _assert_token_local(model, sample, PASData, 2)
    assert_exact(parity(model, sample, PASData, 2, steps=2, opt="sgd", param_floor=PARAM_FLOOR, strict=True))
    with pytest.raises(ValueError, match=r"per-expert bias by the sorted expert ids .*Drop ep="):
        cube.plan(model, sample, _ep(2), 2)
