"""Context parallel through a recurrence (``cube.ir.heads``): where the sequence split stops at a
state-space mixer (its causal conv, its scan), the mixer runs split by channels between two all-to-all
exchanges, as Megatron-LM's context parallel for Mamba layers does, not whole on every rank on its
inputs gathered. Checked on the small mixer of ``tests.test_state_space_tp`` and on Hugging Face's
Mamba and Mamba-2 as shipped, trained exactly against the plain model under ``strict=True``."""
import functools

import pytest
import torch

import cube
from cube.ir.lost import LostSplitError
from cube.policies.context import PASContext
from tests import zoo
from tests.inprocess import assert_exact, parity
from tests.test_state_space_tp import Scan, _batch, halved, hf_mixer

CP2 = functools.partial(PASContext, cp=2)


def _rank0(model, sample, policy=CP2, world: int = 2):
    return cube.plan(model, sample, policy, world, strict=True).program.plans[0]


def _forward_steps(plan):
    return [c.step.kind for c in plan.calls if c.step is not None and c.step.kind not in ("chunk", "narrow")]


def test_the_scan_runs_on_each_ranks_channels_between_two_all_to_alls():
    torch.manual_seed(0)
    plan = _rank0(Scan(), _batch(6))
    steps = _forward_steps(plan)
    # into the channel split before the scan, back to the sequence split before the gate (x_proj's
    # contraction over channels adds the all-reduces, as under tensor parallel)
    assert steps.count("all_to_all") == 2 and "all_gather" not in steps, steps
    big = [c for c in plan.calls if c.op is not None and any(t.numel() >= 2 * 16 * 6 * 4 for t in c.op.outputs)]
    halves = [c for c in big if all(torch.Size([e - s for s, e in b]).numel() * 2 == t.numel()
                                    for t, b in zip(c.op.outputs, c.layout.outputs))]
    assert len(big) >= 3 and halves == big, [c.op.name for c in big]   # the scan's (B, D, T, N) step sizes


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_the_scan_trains_exactly_under_context_parallel(opt):
    torch.manual_seed(0)
    assert_exact(parity(Scan(), _batch(6), CP2, 2, steps=2, opt=opt, strict=True))


CP2_TP2 = functools.partial(PASContext, cp=2, tp=2)


def test_with_tensor_parallel_too_each_rank_runs_a_quarter_of_the_channels():
    """cp x tp: context parallel splits the mixer's channels in two, tensor parallel each half in two
    again (Megatron-LM's context parallel inside its tensor-parallel ranks)."""
    torch.manual_seed(0)
    plan = _rank0(Scan(), _batch(6), CP2_TP2, 4)
    big = [c for c in plan.calls if c.op is not None and any(t.numel() >= 2 * 16 * 6 * 4 for t in c.op.outputs)]
    quarters = [c for c in big if all(torch.Size([e - s for s, e in b]).numel() * 4 == t.numel()
                                      for t, b in zip(c.op.outputs, c.layout.outputs))]
    assert len(big) >= 3 and quarters == big, [c.op.name for c in big]


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_with_tensor_parallel_too_the_scan_trains_exactly(opt):
    torch.manual_seed(0)
    assert_exact(parity(Scan(), _batch(6), CP2_TP2, 4, steps=2, opt=opt, strict=True))


@pytest.mark.parametrize("name", ["mamba2", "lfm2"])
def test_with_tensor_parallel_too_hugging_face_mixers_train_exactly(name):
    """Mamba-2 reads a value gathered only for ``zeros_like`` (its first chunk's state): no gradient
    comes back for it, so its senders must not wait for one (they did: a deadlock). LFM2's depthwise
    conv runs on a window of the sequence and a quarter of the channels: one group per local channel."""
    if not zoo.installed(name):
        pytest.skip(f"{zoo.PACKAGES[name]} is not installed here")
    model, sample = zoo.build(name, zoo.B)
    torch.manual_seed(0)
    assert_exact(parity(model, sample, CP2_TP2, 4, steps=1, opt="sgd", param_floor=zoo.PARAM_FLOOR, strict=True))


def test_heads_too_few_for_cp_times_tp_are_refused_saying_so():
    """16 channels split over cp=2 but not over cp x tp = 6: the recurrence stays whole (a lost split),
    and strict=True says why and what to change."""
    torch.manual_seed(0)
    with pytest.raises(LostSplitError, match="do not divide into 6: choose cp x tp dividing the heads"):
        _rank0(Scan(), _batch(6), functools.partial(PASContext, cp=2, tp=3), 6)


@pytest.mark.parametrize("name", ["mamba", "mamba2", "falcon_h1"])
def test_hugging_face_mixer_runs_on_each_ranks_channels(name):
    """Every op of the mixer making a ``(B, channels, T)``-sized activation makes half of it on rank 0
    (before, the mixer ran whole on every rank after an all-gather of the sequence)."""
    model, sample, inner = hf_mixer(name)
    plan = _rank0(model, sample)
    assert "all_to_all" in _forward_steps(plan)
    big, whole = halved(plan, zoo.B * zoo.S * inner)
    assert len(big) > 10 and not whole, (len(big), whole)


def test_hugging_face_mamba_trains_exactly_under_context_parallel():
    if not zoo.installed("mamba"):
        pytest.skip("transformers is not installed here")
    outcome = zoo.run("mamba", "cp")
    assert outcome.kind == "exact", outcome
