"""Expert parallel on torchtitan's DeepSeek-V3 (pip package torchtitan, not a requirement: the tests
skip, visibly, without it): its ``debugmodel`` with the first two blocks (a dense one, then an MoE
block: 8 routed experts, top-3, two shared experts, multi-head latent attention, flex_attention over
packed documents). Its MoE counts the tokens per expert before the sort (a one-hot of the top-k ids
summed over the batch), sorts with a stable ``argsort``, runs bf16 ``_grouped_mm``s and puts the rows
back with its own ``deterministic_scatter_add``; ``PASMegatron(ep=2)`` finds the region from the
graph (``cube.ir.dispatch``), counts each rank's tokens again and trains exactly like the plain model.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("torchtitan.models.deepseek_v3", reason="torchtitan is not installed (pip install torchtitan)")

import cube  # noqa: E402
from cube.policies.megatron3d import PASMegatron  # noqa: E402
from cube.trace.flex import device_check_off  # noqa: E402
from tests.inprocess import assert_exact, parity  # noqa: E402
from tests.zoo import _packed, _titan  # noqa: E402


def _model():
    torch.manual_seed(0)
    model = _titan("deepseek_v3")
    with torch.no_grad():   # as torchtitan's trainer does: build() leaves the expert weights uninitialized
        model.model.init_states()
    gen = torch.Generator().manual_seed(1)
    return model, _packed(4, gen)


def _ep(ep: int = 2):
    return functools.partial(PASMegatron, tp=1, pp=1, nmicros=1, ep=ep)


def test_each_rank_holds_half_of_the_routed_experts():
    model, sample = _model()
    plan = cube.plan(model, sample, _ep(2), 2)
    for r, p in plan.program.plans.items():
        routed = [(t, box) for t, box in p.attrs if ".inner_experts." in t.names[0]]
        assert len(routed) == 3 and all(box[0][1] - box[0][0] == t.shape[0] // 2 for t, box in routed), (r, routed)
        shared = [(t, box) for t, box in p.attrs if ".shared_experts." in t.names[0]]
        assert shared and all(box[0] == (0, t.shape[0]) for t, box in shared), (r, shared)


@pytest.mark.slow   # 20-40 s a case; tests/test_expert_parallel_hf.py's "onehot" case checks the same rules
@pytest.mark.parametrize("world,opt", [(2, "sgd"), (2, "adamw"), (4, "sgd")])
def test_deepseek_v3_expert_parallel_is_exact(world, opt):
    """ep2 (2 ranks) and ep2 x dp2 (4 ranks): loss and every parameter piece after 2 steps. The plain
    model's flex_attention trains on a CPU with torch's device check off (``cube.trace.flex``).

    ep2 x dp2 under AdamW: ``test_data_parallel_replicas_round_their_own_bf16_expert_gradients``."""
    model, sample = _model()
    gen = torch.Generator().manual_seed(2)
    batches = [_packed(4, gen) for _ in range(2)]
    with device_check_off():
        assert_exact(parity(model, sample, _ep(2), world, steps=2, opt=opt, batches=batches))


def _halves_reference(model, batches, make):
    """One process that sums the gradients of the two halves of each batch (what two data-parallel
    replicas compute), each half's loss weighted 1/2."""
    ref = copy.deepcopy(model)
    opt = make(ref.parameters())
    losses = []
    for b in batches:
        total = 0.0
        for half in (slice(0, b[0].shape[0] // 2), slice(b[0].shape[0] // 2, None)):
            loss = 0.5 * ref(*(t[half] for t in b))
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, dict(ref.named_parameters())


@pytest.mark.slow
def test_data_parallel_replicas_round_their_own_bf16_expert_gradients():
    """The model's grouped matmuls run in bf16 and round each expert's weight gradient to bf16. Under
    ep2 x dp2 each data-parallel replica rounds its half of the batch's before the replicas are
    summed, where one device rounds the whole batch's once; AdamW's first steps magnify that (3.2e-4
    against the whole-batch model; SGD 7e-8). Against one process that sums the two halves'
    gradients, as the replicas do, the difference falls to AdamW-magnified float32 round-off (1.3e-5
    measured; ep2 alone reads 6e-6 against the whole batch): bounded here at 2e-5."""
    model, sample = _model()
    gen = torch.Generator().manual_seed(2)
    batches = [_packed(4, gen) for _ in range(2)]
    with device_check_off():
        assert_exact(parity(model, sample, _ep(2), 4, steps=2, opt="adamw", batches=batches,
                            reference=_halves_reference), tol=2e-5)


def test_deepseek_v3_pipeline_counts_each_micro_batchs_tokens():
    """A pipeline of two micro-batches (1F1B, 2 ranks): the MoE counts the tokens per expert before its sort
    (a one-hot summed over the batch, then the group offsets); on each micro-batch it counts that
    micro-batch's, the ones its sort orders (``Region.counting``), and adds them to its ``tokens_per_expert``
    buffer, which after the steps holds the global batches' counts, as on one device. (Loss and every
    parameter against the plain model: ``tests/test_zoo.py``, ``tt_deepseek_v3`` under ``pipeline``.)"""
    from cube.policies.pipeline import PAS1F1B
    model, _ = _model()
    gen = torch.Generator().manual_seed(2)
    batches = [_packed(4, gen) for _ in range(2)]
    ref = copy.deepcopy(model)
    with device_check_off():
        for b in batches:
            ref(*b).backward()
    want = dict(ref.named_buffers())["model.layers.1.moe.tokens_per_expert_E"]
    assert want.sum() > 0, want

    def counts():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=functools.partial(PAS1F1B, nmicros=2), strict=True)
        def step(m, data):
            loss = m(*next(data))
            loss.backward()
            return loss
        gen_model = cube.load_model()
        for _ in batches:
            step(gen_model, it)
        got = {names[0]: getattr(gen_model, local) for local, (names, _) in gen_model.BUFFERS.items()}
        return got.get("model.layers.1.moe.tokens_per_expert_E")
    import cube.debug
    with device_check_off():
        held = [c for c in cube.debug.run(counts, 2) if c is not None]
    assert len(held) == 1 and torch.equal(held[0], want), (held, want)
