"""Tensor parallel on fused projections (``cube.trace.fused``), as Megatron-LM splits fused QKV.

Hugging Face GPT-2's ``c_attn`` (a ``Conv1D``: ``addmm`` of a ``(E, 3E)`` weight, then ``split``)
and Phi-3's ``qkv_proj`` (sliced into q, k, v of grouped-query widths) and ``gate_up_proj``
(``chunk``) are cut at trace time into one projection per block, each reading a sub-parameter (a
box of the user's weight). Under ``PASMegatronTP`` every rank then holds at most ``1/tp`` of each
block linear's weight (a key/value projection with fewer heads than ``tp`` is split too, its
output gathered). Plans train exactly like the single-device model (tensor parallel, 3D with a
pipeline, data parallel, one device, ZeRO); checkpoints merge into the user's names and shapes;
``load_model(weights=, init=)`` gives every rank its pieces of the user's tensors.
"""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn as nn

import cube
import cube.debug
from cube.ir import IRFwOperation
from cube.runtime import piece
from cube.policies.megatron import PASMegatronTP
from tests.inprocess import assert_exact, parity
from tests.models import HFCausalLM
from tests.parity import rel


# -------------------------------------------------------------------------------------------- models
def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    return HFCausalLM(GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                                 resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)))


def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    return HFCausalLM(Phi3ForCausalLM(Phi3Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)))


def neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    torch.manual_seed(0)
    return HFCausalLM(GPTNeoXForCausalLM(GPTNeoXConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64)))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return HFCausalLM(LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)))


MODELS = {"gpt2": gpt2, "phi3": phi3, "neox": neox, "llama": llama}


def sample():
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    return ids, ids.clone()


# ------------------------------------------------------------------------------------------ the trace
def _ops(graph, name, path):
    return [op for op in graph.ops if isinstance(op, IRFwOperation) and op.name == name and op.module_path == path]


def test_gpt2_c_attn_is_three_projections_over_boxes_of_its_weight():
    graph = cube.trace_model(gpt2(), sample()).graph
    # Conv1D's addmm of (batch * sequence) rows runs as linear(x, weight.t(), bias) on (batch, sequence)
    # (cube.trace.rows), each block with its own transpose of its box of the weight
    ops = _ops(graph, "linear", "model.transformer.h.0.attn.c_attn")
    assert len(ops) == 3
    makers = {id(t): op for op in graph.ops for t in op.outputs}
    for k, op in enumerate(ops):
        x, wt, bias = op.inputs
        assert x.ndim == 3 and makers[id(wt)].name == "t"
        (weight,) = makers[id(wt)].inputs
        assert weight.names == ("model.transformer.h.0.attn.c_attn.weight",) and weight.shape == (32, 32)
        assert weight.region == ((0, 32), (32 * k, 32 * k + 32)) and weight.full == (32, 96)
        assert bias.names == ("model.transformer.h.0.attn.c_attn.bias",) and bias.region == ((32 * k, 32 * k + 32),)
        assert weight.user_box(((0, 32), (8, 16))) == ((0, 32), (32 * k + 8, 32 * k + 16))
    assert [op.outputs[0].hint for op in ops] == ["query_states", "key_states", "value_states"]
    assert not [op for op in graph.ops if op.name == "split" and "h.0" in op.module_path]
    # the sub-parameters stand where the weight and bias stood, in the model's order
    names = [t.names[0] for t in graph.attrs]
    at = names.index("model.transformer.h.0.attn.c_attn.weight")
    assert names[at - 1] == "model.transformer.h.0.ln_1.bias"
    assert names[at:at + 7] == ["model.transformer.h.0.attn.c_attn.weight"] * 3 + \
        ["model.transformer.h.0.attn.c_attn.bias"] * 3 + ["model.transformer.h.0.attn.c_proj.weight"]


def test_phi3_slices_and_chunk_are_cut_and_neox_interleaved_heads_are_not():
    graph = cube.trace_model(phi3(), sample()).graph
    qkv = _ops(graph, "linear", "model.model.layers.0.self_attn.qkv_proj")
    assert [op.inputs[1].region for op in qkv] == [((0, 32), (0, 32)), ((32, 48), (0, 32)), ((48, 64), (0, 32))]
    gate_up = _ops(graph, "linear", "model.model.layers.0.mlp.gate_up_proj")
    assert [op.inputs[1].region for op in gate_up] == [((0, 64), (0, 32)), ((64, 128), (0, 32))]
    assert [op.outputs[0].hint for op in gate_up] == ["gate", "up_states"]
    graph = cube.trace_model(neox(), sample()).graph
    (op,) = _ops(graph, "linear", "model.gpt_neox.layers.0.attention.query_key_value")
    assert op.inputs[1].region is None and op.inputs[1].shape == (96, 32)


