"""``flex_attention`` (``cube.trace.flex``): one op with the batch and head splits of attention, its
block mask built in forward folded into constants, trained exactly under data, tensor and pipeline
plans against the plain model (on the CPU through torch's dense implementation, which cube and the
reference both run with torch's device check off)."""
import copy

import pytest
import torch
import torch.nn as nn

pytest.importorskip("torch.nn.attention.flex_attention")
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402

import cube  # noqa: E402
from cube.trace import flex  # noqa: E402
from tests.inprocess import assert_exact, parity  # noqa: E402
from tests.tiers import tiered  # noqa: E402

V, D, H, S = 64, 32, 4, 16


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def by_sample(score, b, h, q_idx, kv_idx):   # reads the batch index: the batch may not split
    return score + b * 0.1


class Block(nn.Module):
    def __init__(self, score_mod, d=D):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.score_mod = score_mod
        self.d = d

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm(x)
        q, k, v = (p(h).view(b, s, H, d // H).transpose(1, 2) for p in (self.q, self.k, self.v))
        mask = create_block_mask(causal, None, None, s, s, device=x.device)
        a = flex_attention(q, k, v, score_mod=self.score_mod, block_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.relu(self.up(x)))


class LM(nn.Module):
    def __init__(self, score_mod=softcap, layers=2, d=D):
        super().__init__()
        self.embed = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(Block(score_mod, d) for _ in range(layers))
        self.head = nn.Linear(d, V)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _batch(n=4):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (n, S), generator=gen)
    return ids, ids.roll(-1, 1)


def test_traced_as_one_op_with_batch_and_head_splits_and_a_constant_mask():
    torch.manual_seed(0)
    ops = [op for op in cube.trace_model(LM(), _batch()).graph.ops if op.name == "flex_attention"]
    assert len(ops) == 2 and all(op.anno is not None for op in ops), [getattr(o, "anno_error", None) for o in ops]
    text = str(ops[0].anno)
    assert text.startswith("b h l~ e^, b h l~ e^, b h l~ f"), text   # the sequence: tests/test_flex_cp.py


# a pipeline of two-sample micro-batches in the slow tier: the one-sample case runs the same schedule,
# and the document-mask test below a pipeline of two-sample micro-batches
@pytest.mark.parametrize("policy,world,micro,nmicros", tiered([
    ("cube.policies.data:PASData", 2, 4, 1),
    ("cube.policies.megatron:PASMegatronTP", 2, 4, 1),
    ("cube.policies.pipeline:PAS1F1B", 2, 2, 2),
    ("cube.policies.pipeline:PAS1F1B", 2, 1, 2),
], ["data", "tensor", "pipeline", "pipeline-one-sample"], slow={"pipeline"}))
def test_trains_exactly_under_every_plan_kind(policy, world, micro, nmicros):
    torch.manual_seed(0)
    with flex.device_check_off():   # the reference's backward on the CPU (cube's op turns it off itself)
        errors = parity(LM(), _batch(micro), policy, world, steps=2, nmicros=nmicros, opt="sgd",
                        options={"nmicros": nmicros} if nmicros > 1 else None)
    assert_exact(errors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flex_attention's fused kernels)")
def test_on_a_gpu_the_compiled_kernels_train_as_the_plain_model(monkeypatch):
    monkeypatch.setenv("SINGLE_DEV_MODE", "1")
    torch.manual_seed(0)
    model = LM(d=4 * 16)   # heads of 16 dims: inductor's flex_attention kernels take no fewer
    ids, labels = (t.cuda() for t in _batch())
    ref = copy.deepcopy(model).cuda()
    attend = torch.compile(flex_attention)
    import tests.test_flex_attention as me
    monkeypatch.setattr(me, "flex_attention", attend)   # the plain model as users run it: compiled flex
    ref_loss = ref(ids, labels)
    ref_loss.backward()
    monkeypatch.undo()
    monkeypatch.setenv("SINGLE_DEV_MODE", "1")
    batches = iter(lambda: (ids, labels), None)

    @cube.compile(model.cuda(), batches, PAS="cube.policies.single:PASSingle", use_cache=False)
    def step(model, data):
        loss = model(*next(data))
        loss.backward()
        return loss
    gen = cube.load_model()
    loss = step(gen, batches)
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    worst = max((p.grad - cube.runtime.piece(ref.get_parameter(gen.PARAMS[n][0][0]).grad, gen.PARAMS[n][1])).norm()
                / max(p.grad.norm(), 1e-6) for n, p in gen.named_parameters())
    assert worst <= 1e-3, worst


def test_a_score_function_reading_the_batch_index_keeps_the_batch_whole_and_stays_exact():
    torch.manual_seed(0)
    ops = [op for op in cube.trace_model(LM(by_sample, layers=1), _batch()).graph.ops if op.name == "flex_attention"]
    assert str(ops[0].anno).startswith("b^ h l~ e^"), ops[0].anno
    with flex.device_check_off():
        errors = parity(LM(by_sample, layers=1), _batch(), "cube.policies.megatron:PASMegatronTP", 2, steps=2, opt="sgd")
    assert_exact(errors)


class Documents(LM):
    """Packed documents, as torchtitan trains: a causal mask within each document, the documents found from
    the batch (a token 0 starts one) in forward; the mask function picks its sample's row of them."""

    def forward(self, ids, labels):
        b, s = ids.shape
        doc = (ids == 0).cumsum(1)

        def same_document(b_, h, q_idx, kv_idx):
            return (doc[b_, q_idx] == doc[b_, kv_idx]) & (q_idx >= kv_idx)
        mask = create_block_mask(same_document, b, None, s, s, device=ids.device)
        x = self.embed(ids)
        for blk in self.blocks:
            h_ = blk.norm(x)
            q, k, v = (p(h_).view(b, s, H, D // H).transpose(1, 2) for p in (blk.q, blk.k, blk.v))
            x = x + blk.o(flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(b, s, D))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _documents(n=4):
    ids, labels = _batch(n)
    ids = ids.clone()
    ids[:, ::5] = 0   # a document every 5 tokens, at other offsets in other samples below
    ids[1::2, 2] = 0
    return ids, labels


@pytest.mark.parametrize("policy,world,micro,nmicros", [
    ("cube.policies.data:PASData", 2, 4, 1),
    ("cube.policies.megatron:PASMegatronTP", 2, 4, 1),
    ("cube.policies.pipeline:PAS1F1B", 2, 2, 2),
], ids=["data", "tensor", "pipeline"])
def test_a_document_mask_built_from_the_batch_is_made_per_piece_and_exact(policy, world, micro, nmicros):
    torch.manual_seed(0)
    ops = [op.name for op in cube.trace_model(Documents(layers=1), _documents()).graph.ops]
    assert ops.count("block_mask") == 1 and ops.count("flex_attention") == 1, ops
    with flex.device_check_off():
        errors = parity(Documents(), _documents(micro), policy, world, steps=2, nmicros=nmicros, opt="sgd",
                        options={"nmicros": nmicros} if nmicros > 1 else None)
    assert_exact(errors)


def test_a_block_mask_read_from_the_batch_otherwise_is_refused_with_the_reason():
    from torch.nn.attention.flex_attention import BlockMask

    class KvBlocksFromBatch(LM):
        def forward(self, ids, labels):
            b, s = ids.shape
            kv_num = torch.ones(b, 1, 1, dtype=torch.int32) + (ids[:, :1, None] * 0).int()
            kv_idx = torch.zeros(b, 1, 1, 1, dtype=torch.int32)
            mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=128, mask_mod=causal, seq_lengths=(s, s))
            x = self.embed(ids)
            blk = self.blocks[0]
            q, k, v = (p(x).view(b, s, H, D // H).transpose(1, 2) for p in (blk.q, blk.k, blk.v))
            a = flex_attention(q, k, v, block_mask=mask)
            return nn.functional.cross_entropy(self.head(a.transpose(1, 2).reshape(b, s, D)).flatten(0, 1),
                                               labels.flatten())
    with pytest.raises(ValueError, match="reads inputs of the model .* other than through"):
        cube.trace_model(KvBlocksFromBatch(layers=1), _batch())
