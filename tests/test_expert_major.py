"""Expert-major rows (``cube.trace.major``): an MoE layer that runs every token through every expert,
the copies laid out expert by expert (Llama 4's: ``hidden.repeat(E, 1)``, the scores transposed to
``(E, N)``, ``bmm`` per expert, ``reshape(E, -1, H).sum(0)``), runs on ``(E, B, S, ...)``, so the
sequence split of context and sequence parallel goes through it instead of gathering the sequence.
Tensor parallel splits such a layer by experts (``cube.ir.megatron._column``). Checked on such a layer
written here and on Hugging Face's Llama 4 as shipped, trained exactly against the plain model under
``strict=True``."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.errors import CubeInternalError
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.policies.context import PASContext
from cube.policies.megatron import PASMegatronTP
from cube.policies.megatron3d import PASMegatron
from cube.policies.pipeline import PAS1F1B
from cube.policies.single import PASSingle
from cube.trace import rows
from cube.trace.rules import REGISTRY
from tests import zoo
from tests.inprocess import assert_exact, parity

B, S, H, E, I = 2, 8, 16, 4, 8


class ExpertMajor(nn.Module):
    """A Llama 4-like MoE block: a sigmoid top-1 router, every token copied for every expert
    (expert-major), the experts as one batched weight, a shared expert."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.router = nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * I) / 4)
        self.down = nn.Parameter(torch.randn(E, I, H) / 4)
        self.shared = nn.Linear(H, H)

    def forward(self, x, y):
        flat = self.norm(x).reshape(-1, H)
        logits = self.router(flat)
        top, idx = torch.topk(logits, 1, dim=1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, idx, top).transpose(0, 1)
        scores = torch.sigmoid(scores.float()).to(flat.dtype)
        routed = flat.repeat(scores.shape[0], 1) * scores.reshape(-1, 1)
        gate, up = torch.bmm(routed.view(E, -1, H), self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down).view(-1, H)
        out = self.shared(flat) + out.reshape(E, -1, H).sum(dim=0)
        return F.mse_loss(x + out.view(x.shape), y)


def _batch(b: int = B):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(b, S, H, generator=gen), torch.randn(b, S, H, generator=gen)


def _graph_ops(model, sample):
    names = []

    def policy(graph, resource):
        names.extend((op.name, tuple(op.outputs[0].shape)) for op in graph.select(ntype=IRFwOperation) if op.outputs)
        return PASSingle(graph, resource)
    cube.plan(model, sample, policy, 1)
    return names


def test_the_copies_run_on_experts_batch_and_sequence():
    """No merge of (B, S) into rows is left: the experts' matmuls make (E, B, S, 2I)."""
    torch.manual_seed(0)
    ops = _graph_ops(ExpertMajor(), _batch())
    assert ("matmul", (E, B, S, 2 * I)) in ops and ("sum", (B, S, H)) in ops, ops
    assert not any(name in ("bmm", "repeat") for name, _ in ops), ops


def test_a_batch_of_one_keeps_its_restoring_view_apart_from_the_copies():
    """With B = 1, ``(1, N, H)`` is both the view restoring (B, S, H) and the copies of one expert:
    the view of the merged rows is the copies, the view of the layer's result the restore."""
    torch.manual_seed(0)
    ops = _graph_ops(ExpertMajor(), _batch(1))
    assert ("matmul", (E, 1, S, 2 * I)) in ops and ("sum", (1, S, H)) in ops, ops


@pytest.mark.parametrize("policy,world", [
    (functools.partial(PASContext, cp=2), 2),
    (functools.partial(PASContext, cp=2, tp=2), 4),
], ids=["cp", "cp_tp"])
def test_context_parallel_runs_the_experts_on_each_ranks_tokens(policy, world):
    """Each rank's experts multiply its half of the sequence (before: the sequence split was lost at
    the copies, and strict=True refused the plan)."""
    torch.manual_seed(0)
    model, sample = ExpertMajor(), _batch()
    plan = cube.plan(model, sample, policy, world, strict=True).program.plans[0]
    copies = [c for c in plan.calls if c.op is not None and c.op.name == "matmul"]
    assert len(copies) == 2 and all(b[2] == (0, S // 2) for c in copies for b in c.layout.outputs), \
        [c.layout.outputs for c in copies]
    assert_exact(parity(model, sample, policy, world, steps=2, opt="sgd", strict=True))


def test_sequence_parallel_keeps_its_split_and_trains_exactly():
    """Megatron's sequence parallel: the norm on each rank's half of the sequence, the layer between
    an all-gather and a reduce-scatter, no split lost (strict=True)."""
    torch.manual_seed(0)
    policy = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True)
    assert_exact(parity(ExpertMajor(), _batch(), policy, 2, steps=2, opt="sgd", strict=True))


def test_tensor_parallel_splits_the_experts_between_its_ranks():
    """Every token goes through every expert, so tensor parallel splits the experts as Megatron's pair
    splits an MLP: each rank its experts' weights whole, the sum over the experts its partial sums
    (before, every rank held and ran every expert)."""
    torch.manual_seed(0)
    model, sample = ExpertMajor(), _batch()
    plan = cube.plan(model, sample, PASMegatronTP, 2, strict=True).program.plans[0]
    held = {t.names[0]: t.user_box(b) for t, b in plan.attrs}
    assert held["gate_up"][0] == (0, E // 2) and held["down"][0] == (0, E // 2), held
    assert_exact(parity(model, sample, PASMegatronTP, 2, steps=2, opt="sgd", strict=True))


def test_one_sample_micro_batches_train_exactly():
    torch.manual_seed(0)
    policy = functools.partial(PAS1F1B, nmicros=2)
    assert_exact(parity(ExpertMajor(), _batch(1), policy, 2, steps=2, nmicros=2, opt="sgd", strict=True))


@pytest.mark.parametrize("plan", ["cp", "sp"])
def test_hugging_face_llama4_keeps_the_sequence_split(plan):
    if not zoo.installed("llama4"):
        pytest.skip(f"{zoo.PACKAGES['llama4']} is not installed here")
    outcome = zoo.run("llama4", plan)
    assert outcome.kind == "exact", outcome


def test_a_rewrite_declaring_a_shape_its_op_does_not_make_is_an_internal_error():
    """Every op the trace passes make is run on meta tensors: a broadcast the rewrite did not mean
    (a weight given one dim of 1 too many) fails at trace time, not with a wrong shape later."""
    x = IRTensor((E, B, S, H), torch.float32, True, TensorKind.ACTIVATION, "x")
    w = IRTensor((E, 1, 1, H, I), torch.float32, True, TensorKind.ACTIVATION, "w")
    out = IRTensor((E, B, S, I), torch.float32, True, TensorKind.ACTIVATION, "out")
    like = IRFwOperation(name="bmm", inputs=[x, w], outputs=[out], target=torch.ops.aten.bmm.default, args=(x, w))
    with pytest.raises(CubeInternalError, match=r"rewritten to make \[\(4, 2, 8, 8\)\], but it makes"):
        rows.make_op(like, torch.ops.aten.matmul.default, "matmul", (x, w), {}, [out], REGISTRY)