class _Fused(nn.Module):
    """A fused projection (48 or 64 features) cut in the ways the pass takes or leaves (``how``)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.qkv = nn.Linear(16, 64 if how in ("narrow", "select") else 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x, y):
        b, t, _ = x.shape
        h = self.qkv(x)
        if self.how == "unbind":   # a view into (3, heads, dim), unbound: three blocks of 16 features
            q, k, v = (z.reshape(b, t, 16) for z in h.view(b, t, 3, 2, 8).unbind(2))
        elif self.how == "narrow":   # blocks of 16, 24 and 24 features
            q, k, v = h.narrow(-1, 0, 16), h.narrow(2, 16, 24), h[:, :, 40:]
        elif self.how == "select":   # a view into (4, 16), each row selected: four blocks of 16
            z = h.view(b, t, 4, 16)
            q, k, v = z.select(2, 0), z.select(-2, 1), z.select(2, 2) + z.select(2, 3)
        elif self.how == "unread":   # a block nobody reads: not cut (its gradient must stay zero)
            q, k, _ = h.split(16, -1)
            v = k
        elif self.how == "overlap":   # two slices reading the same features: not cut
            q, k, v = h[..., :16], h[..., 8:24], h[..., 32:]
        else:   # the whole output read besides the blocks: not cut
            q, k, v = h[..., :16], h[..., 16:32], h[..., 32:] + h.mean()
        a = torch.softmax(q[..., :16] @ k[..., :16].transpose(1, 2), -1) @ v[..., :16]
        return ((self.out(a) - y) ** 2).mean()


@pytest.mark.parametrize("how,blocks", [
    ("unbind", [(0, 16), (16, 32), (32, 48)]), ("narrow", [(0, 16), (16, 40), (40, 64)]),
    ("select", [(0, 16), (16, 32), (32, 48), (48, 64)]), ("unread", None), ("overlap", None), ("read_whole", None)])
def test_blocks_the_pass_takes_or_leaves(how, blocks):
    x, y = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    graph = cube.trace_model(_Fused(how), (x, y)).graph
    regions = [op.inputs[1].region for op in _ops(graph, "linear", "qkv")]
    if blocks is None:
        assert regions == [None]
        return
    assert [r[0] for r in regions] == blocks
    torch.manual_seed(0)
    model = _Fused(how)
    assert_exact(parity(model, (x, y), "cube.policies.single:PASSingle", 1, steps=2))
    assert_exact(parity(model, (x, y), PASMegatronTP, 2, steps=2))


# ------------------------------------------------------------------------------------------- shares
def block_shares(model, tp: int) -> dict:
    """Rank 0's share of each block-0 linear weight under PASMegatronTP: its boxes (as boxes of the
    user's tensor: a sub-parameter's box composed with its piece's) summed per state-dict name."""
    plan = cube.plan(model, sample(), PASMegatronTP, tp, ranks=[0])
    full = dict(model.named_parameters())
    held: dict = {}
    for t, box in plan.program[0].plan.attrs:
        held.setdefault(t.names[0], []).append(t.user_box(box))
    out = {}
    for name, boxes in held.items():
        if ".0." not in name or name not in full or full[name].ndim != 2:
            continue
        shape = full[name].shape
        assert all(0 <= s < e <= n for b in boxes for (s, e), n in zip(b, shape)), (name, boxes)
        assert len(set(boxes)) == len(boxes), (name, boxes)   # a piece per block, each once
        out[name.split(".0.")[1]] = sum(math.prod(e - s for s, e in b) for b in boxes) / full[name].numel()
    return out


def test_every_block_linear_is_split_tp_ways(capsys):
    rows = []
    for name, make in MODELS.items():
        model = make()
        for tp in (2, 4):
            shares = block_shares(model, tp)
            assert len(shares) == {"gpt2": 4, "phi3": 4, "neox": 4, "llama": 7}[name], shares
            rows.append((name, tp, shares))
            assert all(s <= 1 / tp for s in shares.values()), (name, tp, shares)
    with capsys.disabled():
        print("\nrank 0's share of each block-0 linear weight under PASMegatronTP")
        for name, tp, shares in rows:
            print(f"  {name:6} tp={tp}  " + "  ".join(f"{k}={v:.3f}" for k, v in shares.items()))


