"""Dropless expert parallel on Hugging Face MoE models as shipped (``grouped_mm`` experts kernel):
``PASMegatron(ep=2)`` finds each MoE layer from the graph (a sort of the tokens by expert, grouped
matmuls over ``(E, ., .)`` weights; ``cube.ir.experts``), keeps ``1/ep`` of the experts on each
rank, sends the tokens to their experts by all-to-all and back, and trains exactly like the plain
model; what it cannot split by experts is refused, naming the op."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import transformers

import cube
import cube.debug
from cube.policies.megatron3d import PASMegatron
from tests.inprocess import ADAMW, assert_exact, parity
from tests.zoo import LM, SMALL, S, V, no_dropout


def _model(name: str, **extra):
    torch.manual_seed(0)
    if name == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **SMALL, **extra)
        model = transformers.MixtralForCausalLM(no_dropout(cfg))
    elif name == "qwen2_moe":   # with its shared expert (and the shared expert's gate)
        cfg = transformers.Qwen2MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=64, **SMALL, **extra)
        model = transformers.Qwen2MoeForCausalLM(no_dropout(cfg))
    else:
        cfg = transformers.Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                          head_dim=8, **SMALL, **extra)
        model = transformers.Qwen3MoeForCausalLM(no_dropout(cfg))
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (4, S), generator=gen)
    return LM(model), (ids, ids.clone())


def _ep(ep: int = 2):
    return functools.partial(PASMegatron, tp=1, pp=1, nmicros=1, ep=ep)


@pytest.mark.parametrize("name,world,opt", [("mixtral", 2, "adamw"), ("mixtral", 4, "sgd"),
                                            ("qwen2_moe", 2, "sgd"), ("qwen2_moe", 4, "adamw"),
                                            ("qwen3_moe", 2, "adamw"), ("qwen3_moe", 4, "sgd")])
def test_hf_moe_expert_parallel_is_exact(name, world, opt):
    """ep2 (2 ranks) and ep2 x dp2 (4 ranks): loss and every parameter piece after 2 steps."""
    model, sample = _model(name)
    assert_exact(parity(model, sample, _ep(2), world, steps=2, opt=opt))


def test_one_expert_per_rank():
    """ep4 on 4 ranks: each rank holds one of Mixtral's 4 experts."""
    model, sample = _model("mixtral")
    assert_exact(parity(model, sample, _ep(4), 4, steps=2, opt="adamw"))


def test_the_load_balancing_loss_is_the_single_devices():
    """Mixtral's router auxiliary loss (``output_router_logits=True``) over the whole batch."""
    model, sample = _model("mixtral", output_router_logits=True, router_aux_loss_coef=0.1)
    assert_exact(parity(model, sample, _ep(2), 4, steps=2, opt="adamw"))


def test_each_rank_holds_its_share_of_the_experts_and_their_optimizer_state():
    """Measured on each rank after an AdamW step: the expert weights and their AdamW moments are
    ``1/ep`` of the model's; every other parameter is whole (data parallel)."""
    model, sample = _model("mixtral")
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    other = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." not in n)

    def body():
        it = iter([sample])

        @cube.compile(copy.deepcopy(model), it, PAS=_ep(2))
        def step(m, dl):
            loss = m(*next(dl))
            loss.backward()
            return loss
        gen = cube.load_model()
        opt = torch.optim.AdamW(gen.parameters(), lr=1e-3, **ADAMW)
        step(gen, it)
        opt.step()
        mine = {"experts": 0, "experts_state": 0, "other": 0}
        for local, p in gen.named_parameters():
            kind = "experts" if ".experts." in gen.PARAMS[local][0][0] else "other"
            mine[kind] += p.numel() * p.element_size()
            if kind == "experts":
                mine["experts_state"] += sum(s.numel() * s.element_size() for s in opt.state[p].values()
                                             if torch.is_tensor(s) and s.ndim > 0)
        return mine
    for mine in cube.debug.run(body, 2):
        assert mine == {"experts": expert // 2, "experts_state": 2 * expert // 2, "other": other}, mine


def test_a_dispatch_cube_cannot_split_by_experts_is_refused():
    """The per-expert counts of the whole batch in a loss: the sort is not token-local."""
    from tests.test_moe_dispatch import SortMoE, _sample
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"expert parallel: cube could not prove .*op 'sum'"):
        cube.plan(SortMoE("aux"), _sample(4), _ep(2), 2)


def test_experts_read_by_expert_id_are_refused_not_replicated():
    """A batched_mm kernel gathers each pair's expert weights by id (``w[ids]``): no grouped matmul,
    no ``(E, ...)`` weight read whole; ``ep=`` is refused rather than left replicated."""
    from tests.zoo import build
    model, sample = build("mixtral_bmm")
    with pytest.raises(ValueError, match=r"expert parallel: the model has no expert weights"):
        cube.plan(model, sample, _ep(2), 2)


@pytest.mark.parametrize("variant", ["grouped", "onehot"])
def test_a_hand_written_sort_dispatch_is_exact(variant):
    """``onehot``: group offsets counted before the sort from a one-hot of the top-k ids over the whole
    batch, rows put back by ``scatter_add`` (torchtitan's MoE): each rank counts its own tokens again."""
    from tests.test_moe_dispatch import SortMoE, _sample
    torch.manual_seed(0)
    assert_exact(parity(SortMoE(variant), _sample(4), _ep(2), 2, steps=2, opt="adamw"))


@pytest.mark.parametrize("name,tp,pp,opt", [("mixtral", 2, 1, "adamw"), ("qwen2_moe", 2, 1, "sgd"),
                                            ("mixtral", 1, 2, "adamw"), ("qwen3_moe", 1, 2, "sgd")])
def test_expert_parallel_with_tensor_or_pipeline_parallel_is_exact(name, tp, pp, opt):
    """ep2 x tp2 (attention and dense MLPs tensor parallel, experts expert parallel) and ep2 x pp2
    (1F1B, 2 micro-batches) on 4 ranks; every rank holds half of each expert weight it holds."""
    model, sample = _model(name)
    nmicros = 2 if pp > 1 else 1
    policy = functools.partial(PASMegatron, tp=tp, pp=pp, nmicros=nmicros, ep=2)
    plan = cube.plan(model, sample, policy, 4)
    for r, p in plan.program.plans.items():
        experts = [(t, box) for t, box in p.attrs if ".experts." in t.names[0]]
        assert experts and all(box[0][1] - box[0][0] == t.shape[0] // 2 for t, box in experts), (r, experts)
    assert_exact(parity(model, sample, policy, 4, steps=2, nmicros=nmicros, opt=opt))


def test_deepseek_v2_routed_experts_split_shared_experts_data_parallel():
    """DeepSeek-V2 (tests.zoo's tiny config: multi-head latent attention, shared experts, a first
    dense layer): the routed experts split over ep2 x dp2, exact."""
    from tests.zoo import PARAM_FLOOR, build
    model, sample = build("deepseek_v2")
    plan = cube.plan(model, sample, _ep(2), 4)
    for r, p in plan.program.plans.items():
        routed = [(t, box) for t, box in p.attrs if ".experts." in t.names[0]]
        assert routed and all(box[0][1] - box[0][0] == t.shape[0] // 2 for t, box in routed), (r, routed)
    assert_exact(parity(model, sample, _ep(2), 4, steps=2, opt="adamw", param_floor=PARAM_FLOOR))
