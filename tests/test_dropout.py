"""Dropout with defined semantics (``cube.runtime.rng``, ``docs/random.md``), models as shipped
(dropout 0.1).

Exact mode (``exact_rng=True``): every plan draws the single device's masks, so Hugging Face GPT-2
and BERT with dropout on train exactly like the plain model (loss and parameters, SGD, two steps,
so the default generator's state carried into step 2 is checked too) under data, tensor, 1F1B,
data x pipeline and 3D plans, with recompute on and off, in the in-process world and across gloo
processes; inputs that are not contiguous draw in their memory order; what cube cannot reproduce
is refused. Default mode: replicas of a tensor share a mask, pieces of a split tensor and
data-parallel ranks draw independent ones, and recompute redraws the same masks.
"""
from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
import cube.debug
from tests.inprocess import assert_exact, eager_reference, optimizer, parity
from tests.parity import global_batches
from tests.tiers import tiered
from tests.zoo import LM, PARAM_FLOOR, PLANS, S, V

transformers = pytest.importorskip("transformers")
SEED = 1234


def _gpt2(batch: int):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1   # as shipped
    ids = torch.randint(0, V, (batch, S), generator=torch.Generator().manual_seed(1))
    return LM(transformers.GPT2LMHeadModel(cfg)), (ids, ids.clone())


def _bert(batch: int):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    ids = torch.randint(0, V, (batch, S), generator=torch.Generator().manual_seed(1))
    return LM(transformers.BertForMaskedLM(cfg)), (ids, ids.clone())


def _exact(build, plan: str, recompute: bool):
    p = PLANS[plan]
    model, sample = build(p.micro)
    options = dict(p.options, recompute="all" if recompute else False)
    policy = type(p)(p.policy, p.world, tuple(options.items()), p.nmicros, p.micro).make()
    errors = parity(model, sample, policy, p.world, steps=2, nmicros=p.nmicros, opt="sgd",
                    param_floor=PARAM_FLOOR, seed=SEED, exact_rng=True)
    assert_exact(errors)
    return model, sample, p


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("plan", ["data", "tensor", "pipeline"])
def test_gpt2_dropout_exact(plan, recompute):
    _exact(_gpt2, plan, recompute)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("tp", [2, 1], ids=["3d", "data_x_pipeline"])
def test_gpt2_dropout_exact_4_ranks(tp, recompute):
    """tp x pp (PLANS["3d"]), and data x pipeline, where a micro-batch's rows of the global batch's
    mask are a slice of each data-parallel part (``micro_batches(interleave=2)``)."""
    from cube.policies.megatron3d import PASMegatron
    model, sample = _gpt2(2)
    policy = functools.partial(PASMegatron, tp=tp, pp=2, nmicros=2, recompute="all" if recompute else False)
    assert_exact(parity(model, sample, policy, 4, steps=2, nmicros=2, opt="sgd", param_floor=PARAM_FLOOR,
                        seed=SEED, exact_rng=True))


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("plan", ["data", "tensor", "pipeline", "3d"])
def test_bert_dropout_exact(plan, recompute):
    _exact(_bert, plan, recompute)


def _bart(batch: int):
    """BART as shipped: dropout 0.1, its attention and activation dropouts at 0 (calls that draw
    nothing, between the ones that do)."""
    torch.manual_seed(0)
    cfg = transformers.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, max_position_embeddings=64)
    assert cfg.dropout == 0.1 and cfg.attention_dropout == cfg.activation_dropout == 0.0   # as shipped
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, V, (batch, S), generator=g), torch.randint(0, V, (batch, S), generator=g)
    return LM(transformers.BartForConditionalGeneration(cfg)), (ids, labels)


@pytest.mark.parametrize("plan", tiered([("data",), ("pipeline",)], ["data", "pipeline"], {"pipeline"}))
def test_bart_dropout_exact(plan):
    """The program's dropouts of probability 0 are not counted among the draws (``cube.passes.rng``)."""
    _exact(_bart, plan, False)


def _xglm(batch: int):
    """HF XGLM as shipped: dropout 0.1 on the attention probabilities of ``(B*H, T, T)`` merged heads
    (``cube.trace.heads`` runs them on ``(B, H, T, T)``) and on the residual stream."""
    torch.manual_seed(0)
    cfg = transformers.XGLMConfig(vocab_size=V, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                  max_position_embeddings=64)
    assert cfg.dropout == cfg.attention_dropout == 0.1   # as shipped
    ids = torch.randint(0, V, (batch, S), generator=torch.Generator().manual_seed(1))
    return LM(transformers.XGLMForCausalLM(cfg)), (ids, ids.clone())


@pytest.mark.parametrize("plan", tiered([("tensor",), ("sp",), ("pipeline_1",)], ["tensor", "sp", "pipeline_1"],
                                        {"sp", "pipeline_1"}))
