"""An N-rank plan in one process (``python -m cube.debug -n N``) equals the multi-process run."""
import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import cube.debug
from tests.launch import ROOT, _env, parity_across_ranks
from tests.tiers import tiered

CASES = [
    # (model, policy, ranks, micro-batches, environment)
    ("gpt_nobias", "cube.policies.hybrid:PASHybrid", 4, 1, {"CUBE_TP": "2"}),       # data x tensor parallel
    ("gpt_nobias", "tests/extra_policies.py:PAS1F1BData", 4, 4, {}),          # 1F1B pipeline x data parallel
]


def _in_one_process(model, policy, nproc, nmicros, env, out):
    cmd = [sys.executable, "-m", "cube.debug", "-n", str(nproc), str(ROOT / "tests" / "workers" / "parity_worker.py"),
           model, policy, "3", str(out), str(nmicros)]
    res = subprocess.run(cmd, cwd=ROOT, env=_env({"CUBE_PARITY_OPT": "adamw", **env}), capture_output=True,
                         text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.mark.multirank
# PASHybrid's 4-rank launch in the slow tier: tests/test_parallel.py's hf_llama-PASHybrid-4 runs that
# plan on 4 processes in the default tier, and PAS1F1BData checks one process against several here
@pytest.mark.parametrize("model,policy,nproc,nmicros,env",
                         tiered(CASES, [c[1].split(":")[1] for c in CASES], slow={"PASHybrid"}))
def test_plan_in_one_process_equals_multi_process_run(model, policy, nproc, nmicros, env, tmp_path):
    (tmp_path / "mp").mkdir()
    (tmp_path / "one").mkdir()
    multi = parity_across_ranks(model, policy, nproc, tmp_path / "mp", steps=3, nmicros=nmicros, env=env)
    # the multi-process run equals the plain model, pieces held and covering every parameter (these
    # plans' cases in tests/test_parallel.py are in the slow tier: this launch checks the same)
    for r in multi:
        assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
    assert {n for r in multi for n in r["names"]} == set(multi[0]["all_names"])
    held_less = [r["held_numel"] < r["full_numel"] for r in multi]
    assert all(held_less) if nmicros > 1 else any(held_less), multi   # each stage its part; tensor pieces
    one = _in_one_process(model, policy, nproc, nmicros, env, tmp_path / "one")
    for a, b in zip(multi, one):
        assert a["rank"] == b["rank"] and b["world"] == nproc
        assert b["loss_err"] <= 1e-5 and b["param_err"] <= 1e-5, b
        assert torch.allclose(torch.tensor(a["losses"]), torch.tensor(b["losses"]), rtol=1e-6, atol=0), (a, b)
        assert a["param_sums"].keys() == b["param_sums"].keys()
        for k in a["param_sums"]:
            assert abs(a["param_sums"][k] - b["param_sums"][k]) <= 1e-6 * max(1.0, abs(a["param_sums"][k])), k


def test_a_failing_rank_stops_the_world_with_its_message():
    def body():
        if dist.get_rank() == 1:
            raise ValueError("rank one cannot go on")
        x = torch.ones(2)
        dist.all_reduce(x)   # rank 0 would wait forever for rank 1
        return x

    with pytest.raises(RuntimeError, match="rank 1 failed: ValueError: rank one cannot go on"):
        cube.debug.run(body, 2)


def test_collectives_and_sends_meet_in_one_process():
    def body():
        r, n = dist.get_rank(), dist.get_world_size()
        x = torch.full((2,), float(r + 1))
        dist.all_reduce(x)
        parts = [torch.empty(1) for _ in range(n)]
        dist.all_gather(parts, torch.tensor([float(r)]))
        if r == 0:
            dist.send(torch.tensor([42.0]), 1, tag=7)
            got = None
        else:
            got = torch.empty(1)
            dist.recv(got, 0, tag=7)
        return x.tolist(), [p.item() for p in parts], None if got is None else got.item()

    out = cube.debug.run(body, 2)
    assert out[0] == ([3.0, 3.0], [0.0, 1.0], None) and out[1] == ([3.0, 3.0], [0.0, 1.0], 42.0)
    assert not dist.is_initialized()   # outside the rank threads torch.distributed is untouched
