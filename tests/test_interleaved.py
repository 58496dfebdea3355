"""Interleaved 1F1B (several pipeline stages per device): generated stage methods, values handed
between a device's own stages, clear errors, and parity on gloo ranks.

The multi-rank cases compare the loss and parameters after each of 5 steps (AdamW; SGD for the
tensor parallel case, see tests/test_parallel.py) with the plain model's step
on the same global batch, cut into 4 micro-batches (tests/workers/parity_worker.py).
"""
import re

import pytest
import torch

from cube import config
from cube.compiler import generate_code
from cube.runtime import p2p
from cube.schedule import sched_1f1b_interleaved
from cube.policies import resolve
from cube.policies.pipeline import PAS1F1BInterleaved
from tests.launch import parity_across_ranks
from tests.models import build
from tests.tiers import tiered

RTOL = 1e-5


def _methods(source: str) -> dict:
    """``{name: body}`` of the generated module's methods."""
    parts = re.split(r"\n    def (\w+)\(", source)
    return dict(zip(parts[1::2], parts[2::2]))


def test_each_device_runs_its_stages_as_methods_in_the_schedule_order():
    """2 devices x 2 stages of the 4-block GPT: device r holds stages r and r + 2, one block each;
    the tied embedding (stage 0) and LM head (stage 3) sum their gradient over both devices."""
    assert resolve("PAS1F1BInterleaved") == "cube.policies.pipeline:PAS1F1BInterleaved"
    model, sample = build("gpt4_nobias")
    src = generate_code(model, sample, PAS1F1BInterleaved, world_size=2)
    schedule = str(sched_1f1b_interleaved(None, 4, 2, 2)).splitlines()
    for r in range(2):
        methods = _methods(src[r])
        assert [m for m in methods if m.startswith("stage_")] == [f"stage_{r}", f"stage_{r + 2}"]
        # the last stage's device also takes the valid targets of the global batch (its loss's count)
        tail = ", valid_targets0)" if r == 1 else ")"
        assert f'return getattr(self, f"stage_{{stage}}")(idx, targets{tail}' in methods["forward"]
        actions = schedule[r + 1].split(": ")[1].split()
        assert f"runtime.pipeline.run(model, batches, {actions!r}" in src[r]
        assert "('wte_weight', (0, 1))" in src[r]
        assert "stash" not in src[r]   # the stages hand each other only what goes through the other device
        for k in (r, r + 2):
            assert set(re.findall(r"self\.layers_(\d+)_", methods[f"stage_{k}"])) == {str(k)}
    assert "return cross_entropy_loss" in methods["stage_3"] and "return None" in methods["stage_1"]
    assert "runtime.p2p.recv(0" in methods["stage_1"] and "runtime.p2p.recv(0" in methods["stage_3"]


def test_a_value_between_two_stages_of_a_device_is_stashed_under_its_name():
    """Stages cut inside blocks: the residual stream made in stage 1 is read in stage 3, on the
    same device; it is stashed at the end of stage 1 and unstashed, with its gradient, in stage 3."""
    model, sample = build("gpt_nobias")
    src = generate_code(model, sample, "tests/extra_policies.py:PAS1F1BInterleaved", world_size=2)
    methods = _methods(src[1])
    stash = re.search(r"runtime\.p2p\.stash\((\w+), tag=(\d+)\)", methods["stage_1"])
    assert stash, methods["stage_1"]
    name, tag = stash.groups()
    assert f"{name} = runtime.p2p.unstash(tag={tag}, requires_grad=True)" in methods["stage_3"]


def test_stash_cuts_autograd_and_carries_the_gradient_back():
    """Each stage's backward runs through its own graph once; together they give the gradients of
    the whole computation."""
    torch.manual_seed(0)
    w1, w2, x = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True), torch.randn(3)
    p2p.set_micro(2)
    try:
        h = torch.tanh(x * w1)              # stage a
        p2p.stash(h, tag=7)
        markers = p2p.take_markers()
        h2 = p2p.unstash(tag=7, requires_grad=True)   # stage b
        loss = (h2 * w2).sum()
        p2p.backward(loss, [])
        assert w1.grad is None and w2.grad is not None   # stage b's backward stops at the stash
        p2p.backward(None, markers)
    finally:
        p2p.set_micro(0)
    assert p2p.untaken() == []
    ref1, ref2 = w1.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    (torch.tanh(x * ref1) * ref2).sum().backward()
    assert torch.equal(w1.grad, ref1.grad) and torch.equal(w2.grad, ref2.grad)


