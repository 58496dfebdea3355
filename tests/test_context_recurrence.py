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


def test_with_tensor_parallel_too_the_recurrence_is_a_lost_split():
    """cp x tp would split the same channels twice: not planned yet, so the mixer's sequence split is
    lost, and strict=True refuses the plan naming it (without it, the mixer runs whole, exact)."""
    torch.manual_seed(0)
    with pytest.raises(LostSplitError, match="context parallel over cp=2 lost at op"):
        _rank0(Scan(), _batch(6), functools.partial(PASContext, cp=2, tp=2), 4)


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