def test_every_rank_holds_disjoint_pieces_covering_the_fused_weight():
    plan = cube.plan(gpt2(), sample(), PASMegatronTP, 2)
    boxes = [(r, t.user_box(b)) for r in (0, 1) for t, b in plan.program[r].plan.attrs
             if t.names[0] == "model.transformer.h.0.attn.c_attn.weight"]
    # rank r: columns [16 r, 16 r + 16) of each of q, k and v (its two heads of each)
    assert sorted(boxes) == sorted((r, ((0, 32), (32 * k + 16 * r, 32 * k + 16 * r + 16)))
                                   for r in (0, 1) for k in range(3))


# ------------------------------------------------------------------------------------------- parity
PLANS = {   # id: (model, policy, world, optimizer)
    "gpt2_tp2": ("gpt2", PASMegatronTP, 2, "sgd"),
    "gpt2_tp4": ("gpt2", PASMegatronTP, 4, "sgd"),
    "phi3_tp2": ("phi3", PASMegatronTP, 2, "sgd"),
    "phi3_tp2_adamw": ("phi3", PASMegatronTP, 2, "adamw"),
    "phi3_tp4": ("phi3", PASMegatronTP, 4, "sgd"),   # k and v: 2 heads over 4 ranks, gathered
    "gpt2_tp2_pp2": ("gpt2", "megatron3d", 4, "sgd"),
    "phi3_tp2_pp2": ("phi3", "megatron3d", 4, "sgd"),
    "gpt2_data": ("gpt2", "cube.policies.data:PASData", 2, "sgd"),
    "gpt2_single": ("gpt2", "cube.policies.single:PASSingle", 1, "sgd"),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_plans_train_like_the_single_device_model(plan):
    name, policy, world, opt = PLANS[plan]
    nmicros = 1
    if policy == "megatron3d":
        from cube.policies.megatron3d import PASMegatron
        policy, nmicros = functools.partial(PASMegatron, tp=2, pp=2, nmicros=2), 2
    assert_exact(parity(MODELS[name](), sample(), policy, world, steps=2, nmicros=nmicros, opt=opt,
                        param_floor=1e-3))


def test_gpt2_adamw_with_sub_parameter_biases():
    """AdamW on GPT-2 tp2, its zero-initialized biases made nonzero: a bias entry whose gradient is
    near AdamW's eps turns round-off into an update of size lr (``tests/inprocess.py``), as in the
    MLP's ``c_fc.bias`` before this change; the sub-parameter biases of ``c_attn`` train exactly."""
    model = gpt2()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(2))
    assert_exact(parity(model, sample(), PASMegatronTP, 2, steps=2, opt="adamw", param_floor=1e-3))


def test_gpt2_zero3_data_parallel():
    def build(gen):
        return cube.build_optimizer(gen, torch.optim.SGD, lr=1e-2)
    assert_exact(parity(gpt2(), sample(), "cube.policies.data:PASData", 2, steps=2, opt="sgd", build=build,
                        zero=3, param_floor=1e-3))


