"""What models written elsewhere do that cube's own test models did not: a key/value cache left on,
complex rotary embeddings, a loss normalized by hand, one-sample micro-batches, routing by index,
reshapes that merge the batch with heads, and shapes computed from tensor values.

Each plan is checked against the plain model (``tests.inprocess.parity``: loss and every parameter
piece after SGD steps); each refusal for the message that names the op and the fix.
"""
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.data import PASData
from cube.policies.pipeline import PAS1F1B
from tests import zoo
from tests.inprocess import assert_exact, parity
from tests.test_checkpoint_buffers import SEQ, VOCAB, RotaryLM


def _anno(op_name: str, ins, out, args=(), kwargs=None, overload: str = "default") -> str:
    """The annotation cube gives ``op_name`` for tensors of these shapes (an op made by hand)."""
    from cube.ir.operator import IRFwOperation
    from cube.ir.tensor import IRTensor, TensorKind
    from cube.trace.rules import REGISTRY

    def t(shape, dtype=torch.float32):
        return IRTensor(tuple(shape), dtype, False, TensorKind.ACTIVATION, "t")
    inputs = [t(s) if not isinstance(s, tuple) or not s or isinstance(s[0], int) else t(*s) for s in ins]
    by_shape = iter(inputs)
    args = [next(by_shape) if a == "T" else [next(by_shape) if x == "T" else x for x in a] if isinstance(a, list)
            else a for a in args]
    target = getattr(getattr(torch.ops.aten, op_name), overload)
    op = IRFwOperation(name=op_name, inputs=inputs, outputs=[t(s) for s in out], target=target, args=args,
                       kwargs=kwargs or {}, module_path="", source=None, grad_enabled=True)
    REGISTRY.annotate(op)
    assert op.anno is not None, op.anno_error
    return str(op.anno)


def test_reshape_merging_batch_and_heads_keeps_the_batch_split():
    # nn.MultiheadAttention: (L, B, E) -> (L, B * H, D): B is the outer factor of the merged dim
    anno = _anno("view", [(16, 2, 32)], [(16, 8, 8)], args=["T", [16, 8, 8]])
    ins, outs = anno.split(" -> ")
    assert ins.split()[1] == outs.split()[1].strip("(") and "^" not in anno, anno


def test_index_rules_split_with_their_indices():
    # a token's expert weights picked by index_select: the indices and the output split alike
    assert _anno("index_select", [(4, 3, 3), ((10,), torch.int64)], [(10, 3, 3)], args=["T", 0, "T"]) == \
        "a^ d g, i -> i d g"
    # each token repeated for its top-k experts: a split of the tokens is the outer factor's
    assert _anno("repeat_interleave", [(6, 8)], [(12, 8)], args=["T", 2], kwargs={"dim": 0},
                 overload="self_int") == "a d -> (a g^) d"


def test_complex_views_split_every_dim_but_the_pair():
    assert _anno("view_as_complex", [(4, 8, 2, 4, 2)], [(4, 8, 2, 4)], args=["T"]) == "a d g i j^ -> a d g i"
    assert _anno("view_as_real", [((4, 8, 2, 4), torch.complex64)], [(4, 8, 2, 4, 2)], args=["T"]) == \
        "a d g i -> a d g i j^"


def test_kv_cache_first_update_is_no_op_of_the_graph():
    """Hugging Face decoders keep use_cache on by default: the cache's first update concatenates the
    keys onto an empty tensor, an identity cube drops (no concatenation, nothing read of shape (0,))."""
    model, batch = zoo.build("llama")
    assert model.model.config.use_cache
    graph = cube.trace_model(model, batch).graph
    assert not [op for op in graph.ops if op.name == "cat" and "cache" in str(op.where())]
    assert not [t for op in graph.ops for t in op.inputs if tuple(t.shape) == (0,)]


class HandNormalized(nn.Module):
    """A causal LM whose loss is a sum over valid targets divided by their count, written out (as
    torchtitan writes it) instead of ``cross_entropy(reduction="mean")``."""

    def __init__(self, extra: bool = False):
        super().__init__()
        self.lm = zoo.build("llama")[0].model
        self.extra = extra

    def forward(self, ids, labels):
        logits = self.lm(input_ids=ids).logits
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        count = (labels != -100).sum()
        loss = total / count
        return loss + count * 0.0 if self.extra else loss


def _masked_batches(steps: int, batch: int):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, zoo.V, (batch, zoo.S), generator=gen)
        labels = ids.clone()
        labels[torch.rand(batch, zoo.S, generator=gen) < 0.4] = -100
        labels[0, :12] = -100   # the first micro-batch holds fewer valid targets than the others
        out.append((ids, labels))
    return out


