"""Restarts: a rank killed mid-training, torchrun --max-restarts, and exactly the same final state.

examples/gpt/train.py (dropout 0.1) saves a checkpoint after every step, in the background
(``--async-save``); with ``--crash-at-step 3`` its last rank kills itself (SIGKILL) at step 3 on
the first attempt. torchrun restarts the ranks, the script resumes from the newest complete
checkpoint (the loader's position and the random generators included), and the losses after the
restart and the final checkpoint must equal those of an uninterrupted run bit for bit.
"""
import re
import subprocess
import sys

import pytest
import torch

import cube
from tests.launch import ROOT, _env, _free_port

ARGS = ["--policy", "PASData", "--layers", "2", "--dim", "64", "--heads", "2", "--seq", "16", "--batch", "8",
        "--steps", "6", "--zero", "2", "--dropout", "0.1", "--async-save"]


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
    # the save after step 3 was in flight when the rank died (async): the newest complete one is step 2 or 3
    resumed = re.search(r"resumed from .*step(\d) at step (\d)", crashed)
    assert resumed and resumed.group(1) == resumed.group(2) and int(resumed.group(2)) in (2, 3), crashed
    start = int(resumed.group(2))
    a, opt_a = cube.merge_checkpoint(tmp_path / "plain" / "step6")
    b, opt_b = cube.merge_checkpoint(tmp_path / "crashed" / "step6")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    for i in opt_a["state"]:
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt_a["state"][i][key], opt_b["state"][i][key]), (i, key)
    # the step's losses after the restart are the uninterrupted run's
    # ("step N: loss X | timings": the step and loss)
    after = crashed.split("resumed from", 1)[1]
    tail = [line.split(" | ")[0] for line in plain.splitlines()
            if line.startswith(tuple(f"step {i}:" for i in range(start, 6)))]
    assert len(tail) == 6 - start and all(line in after for line in tail), (tail, crashed)
