"""PASMegatron (data x tensor x pipeline parallel with 1F1B): planning on 8 ranks without a
launch, clear errors for degrees that do not fit, and parity on 4 gloo ranks.

The multi-rank cases compare each step's loss and parameters with the plain model's
step on the same global batch, which the pipeline cuts into 4 micro-batches
(tests/workers/parity_worker.py).
"""
import functools
import re

import pytest

from cube.compiler import generate_code
from cube.policies import resolve
from cube.policies.megatron3d import PASMegatron, degrees
from tests.launch import parity_across_ranks
from tests.models import build
from tests.tiers import tiered

RTOL = 1e-5


def test_megatron_is_shipped():
    assert resolve("PASMegatron") == "cube.policies.megatron3d:PASMegatron"


def test_three_dimensional_plan_on_eight_ranks():
    """pp=2 x dp=2 x tp=2: each rank runs one stage's 1F1B; the tied embedding (stage 0) and
    LM head (stage 1) sum their gradient over the matching tensor slot of both stages."""
    model, sample = build("gpt_nobias")
    batch = tuple(t.repeat(4, 1) for t in sample)   # the global batch: 4 micro-batches of the sample's size
    src = generate_code(model, batch, functools.partial(PASMegatron, tp=2, pp=2, nmicros=4), world_size=8)
    first, last = "['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']", "['F0', 'B0', 'F1', 'B1', 'F2', 'B2', 'F3', 'B3']"
    for r in range(8):
        assert f"runtime.pipeline.run(model, batches, {first if r < 4 else last}" in src[r], r
        # tensor parallel pairs inside the stage (ranks differing in the last bit)
        assert "runtime.collectives.all_reduce(linear" in src[r]
        assert re.search(rf"ranks=\({r & ~1}, {r | 1}\)", src[r]), r
    assert "('wte_weight', (0, 2, 4, 6))" in src[0] and "('wte_weight', (1, 3, 5, 7))" in src[5]
    # data parallel over the batch parts: rank 0 sums its stage-0 layer weights with rank 2
    assert "('layers_0_ln_1_weight', (0, 2))" in src[0]
    assert "runtime.p2p.send(" in src[0] and "runtime.p2p.recv(" in src[4]


def test_degrees_that_do_not_divide_the_world_are_clear_errors(monkeypatch):
    assert degrees(8, 2, 2) == (2, 2, 2)
    monkeypatch.setenv("CUBE_TP", "1")
    monkeypatch.setenv("CUBE_PP", "4")
    assert degrees(8) == (2, 1, 4)
    with pytest.raises(ValueError, match=r"6 devices do not split into tensor parallel tp=1 x pipeline pp=4.*"
                                         r"CUBE_TP and CUBE_PP"):
        degrees(6)
    monkeypatch.setenv("CUBE_PP", "0")
    with pytest.raises(ValueError, match="CUBE_PP must be a positive integer"):
        degrees(4)


def test_more_stages_than_the_model_can_be_cut_into_is_a_clear_error():
    model, sample = build("mlp")
    with pytest.raises(ValueError, match="pipeline stages"):
        generate_code(model, sample, functools.partial(PASMegatron, tp=1, pp=64), world_size=64)


CASES = [
    # (name, CUBE_TP, CUBE_PP, optimizer): 4 ranks each
    # pp=2 x tp=2 is exact under SGD; AdamW turns the round-off of another summation order in
    # tensor parallel pieces into 3e-5 for elements with gradients near its eps (see test_parallel)
    ("pp2-tp2-dp1", "2", "2", "sgd"),
    ("pp2-tp1-dp2", "1", "2", "adamw"),
    ("pp1-tp2-dp2", "2", "1", "sgd"),
]
# the slow tier (CUBE_SLOW=1): no pipeline, tp x dp as PASHybrid on 4 ranks checks it (tests/test_debug.py,
# tests/test_zero.py), and this policy's tp=2 pieces pp2-tp2-dp1
SLOW = {"pp1-tp2-dp2"}


@pytest.mark.multirank
@pytest.mark.parametrize("name,tp,pp,optimizer", tiered(CASES, [c[0] for c in CASES], SLOW))
def test_megatron_equals_the_step_on_the_global_batch(name, tp, pp, optimizer, tmp_path):
    results = parity_across_ranks("gpt_nobias", "cube.policies.megatron3d:PASMegatron", 4, tmp_path, steps=3,
                                  nmicros=4, optimizer=optimizer,
                                  env={"CUBE_TP": tp, "CUBE_PP": pp, "CUBE_MICROS": "4"})
    for r in results:
        assert r["loss_err"] <= RTOL, r
        assert r["param_err"] <= RTOL, r
    held = {n for r in results for n in r["names"]}
    assert held == set(results[0]["all_names"])
    assert all(r["held_numel"] < r["full_numel"] for r in results)   # stages and tensor pieces