def test_bad_interleaved_settings_are_clear_errors(monkeypatch):
    model, sample = build("gpt4_nobias")
    monkeypatch.setenv("CUBE_MICROS", "3")
    with pytest.raises(ValueError, match=r"nmicros \(3\) to be a multiple of nranks \(2\).*CUBE_MICROS"):
        generate_code(model, sample, PAS1F1BInterleaved, world_size=2)
    monkeypatch.setenv("CUBE_MICROS", "4")
    monkeypatch.setenv("CUBE_VIRTUAL", "none")
    with pytest.raises(ValueError, match="CUBE_VIRTUAL must be a positive integer"):
        generate_code(model, sample, PAS1F1BInterleaved, world_size=2)
    monkeypatch.setenv("CUBE_VIRTUAL", "3")
    assert config.virtual_stages() == 3 and "CUBE_VIRTUAL=3" in config.plan_settings()


def test_stages_placed_off_their_pipeline_rank_are_a_clear_error():
    from cube import schedule
    from cube.ir import IRDataOperation
    from cube.policies.pipeline import balanced_starts

    def PASMisplaced(graph, resource):   # stages 0, 1 on device 0 and 2, 3 on device 1
        stages = graph.staging(balanced_starts(graph, 4))
        for node in graph.select(ntype=IRDataOperation):
            for dev, piece in enumerate(graph.replicate(node, times=2)):
                graph.assign(piece, dev)
        for k, stage in enumerate(stages):
            graph.assign(stage, k // 2)
        schedule.sched_1f1b_interleaved(graph, 4, 2, 2)
        return graph

    model, sample = build("gpt4_nobias")
    with pytest.raises(ValueError, match=r"device 0 runs ops of stages \[0, 1\], but the 1f1b-interleaved schedule "
                                         r"runs stages \[0, 2\] together.*stage k % 2"):
        generate_code(model, sample, PASMisplaced, world_size=2)


CASES = [
    # (model, policy, ranks, optimizer, environment)
    ("gpt4_nobias", "cube.policies.pipeline:PAS1F1BInterleaved", 2, "adamw", {}),
    # stages cut inside blocks: values stashed between a device's stages, blocks recomputed
    ("gpt_nobias", "tests/extra_policies.py:PAS1F1BInterleaved", 2, "adamw", {"CUBE_RECOMPUTE": "all"}),
    # each stage data parallel over two devices
    ("gpt_nobias", "tests/extra_policies.py:PAS1F1BInterleavedData", 4, "adamw", {}),
    # PASMegatron pp=2 x tp=2 with two stages per pipeline rank (exact under SGD, see test_parallel)
    ("gpt4_nobias", "cube.policies.megatron3d:PASMegatron", 4, "sgd", {"CUBE_TP": "2", "CUBE_PP": "2", "CUBE_VIRTUAL": "2"}),
]
IDS = [f"{c[1].split(':')[1]}-{c[2]}" for c in CASES]
# the slow tier (CUBE_SLOW=1): stages over two devices each, which PASMegatron-4 checks (tensor parallel
# stages), and data parallel stages the 1F1B pipelines of tests/test_debug.py and tests/test_zero.py
SLOW = {"PAS1F1BInterleavedData-4"}


@pytest.mark.multirank
@pytest.mark.parametrize("model,policy,nproc,optimizer,env", tiered(CASES, IDS, SLOW))
def test_interleaved_schedule_equals_gradient_accumulation(model, policy, nproc, optimizer, env, tmp_path):
    results = parity_across_ranks(model, policy, nproc, tmp_path, steps=5, nmicros=4, optimizer=optimizer,
                                  env={"CUBE_MICROS": "4", **env})
    for r in results:
        assert r["loss_err"] <= RTOL, r
        assert r["param_err"] <= RTOL, r
    held = {name for r in results for name in r["names"]}
    assert held == set(results[0]["all_names"])
    assert all(r["held_numel"] < r["full_numel"] for r in results)   # each device holds its stages only
