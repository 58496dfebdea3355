"""Partitioned plans on 2 and 4 gloo ranks equal the plain model on the full batch.

Each rank checks, after each of 5 AdamW steps, the loss it returns and its
pieces of every parameter against the single-device model trained on the same
batches (relative error ||a - b|| / ||b||, see tests/workers/parity_worker.py);
the ranks' pieces together must cover every parameter.
"""
import pytest

from tests.launch import parity_across_ranks
from tests.tiers import tiered

RTOL = 1e-5

CASES = [
    # (model, policy, ranks)
    ("mlp", "cube.policies.data:PASData", 2),
    ("mlp", "cube.policies.megatron:PASMegatronTP", 2),
    ("mlp", "cube.policies.gallery:PASCol", 2),
    ("mlp", "cube.policies.gallery:PASRow", 4),
    ("mlp", "cube.policies.data:PASData", 4),
    ("mlp", "cube.policies.megatron:PASMegatronTP", 4),
    ("mlp", "cube.policies.hybrid:PASHybrid", 4),
    ("gpt_nobias", "cube.policies.data:PASData", 2),
    ("gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2),
    ("gpt_nobias", "cube.policies.data:PASData", 4),
    ("gpt_nobias", "cube.policies.megatron:PASMegatronTP", 4),
    ("gpt_nobias", "cube.policies.hybrid:PASHybrid", 4),
    ("hf_llama", "cube.policies.data:PASData", 2),
    ("hf_llama", "cube.policies.megatron:PASMegatronTP", 2),
    ("hf_llama", "cube.policies.data:PASData", 4),
    ("hf_llama", "cube.policies.megatron:PASMegatronTP", 4),
    ("hf_llama", "cube.policies.hybrid:PASHybrid", 4),
    # values crossing device groups (send/recv; no micro-batches yet), with the tied embedding
    # and LM head of the GPT in different groups
    ("mlp", "tests/extra_policies.py:PASTwoStages", 2),
    ("gpt_nobias", "tests/extra_policies.py:PASTwoStages", 2),
    ("gpt_nobias", "tests/extra_policies.py:PASTwoStages", 4),
    ("hf_llama", "tests/extra_policies.py:PASTwoStages", 4),
    # a value changing its split dim between ops (all-to-all)
    ("mlp", "tests/extra_policies.py:PASSwap", 4),
    # context parallel: ring attention's point-to-point messages between processes
    ("gpt_nobias", "cube.policies.context:PASContext", 4),
]
IDS = [f"{m}-{p.split(':')[1]}-{n}" for m, p, n in CASES]
# the slow tier (CUBE_SLOW=1): each plan's checks are covered by a default-tier case
SLOW = {
    # 4 ranks of a plan the 2-rank case checks, and dp x tp (PASHybrid on the GPT and the Llama)
    "mlp-PASData-4", "mlp-PASMegatronTP-4", "mlp-PASHybrid-4", "gpt_nobias-PASData-4",
    "gpt_nobias-PASMegatronTP-4",
    # the same launch is tests/test_debug.py's multi-process run, which checks the same
    "gpt_nobias-PASHybrid-4",
    # the Llama's data and tensor parallel plans: PASHybrid-4 is both at once
    "hf_llama-PASData-2", "hf_llama-PASMegatronTP-2", "hf_llama-PASData-4", "hf_llama-PASMegatronTP-4",
    # two stages: the MLP on 2 ranks, the GPT on 4 (data parallel stages, tied weights across
    # groups); the Llama's stages cross groups in its 1F1B pipeline below
    "gpt_nobias-PASTwoStages-2", "hf_llama-PASTwoStages-4",
}


@pytest.mark.multirank
@pytest.mark.parametrize("model,policy,nproc", tiered(CASES, IDS, SLOW))
def test_partitioned_plan_equals_single_device(model, policy, nproc, tmp_path):
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    results = parity_across_ranks(model, policy, nproc, tmp_path)
    for r in results:
        assert r["loss_err"] <= RTOL, r
        assert r["param_err"] <= RTOL, r
    held = {name for r in results for name in r["names"]}
    assert held == set(results[0]["all_names"]), set(results[0]["all_names"]) - held
    # tensor parallel plans hold pieces, not the full model on every rank
    if any(k in policy for k in ("Megatron", "Hybrid", "PASCol", "PASRow", "Stages")):
        assert any(r["held_numel"] < r["full_numel"] for r in results), results


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["hf_gpt2", "vit", "cnn"])
def test_data_parallel_losses_on_the_model_zoo(model, tmp_path):
    """Losses only: these models hold parameters whose gradient is zero by construction (a key
    bias before softmax, a conv bias before BatchNorm), which AdamW moves by round-off."""
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    for r in parity_across_ranks(model, "cube.policies.data:PASData", 2, tmp_path):
        assert r["loss_err"] <= RTOL, r