# --------------------------------------------------------------------------------------- checkpoints
def test_checkpoint_merges_into_the_users_names_and_shapes(tmp_path):
    """GPT-2 tp2, two SGD steps with momentum, save: the merged state dict has the user's names and
    shapes (``c_attn.weight`` (32, 96)) and, with the optimizer's state, equals the single-device
    model after the same steps (its parameters in the model's order, also without a saved layout);
    the checkpoint loads back into a fresh module on every rank."""
    from cube.runtime.checkpoint import _Checkpoint
    from tests.parity import global_batches
    model = gpt2()
    batches = global_batches(sample(), 2)
    ref = gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    for b in batches:
        ref(*b).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ckpt, cache = tmp_path / "ckpt", tmp_path / "cache"

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=PASMegatronTP, cache_dir=cache)
        def train_iter(m, dataloader):
            loss = m(*next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        opt = torch.optim.SGD(gen.parameters(), lr=1e-2, momentum=0.9)
        for _ in batches:
            train_iter(gen, it)
            opt.step()
            opt.zero_grad()
        cube.save_checkpoint(ckpt, gen, opt)
        fresh = cube.load_model()
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1e-2, momentum=0.9)
        cube.load_checkpoint(ckpt, fresh, fresh_opt)
        held = dict(gen.named_parameters())
        return [(local, torch.equal(p, held[local]) and
                 torch.equal(fresh_opt.state[p]["momentum_buffer"], opt.state[held[local]]["momentum_buffer"]))
                for local, p in fresh.named_parameters()]
    loaded = cube.debug.run(body, 2)
    assert all(same for rank in loaded for _, same in rank)
    assert sum(local.endswith("c_attn_weight_query_states") for local, _ in loaded[0]) == 2   # one per layer
    state, opt_state = cube.merge_checkpoint(ckpt)
    assert list(state) == list(ref.state_dict())
    assert state["model.transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
    assert state["model.transformer.h.0.attn.c_attn.bias"].shape == (96,)
    for name, p in ref.state_dict().items():
        assert p.shape == state[name].shape and rel(state[name], p) <= 1e-5, name
    ref_state = ref_opt.state_dict()["state"]
    assert sorted(opt_state["state"]) == sorted(ref_state)
    for i, st in ref_state.items():
        assert rel(opt_state["state"][i]["momentum_buffer"], st["momentum_buffer"]) <= 1e-5, i
    # without the saved layout the parameters are ordered as the ranks' tables list them: one name each
    names = [n for n, _ in ref.named_parameters()]
    assert _Checkpoint(ckpt).param_order() == names
    fresh = gpt2()
    fresh.load_state_dict(state)


def _init(module):
    for p in module.parameters(recurse=False):
        torch.nn.init.normal_(p, std=0.02)


@pytest.mark.parametrize("fmt", ["torch", "safetensors", "init"])
def test_load_model_gives_every_rank_its_pieces(fmt, tmp_path):
    """GPT-2 under tp2, compiled from a model whose parameters are all 0.01: ``load_model(weights=)`` of
    the plain model's state dict (torch.save'd, or safetensors, names without the wrapper's ``model.``),
    or ``load_model(init=fn)`` against ``to_empty`` + ``apply(fn)`` from the same seed (``fn``: a normal
    init of a module's own parameters; Hugging Face's ``_init_weights`` of a GPT-2 attention also
    writes its child ``c_proj``'s weight, which cube's one-module-at-a-time init refuses): each
    rank's pieces (three per fused weight) equal the plain model's. (A meta-built GPT-2 with its
    cache on, as shipped, is refused before any weight is read: its forward makes the cache's
    empty tensors as constants on the meta device.)"""
    plain = gpt2()
    state = {k: v.clone().contiguous() for k, v in plain.model.state_dict().items()}
    path = tmp_path / ("state.safetensors" if fmt == "safetensors" else "state.pt")
    if fmt == "safetensors":
        import safetensors.torch
        safetensors.torch.save_file(state, str(path))
    else:
        torch.save(state, path)
    if fmt == "init":
        ref = gpt2()
        ref.to_empty(device="cpu")
        torch.manual_seed(5)
        ref.apply(_init)
        want = dict(ref.named_parameters())
    else:
        want = dict(plain.named_parameters())

    def body():
        model = gpt2()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.01)

        @cube.compile(model, iter([sample()]), PAS=PASMegatronTP, cache_dir=tmp_path / "cache")
        def train_iter(m, dataloader):
            loss = m(*next(dataloader))
            loss.backward()
            return loss
        torch.manual_seed(5)
        weights = None if fmt == "init" else str(path)
        gen = cube.load_model(init=_init, weights=weights, rename=lambda k: "model." + k)
        out = []
        for local, p in gen.named_parameters():
            names, splits = gen.PARAMS[local]
            out.append((local, splits, torch.equal(p, piece(want[names[0]], splits))))
        return out
    got = cube.debug.run(body, 2)
    assert all(ok for rank in got for _, _, ok in rank), [x for rank in got for x in rank if not x[2]]
    pieces = [(s) for local, s, _ in got[1] if "h_0_attn_c_attn_weight" in local]
    assert pieces == [[(1, 16, 32)], [(1, 48, 64)], [(1, 80, 96)]]


# ------------------------------------------------------------------------------------- generated code
def test_generated_code_reads_as_three_projections_over_c_attn():
    source = cube.plan(gpt2(), sample(), PASMegatronTP, 2, ranks=[0]).source(0)
    for k, block in enumerate(("query_states", "key_states", "value_states")):
        local = f"model_transformer_h_0_attn_c_attn_weight_{block}"
        assert f"'{local}': (['model.transformer.h.0.attn.c_attn.weight'], [(1, {32 * k}, {32 * k + 16})])," \
            in source
        assert f"aten.t.default(self.{local})" in source   # Conv1D's (in, out) box, transposed for linear
        assert f"{block} = aten.linear.default(" in source
        assert f"self.model_transformer_h_0_attn_c_attn_bias_{block})" in source
    assert "'model.transformer.h.0.attn.c_attn.weight': (32, 96)," in source   # FULL_SHAPES: the user's
