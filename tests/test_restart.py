"""Restarts: a rank killed mid-training, torchrun --max-restarts, and the same final parameters.

examples/gpt/train.py saves a checkpoint after every step; with
``--crash-at-step 3`` its last rank kills itself (SIGKILL) at step 3 on the first
attempt. torchrun restarts the ranks, the script resumes from the latest
checkpoint, and the final checkpoint must equal that of an uninterrupted run.
"""
import subprocess
import sys

import pytest
import torch

import cube
from tests.launch import ROOT, _env, _free_port

ARGS = ["--policy", "PASData", "--layers", "2", "--dim", "64", "--heads", "2", "--seq", "16", "--batch", "8",
        "--steps", "6", "--zero", "2"]


def _train(ckpt, extra=(), restarts=0):
    # a fixed --master_port: the launcher's store outlives the attempt (cube.init keeps attempts apart)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--max-restarts={restarts}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}",
           str(ROOT / "examples" / "gpt" / "train.py"), *ARGS, "--ckpt", str(ckpt), *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=_env({}), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout


@pytest.mark.multirank
def test_killed_rank_resumes_to_the_uninterrupted_result(tmp_path):
    plain = _train(tmp_path / "plain")
    crashed = _train(tmp_path / "crashed", ["--crash-at-step", "3"], restarts=1)
    assert "resumed from" not in plain
    assert "resumed from" in crashed and "at step 3" in crashed, crashed
    a, opt_a = cube.merge_checkpoint(tmp_path / "plain" / "step6")
    b, opt_b = cube.merge_checkpoint(tmp_path / "crashed" / "step6")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-6), name
    for i in opt_a["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(opt_a["state"][i][key], opt_b["state"][i][key], rtol=0, atol=1e-7), (i, key)
    # the step's losses after the restart are the uninterrupted run's
    # ("step N: loss X | timings": the step and loss)
    tail = [line.split(" | ")[0] for line in plain.splitlines() if line.startswith(("step 3:", "step 4:", "step 5:"))]
    assert tail and all(line in crashed for line in tail), (tail, crashed)