def test_xglm_dropout_on_merged_heads_exact(plan):
    """The attention dropout on merged heads draws the single device's mask under tensor and
    sequence parallel and one-sample micro-batches, every split kept (``strict=True``)."""
    p = PLANS[plan]
    model, sample = _xglm(p.micro)
    assert_exact(parity(model, sample, p.make(), p.world, steps=2, nmicros=p.nmicros, opt="sgd",
                        param_floor=PARAM_FLOOR, seed=SEED, exact_rng=True, strict=True))


def _swin(batch: int):
    """HF Swin as shipped: stochastic depth 0.1 (``torch.rand`` of one number per sample per block)."""
    torch.manual_seed(0)
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[4, 8],
                                  window_size=4, num_labels=10)
    assert cfg.drop_path_rate == 0.1   # as shipped
    g = torch.Generator().manual_seed(1)
    return LM(transformers.SwinForImageClassification(cfg)), \
        (torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))


@pytest.mark.parametrize("plan", tiered([("data",), ("pipeline",), ("pipeline_1",)], ["data", "pipeline", "pipeline_1"],
                                        {"pipeline", "pipeline_1"}))
def test_swin_drop_path_exact(plan):
    """``rand`` draws the single device's numbers (a piece, or a micro-batch, takes its rows)."""
    _exact(_swin, plan, False)


def test_exact_leaves_the_generator_where_the_plain_model_does():
    """After the compiled steps the default generator is where the plain model's steps leave it."""
    model, sample, p = _exact(_gpt2, "data", False)
    after_cube = torch.get_rng_state()
    torch.manual_seed(SEED)
    eager_reference(model, global_batches(sample, 2), optimizer("sgd"))
    assert torch.equal(torch.get_rng_state(), after_cube)


def test_exact_refuses_what_it_cannot_reproduce():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return torch.normal(self.lin(x), 0.1).sum()   # noise around values: a draw of values

    from cube.policies.data import PASData
    with pytest.raises(ValueError, match=r"(?s)exact_rng=True.*'normal'"):
        cube.plan(Noisy(), torch.randn(4, 8), PASData, 2, exact_rng=True)
    cube.plan(Noisy(), torch.randn(4, 8), PASData, 2)   # the default mode keys its draws instead


# ------------------------------------------------------------------ default mode: which pieces share masks

class _MLP(nn.Module):
    """x -> linear -> dropout -> linear -> dropout -> sum: under tensor parallel the first dropout
    reads a split tensor, the second a replicated one (after the row-parallel linear's sum)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x):
        h = F.dropout(self.fc1(x), 0.5, self.training)
        return F.dropout(self.fc2(h), 0.5, self.training).sum()


def _masks(policy, world: int, steps: int = 2):
    """Per rank: ``{(step, draw index): (box, mask)}`` each random piece drew (its output != 0)."""
    model = _MLP()
    batches = [(torch.randn(8, 16) + 3,) for _ in range(steps)]   # + 3: no output is 0 but for the mask
    seen = {}
    lock = threading.Lock()
    real = cube.runtime.rng.call

    def spy(gen, index, box, fn, *args, **kwargs):
        out = real(gen, index, box, fn, *args, **kwargs)
        with lock:
            seen.setdefault(cube.debug.rank(), {})[(gen.__dict__["_rng_steps"], index)] = (box, out != 0)
        return out

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy, use_cache=False)
        def train_iter(model, dataloader):
            loss = model(next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        for _ in range(steps):
            train_iter(gen, it)
    cube.runtime.rng.call = spy
    try:
        cube.debug.run(body, world)
    finally:
        cube.runtime.rng.call = real
    return seen


def test_default_masks_data_parallel_ranks_differ():
    from cube.policies.data import PASData
    seen = _masks(PASData, 2)
    for key, (box0, m0) in seen[0].items():
        box1, m1 = seen[1][key]
        assert box0 != box1 and box0[0] != box1[0]   # pieces along the batch
        assert not torch.equal(m0, m1), f"draw {key}: data-parallel ranks drew one mask"
    steps = sorted({s for s, _ in seen[0]})
    assert not torch.equal(seen[0][(steps[0], 0)][1], seen[0][(steps[1], 0)][1]), "two steps drew one mask"


def test_default_masks_split_pieces_differ_replicas_agree():
    from cube.policies.megatron import PASMegatronTP
    seen = _masks(PASMegatronTP, 2)
    split = replicated = 0
    for key, (box0, m0) in seen[0].items():
        box1, m1 = seen[1][key]
        if box0 == box1:   # a replicated tensor: every replica must drop the same elements
            assert torch.equal(m0, m1), f"draw {key}: replicas drew other masks"
            replicated += 1
        else:   # pieces of one tensor: independent masks
            assert m0.shape == m1.shape and not torch.equal(m0, m1), f"draw {key}: pieces repeat one mask"
            split += 1
    assert split and replicated, (split, replicated)


def test_default_mode_seed_derivation():
    seed = cube.runtime.rng.seed
    box = ((0, 4), (0, 16))
    assert seed(1, 0, 3, 0, box) == seed(1, 0, 3, 0, box)
    keys = {seed(1, 0, 3, 0, box), seed(2, 0, 3, 0, box), seed(1, 1, 3, 0, box), seed(1, 0, 4, 0, box),
            seed(1, 0, 3, 1, box), seed(1, 0, 3, 0, ((4, 8), (0, 16)))}
    assert len(keys) == 6 and all(0 <= k < 2 ** 63 for k in keys)


@pytest.mark.parametrize("policy,nmicros", [("cube.policies.megatron:PASMegatronTP", 1), ("cube.policies.pipeline:PAS1F1B", 2)],
                         ids=["tensor", "pipeline"])
def test_exact_across_processes(policy, nmicros, tmp_path):
    """gloo ranks, each with its own default generator seeded alike: the plain model's numbers too."""
    import json

    from tests.launch import ROOT, torchrun
    torchrun(ROOT / "tests" / "workers" / "dropout_worker.py", 2, [policy, nmicros, tmp_path])
    for r in range(2):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["loss"] <= 1e-5 and got["params"] <= 1e-5 and got["generator"], got


