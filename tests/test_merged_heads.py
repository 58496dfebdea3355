"""Batched matmuls on merged heads (``cube.trace.heads``): attention written for ``bmm`` on
``(B * H, T, D)``, with BLOOM's ``alibi.repeat(B, 1, 1)`` and ``baddbmm``, runs on ``(B, H, T, D)``
as ``matmul``s, so tensor parallel splits its heads, context parallel its queries and a pipeline
its micro-batches, exactly under ``strict=True`` (before: the split stopped at the merge)."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
import cube.policies.context
import cube.policies.pipeline
from cube.trace import build_graph, export
from tests.inprocess import assert_exact, parity

V, E, H, B, T = 40, 16, 2, 2, 8
D = E // H


class Attention(nn.Module):
    """BLOOM's eager attention: heads merged with the batch, scores by ``baddbmm`` of the alibi."""

    def __init__(self, beta: float, p: float):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(E, E) for _ in range(4))
        self.beta, self.p = beta, p

    def forward(self, h, alibi, mask):
        b, t, _ = h.shape
        q, k, v = (f(h).view(b, t, H, D).transpose(1, 2).reshape(b * H, t, D) for f in (self.q, self.k, self.v))
        scores = alibi.baddbmm(q, k.transpose(-1, -2), beta=self.beta, alpha=D ** -0.5)
        probs = F.softmax(scores.view(b, H, t, t) + mask, dim=-1).view(b * H, t, t)
        out = torch.bmm(F.dropout(probs, self.p, self.training), v)
        return self.o(out.view(b, H, t, D).permute(0, 2, 1, 3).reshape(b, t, E))


class Net(nn.Module):
    def __init__(self, beta: float = 1.0, p: float = 0.0):
        super().__init__()
        self.embed, self.head = nn.Embedding(V, E), nn.Linear(E, V)
        self.attn = nn.ModuleList(Attention(beta, p) for _ in range(2))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E)) for _ in range(2))

    def forward(self, x, y):
        b, t = x.shape
        slopes = 2.0 ** -torch.arange(1, H + 1, device=x.device, dtype=torch.float32)
        alibi = (slopes[:, None, None] * torch.arange(t, device=x.device)[None, None, :]).repeat(b, 1, 1)
        pos = torch.arange(t, device=x.device)
        mask = torch.where(pos[None, :] > pos[:, None], torch.finfo(torch.float32).min, 0.0)
        h = self.embed(x)
        for attn, mlp in zip(self.attn, self.mlp):
            h = h + attn(h, alibi, mask)
            h = h + mlp(h)
        return F.cross_entropy(self.head(h).permute(0, 2, 1), y)


def _batch(b: int = B):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, V, (b, T), generator=gen), torch.randint(0, V, (b, T), generator=gen)


def _ops(model):
    graph, _ = build_graph(export(model, _batch()), model, "tuple")
    return graph.ops[1:]


def test_the_chain_runs_as_matmuls_on_unmerged_heads():
    torch.manual_seed(0)
    ops = _ops(Net())
    names = [op.name for op in ops]
    assert "bmm" not in names and "baddbmm" not in names and "repeat" not in names, names
    matmuls = [op for op in ops if op.name == "matmul"]
    assert len(matmuls) == 4 and all(op.outputs[0].ndim == 4 for op in matmuls), \
        [(op.name, [t.shape for t in op.inputs]) for op in matmuls]
    # nothing of the merged (B * H) dim is left
    assert not any(t.ndim and t.shape[0] == B * H for op in ops for t in op.outputs), \
        [(op.name, op.outputs[0].shape) for op in ops if op.outputs[0].ndim and op.outputs[0].shape[0] == B * H]


@pytest.mark.parametrize("policy,world,nmicros", [
    ("cube.policies.megatron:PASMegatronTP", 2, 1),
    (functools.partial(cube.policies.context.PASContext, cp=2), 2, 1),
    (functools.partial(cube.policies.pipeline.PAS1F1B, nmicros=2), 2, 2),
])
def test_a_dropout_that_draws_runs_on_unmerged_heads_and_draws_the_single_devices_mask(policy, world, nmicros):
    """The probabilities' dropout (on, as XGLM ships it) joins the chain: its mask, drawn on the
    contiguous ``(B, H, T, T)`` tensor, is the ``(B * H, T, T)`` one element for element, so under
    ``exact_rng`` tensor, context and pipeline plans train as the single device does."""
    torch.manual_seed(0)
    model = Net(p=0.1)
    names = [op.name for op in _ops(model)]
    assert "bmm" not in names and "baddbmm" not in names, names
    sample = _batch(B // nmicros)
    assert_exact(parity(model, sample, policy, world, steps=2, nmicros=nmicros, opt="sgd", strict=True, seed=3,
                        exact_rng=True))


@pytest.mark.parametrize("beta", [1.0, 0.5, 0.0])
def test_baddbmm_scaled_as_torch_scales_it(beta):
    torch.manual_seed(0)
    assert_exact(parity(Net(beta), _batch(), "cube.policies.single:PASSingle", 1, steps=2, opt="sgd",
                        strict=True))


def test_tensor_parallel_splits_the_heads():
    from cube.policies.megatron import PASMegatronTP
    torch.manual_seed(0)
    model = Net()
    plan = cube.plan(model, _batch(), PASMegatronTP, 2)
    assert plan.lost == [], [r.describe() for r in plan.lost]
    assert_exact(parity(model, _batch(), PASMegatronTP, 2, steps=2, opt="sgd", strict=True))


def test_context_parallel_splits_the_queries():
    from cube.policies.context import PASContext
    torch.manual_seed(0)
    policy = functools.partial(PASContext, cp=2)
    assert_exact(parity(Net(), _batch(), policy, 2, steps=2, opt="sgd", strict=True))


def test_pipeline_cuts_the_batch_through_the_alibi():
    from cube.policies.pipeline import PAS1F1B
    torch.manual_seed(0)
    policy = functools.partial(PAS1F1B, nmicros=2)
    assert_exact(parity(Net(), _batch(1), policy, 2, steps=2, nmicros=2, opt="sgd", strict=True))


def test_deberta_relative_attention_splits_its_heads():
    """DeBERTa-v2's disentangled attention (``relative_attention``, c2p and p2c terms, as DeBERTa-v3
    checkpoints configure it): the relative position projections repeated once per sample and the
    positions gathered by an expanded index run on ``(B, H, ...)`` too."""
    from cube.policies.megatron import PASMegatronTP
    from tests import zoo
    torch.manual_seed(0)
    model = zoo._hf("DebertaV2Config", "DebertaV2ForMaskedLM", vocab_size=zoo.V, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64, relative_attention=True,
                    pos_att_type=["c2p", "p2c"], position_buckets=8)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, zoo.V, (2, zoo.S), generator=gen)
    names = [op.name for op in build_graph(export(model, (ids, ids.clone())), model, "tuple")[0].ops[1:]]
    assert "bmm" not in names and "repeat" not in names and names.count("gather") == 4, names
    assert_exact(parity(model, (ids, ids.clone()), PASMegatronTP, 2, steps=2, opt="sgd", param_floor=zoo.PARAM_FLOOR,
                        strict=True))
