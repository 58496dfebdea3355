"""Models nobody here wrote (``tests.zoo``: Hugging Face families with their shipped configurations)
under every shipped plan: each trains exactly against the plain model, or is refused for a
reason listed in ``tests.zoo.REFUSED`` (or a split not kept yet, ``tests.zoo.GAPS``), every plan under
``strict=True``.

The default tier runs every model under a pipeline of two micro-batches (the plan that asks the
most of every op's rule: each must carry the batch split) and a few models under each other plan;
``CUBE_SLOW=1`` runs the whole table (``python -m tests.zoo`` prints it).
"""
import pytest

from tests import zoo
from tests.tiers import tiered

FAST = {("gpt2", "tensor"), ("llama", "tensor"), ("gpt_neox", "tensor"), ("phi3", "tensor"), ("t5", "tensor"),
        ("qwen3", "data"), ("gemma2", "data"), ("mixtral", "data"), ("vit", "data"), ("swin", "data"),
        ("resnet", "data"), ("llama", "pipeline_1"), ("qwen3", "pipeline_1"), ("bart", "pipeline_1"),
        ("llama", "3d"), ("gpt2", "single"), ("convnext", "single")}
FAST |= {(m, "pipeline") for m in zoo.MODELS if m not in zoo.WIDER}
ALL = [(m, p) for m in zoo.MODELS for p in zoo.PLANS]
# the families added later: tests/test_zoo_added.py, tests/test_zoo_recent.py and tests/test_zoo_wider.py
CASES = [(m, p) for m, p in ALL if m not in zoo.ADDED and m not in zoo.RECENT and m not in zoo.WIDER]


def cases(which, fast=FAST):
    """``which`` as parameters, the ones not in ``fast`` in the slow tier."""
    return tiered(which, [f"{m}-{p}" for m, p in which], {f"{m}-{p}" for m, p in which if (m, p) not in fast})


@pytest.mark.parametrize("model,plan", cases(CASES))
def test_model_under_plan_is_exact_or_refused_for_a_listed_reason(model, plan):
    check(model, plan)


def check(model: str, plan: str) -> None:
    """``model`` under ``plan`` is exact, or refused as ``tests.zoo`` lists."""
    if not zoo.installed(model):
        pytest.skip(f"{zoo.PACKAGES[model]} is not installed here (no wheel for this torch): {model} runs where it is")
    outcome = zoo.run(model, plan)
    listed = zoo.REFUSED.get((model, plan)) or zoo.GAPS.get((model, plan))
    if listed:
        part, why = listed
        assert outcome.kind == "refused" and part in outcome.detail, (outcome, why)
    else:
        assert outcome.kind == "exact", outcome


def test_every_listed_refusal_names_a_case_of_the_table():
    assert set(zoo.REFUSED) <= set(ALL) and set(zoo.GAPS) <= set(ALL) and not set(zoo.REFUSED) & set(zoo.GAPS)


def test_cube_has_a_rule_for_every_op_dtensor_covers_in_the_tier():
    from tests import op_coverage
    used = op_coverage.model_ops(zoo.MODELS)
    missing = sorted(op for op in used if op in op_coverage.dtensor_ops() and op not in op_coverage.cube_ops())
    assert len(used) > 50 and not missing, missing


# whole by design, as in Megatron-LM: an MoE router and a shared expert's gate (one output per
# expert or token), Swin's patch merging (a linear with no partner to pair with), multi-head latent
# attention's down projection (its rotary key part is one head every head shares: Megatron-LM keeps
# linear_kv_down_proj whole too), Llama 4's router (its top-1 of the logits, as GraniteMoE's)
WHOLE_BY_DESIGN = ("mlp.gate.weight", "shared_expert_gate.weight", "downsample.reduction.weight",
                   "kv_a_proj_with_mqa.weight", "feed_forward.router.weight")
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", [m for m in zoo.TRANSFORMERS if m not in zoo.ADDED and m not in zoo.RECENT])
def test_tensor_parallel_holds_a_tp_th_of_every_block_linear(name, tp):
    holds_a_tp_th(name, tp)


def holds_a_tp_th(name: str, tp: int) -> None:
    """Rank 0 holds at most a ``tp``-th of each of block 0's linear weights (but those whole by design)."""
    if not zoo.installed(name):
        pytest.skip(f"{zoo.PACKAGES[name]} is not installed here: {name} runs where it is")
    shares = zoo.tp_shares(name, tp)
    assert shares, name
    over = {n: s for n, s in shares.items() if s > 1 / tp and not n.endswith(WHOLE_BY_DESIGN)}
    assert not over, over