def _trained(model, sample, policy, world: int, **compile_kw):
    """Per rank: (losses, {local name: parameter}) after two SGD steps through cube."""
    batches = global_batches(sample, 2)

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy, use_cache=False, **compile_kw)
        def train_iter(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        opt = optimizer("sgd")(gen.parameters())
        losses = []
        for _ in range(2):
            losses.append(train_iter(gen, it).detach())
            opt.step()
            opt.zero_grad()
        return losses, {k: v.detach().clone() for k, v in gen.named_parameters()}
    return cube.debug.run(body, world)


def test_default_mode_recompute_redraws_the_same_masks():
    """Recompute re-runs a block's dropout in backward: it must drop what forward dropped, so the
    step equals the step without recompute, number for number."""
    from cube.policies.data import PASData
    model, sample = _gpt2(4)
    plain = _trained(model, sample, functools.partial(PASData, recompute=False), 2)
    again = _trained(model, sample, functools.partial(PASData, recompute="all"), 2)
    for (l0, p0), (l1, p1) in zip(plain, again):
        assert all(torch.equal(a, b) for a, b in zip(l0, l1))
        assert all(torch.equal(p0[k], p1[k]) for k in p0)


def test_exact_forward_outside_the_step_is_refused():
    from cube.policies.data import PASData
    model, sample = _gpt2(4)

    def body():
        @cube.compile(copy.deepcopy(model), iter([sample]), PAS=PASData, use_cache=False, exact_rng=True)
        def train_iter(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        with pytest.raises(ValueError, match="compiled step"):
            gen(*sample)
    cube.debug.run(body, 1)


class _Strided(nn.Module):
    """Dropouts of tensors that are not contiguous: the single device draws each mask in its
    input's memory order; the second one's batch is dim 1."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(8, 16)

    def forward(self, x):
        h = F.dropout(self.a(x).transpose(1, 2), 0.3, True)   # (B, 32, 8), strides of a transpose
        h = torch.ops.aten.native_dropout(h.transpose(1, 2).transpose(0, 1), 0.2, True)[0].transpose(0, 1)
        return self.b(h.transpose(1, 2)).pow(2).mean()


def test_exact_draws_in_the_memory_order_of_the_single_devices_input():
    from cube.policies.data import PASData
    from cube.policies.pipeline import PAS1F1B
    torch.manual_seed(0)
    model, x = _Strided(), torch.randn(4, 8, 16)
    assert_exact(parity(model, (x,), PASData, 2, steps=2, opt="sgd", seed=SEED, exact_rng=True))
    with pytest.raises(ValueError, match=r"(?s)'native_dropout'.*only along dim 0"):
        cube.plan(model, (x,), functools.partial(PAS1F1B, nmicros=2), 2, exact_rng=True)


@pytest.mark.parametrize("zero", [1, 3])
def test_gpt2_dropout_exact_under_zero(zero):
    model, sample = _gpt2(4)
    assert_exact(parity(model, sample, "cube.policies.data:PASData", 2, steps=2, opt="sgd", param_floor=PARAM_FLOOR,
                        seed=SEED, exact_rng=True, zero=zero,
                        build=lambda gen: cube.build_optimizer(gen, torch.optim.SGD, lr=1e-2)))