PIPELINES = [
    # (model, policy in tests/extra_policies.py, ranks, optimizer)
    ("mlp", "PAS1F1B", 2, "adamw"),
    ("gpt_nobias", "PAS1F1B", 2, "adamw"),
    ("gpt_nobias", "PASGPipe", 2, "adamw"),
    ("gpt_nobias", "PAS1F1B", 4, "adamw"),
    ("gpt_nobias", "PASGPipe", 4, "adamw"),
    ("gpt_nobias", "PAS1F1BData", 4, "adamw"),
    # pp=2 x tp=2 is exact under SGD (1e-8); under AdamW one weight's elements with gradients
    # near AdamW's eps turn the round-off of another summation order into 3e-5 (norm-wise)
    ("gpt_nobias", "PAS1F1BTensor", 4, "sgd"),
    ("hf_llama", "PAS1F1B", 2, "adamw"),
    # the shipped policies: stages balanced by op cost, 4 micro-batches (CUBE_MICROS)
    ("gpt_nobias", "cube.policies.pipeline:PAS1F1B", 4, "adamw"),
    ("mlp", "cube.policies.pipeline:PASGPipe", 2, "adamw"),
]
PIPELINE_IDS = [f"{m}-{p.split(':')[-1]}-{n}-{o}" for m, p, n, o in PIPELINES]
PIPELINE_SLOW = {
    # 4 stages of 1F1B: the shipped policies.pipeline:PAS1F1B on 4 ranks (adamw1); GPipe: 2 ranks
    "gpt_nobias-PAS1F1B-4-adamw0", "gpt_nobias-PASGPipe-4-adamw",
    # the same launch is tests/test_debug.py's multi-process run, which checks the same
    "gpt_nobias-PAS1F1BData-4-adamw",
    # pp2 x tp2: cube.policies.megatron3d:PASMegatron in tests/test_pipeline_policies.py and
    # tests/test_trace_repeat.py
    "gpt_nobias-PAS1F1BTensor-4-sgd",
}


@pytest.mark.multirank
@pytest.mark.parametrize("model,policy,nproc,optimizer", tiered(PIPELINES, PIPELINE_IDS, PIPELINE_SLOW))
def test_pipeline_schedule_equals_gradient_accumulation(model, policy, nproc, optimizer, tmp_path):
    """A step on one global batch, cut into 4 micro-batches through the schedule, equals the plain
    model's step on that batch; the GPT's tied embedding and LM head sit in the first and last stage."""
    if model.startswith("hf_"):
        pytest.importorskip("transformers")
    path = policy if ":" in policy else f"tests/extra_policies.py:{policy}"
    results = parity_across_ranks(model, path, nproc, tmp_path, steps=3, nmicros=4, optimizer=optimizer)
    for r in results:
        assert r["loss_err"] <= RTOL, r
        assert r["param_err"] <= RTOL, r
    held = {name for r in results for name in r["names"]}
    assert held == set(results[0]["all_names"])
    assert all(r["held_numel"] < r["full_numel"] for r in results)   # each stage holds its part