@pytest.mark.parametrize("nmicros,batch", [(2, 4), (2, 2), (4, 4)], ids=["2x2", "2x1", "4x1"])
def test_loss_normalized_by_hand_is_exact_under_pipelines(nmicros, batch):
    batches = _masked_batches(2, batch)
    sample = tuple(t[:batch // nmicros] for t in batches[0])
    errors = parity(HandNormalized(), sample, functools.partial(PAS1F1B, nmicros=nmicros), 2, steps=2,
                    nmicros=nmicros, batches=batches, param_floor=zoo.PARAM_FLOOR)
    assert_exact(errors)


def test_count_used_otherwise_than_as_a_divisor_is_refused():
    model = HandNormalized(extra=True)
    batches = _masked_batches(1, 4)
    with pytest.raises(ValueError, match=r"reduced over the batch .* computed from the batch alone"):
        cube.trace_model(model, batches[0]).place(functools.partial(PAS1F1B, nmicros=2), 2)


class Routed(nn.Module):
    """Tokens split among experts by their counts (``counts.tolist()``): a data-dependent shape."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.expert = nn.Linear(8, 8)

    def forward(self, x, y):
        ids = self.router(x).argmax(-1).flatten()
        counts = torch.bincount(ids, minlength=4)
        parts = torch.split(x.flatten(0, 1)[ids.argsort()], counts.tolist())
        h = torch.cat([self.expert(p) for p in parts])
        return ((h.sum(-1) - y.flatten()) ** 2).mean()


def test_data_dependent_shape_is_a_trace_error_naming_the_model_line():
    with pytest.raises(cube.TraceError) as info:
        cube.trace_model(Routed(), (torch.randn(4, 6, 8), torch.randn(4, 6)))
    text = str(info.value)
    assert f"{os.path.basename(__file__)}:" in text and "counts.tolist()" in text, text
    assert "data-dependent shape" in text and "cube.register_op" in text, text


def _rotary_batch(batch: int = 4):
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(0))
    return ids, torch.roll(ids, -1, dims=1)


def test_complex_rotary_data_parallel_moves_no_activations(tmp_path):
    """Llama 3's rotary embedding in complex numbers (view_as_complex, a complex multiply,
    view_as_real) under PASData: the batch split goes through; only gradient sums are sent."""
    torch.manual_seed(0)
    cube.explain(RotaryLM(), _rotary_batch(), PASData, 2, tmp_path)
    text = (tmp_path / "plan.txt").read_text()
    lines = [line for line in text.splitlines() if line.startswith("sends per step:")]
    assert len(lines) == 2, text
    for line in lines:
        assert "forward 0 B, backward 0 B" in line and "gradient sums 0 B" not in line, line


@pytest.mark.parametrize("plan", ["data", "pipeline"])
def test_complex_rotary_trains_exactly(plan):
    torch.manual_seed(0)
    model = RotaryLM()
    if plan == "data":
        errors = parity(model, _rotary_batch(), PASData, 2, steps=2)
    else:
        errors = parity(model, _rotary_batch(2), functools.partial(PAS1F1B, nmicros=2), 2, steps=2, nmicros=2)
    assert_exact(errors)


class NewLike(nn.Module):
    """``x.new_zeros/ones/full/empty(shape)``: creations that read only x's dtype and device."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.lin(x)
        z = h.new_zeros(h.shape) + h.new_ones(h.shape) * 2 + h.new_full(h.shape, 0.5)
        e = h.new_empty(h.shape).fill_(1.0)
        return ((h * z + e - y) ** 2).mean()


def test_new_like_creations_read_no_data_and_train_exactly(tmp_path):
    batch = (torch.randn(4, 8), torch.randn(4, 8))
    names = [op.name for op in cube.trace_model(NewLike(), batch).graph.ops]
    assert not [n for n in names if n.startswith("new_")] and {"zeros", "ones", "full", "empty"} <= set(names)
    cube.explain(NewLike(), batch, PASData, 2, tmp_path)
    assert "forward 0 B, backward 0 B" in (tmp_path / "plan.txt").read_text()
    assert_exact(parity(NewLike(), batch, PASData, 2, steps=2))


def test_hf_deepseek_v2_complex_rotary_data_parallel_moves_no_activations(tmp_path):
    """Transformers' DeepSeek-V2 rotates queries and keys in complex numbers (view_as_complex, as
    Llama 3's reference code): under PASData only gradient sums are sent. Its layers are made dense
    (first_k_dense_replace): the rotary alone is checked here (its MoE layers under PASData:
    tests/test_moe_data_parallel.py)."""
    import transformers

    cfg = transformers.DeepseekV2Config(vocab_size=zoo.V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                        v_head_dim=8, first_k_dense_replace=2)
    torch.manual_seed(0)
    model = zoo.LM(transformers.DeepseekV2ForCausalLM(zoo.no_dropout(cfg)))
    ids = torch.randint(0, zoo.V, (4, zoo.S), generator=torch.Generator().manual_seed(0))
    names = {op.name for op in cube.trace_model(model, (ids, ids)).graph.ops}
    assert {"view_as_complex", "view_as_real"} <= names
    cube.explain(model, (ids, ids.clone()), PASData, 2, tmp_path)
    lines = [line for line in (tmp_path / "plan.txt").read_text().splitlines() if line.startswith("sends per step:")]
    assert len(lines) == 2 and all("forward 0 B, backward 0 B" in line for line in lines), lines
    assert_exact(parity(model, (ids, ids.clone()), PASData, 2, steps=2, param_floor=zoo.PARAM_FLOOR))


def test_the_loss_wrapper_ships_with_the_package():
    """``cube.CausalLM`` (the big-model recipe's wrapper) is importable from the package; the example's
    old import names the same class."""
    import transformers

    import cube
    from examples.bigmodel.model import CausalLM
    assert CausalLM is cube.CausalLM
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                                                 num_hidden_layers=1, num_attention_heads=2))
    ids = torch.randint(0, 32, (2, 8))
    assert torch.equal(cube.CausalLM(hf)(ids, ids), hf(input_ids=ids, labels=ids).loss)
    assert all(n.startswith("model.") for n, _ in cube.CausalLM(hf).named_parameters())
