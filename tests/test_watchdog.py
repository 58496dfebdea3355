"""Hangs that name themselves: a rank that stops making progress stops every rank within the
timeout, each naming the step it waits in and where (``cube.runtime.watchdog``).

Two plain processes (not torchrun, whose agent would stop them too) run a data-parallel MLP with
``CUBE_HANG_TIMEOUT=3``; one rank's loader blocks forever, or one rank makes an all-reduce the
other never makes. Without the watchdog both would wait for gloo's 30-minute timeout.
"""
import re
import subprocess
import sys
import time

import pytest

from tests.launch import ROOT, _env, _free_port

TIMEOUT = 3
BOUND_SECONDS = 60   # the timeout, plus start-up and compile on a loaded 2-core machine


def _run(tmp_path, how):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CUBE_HANG_TIMEOUT": str(TIMEOUT)})
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers" / "hang_worker.py"),
                                       str(tmp_path), how], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    start = time.time()
    try:
        outs = [p.communicate(timeout=BOUND_SECONDS + 60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return procs, outs, time.time() - start


@pytest.mark.multirank
def test_a_stuck_loader_stops_every_rank_naming_where_it_waits(tmp_path):
    procs, ((out0, err0), (out1, err1)), elapsed = _run(tmp_path, "loader")
    assert procs[0].returncode == procs[1].returncode == 1, (err0, err1)
    assert "done" not in out0 + out1 and "rank 0: step 2" in out0
    assert elapsed < BOUND_SECONDS
    # each rank names the step and what it waits in: the first whose watchdog fires says it made no
    # progress and reports it; the other says where it was when that report (or gloo's closed
    # connection) stopped it, unless its own watchdog fired first too
    said = r"cube: rank {r} (made no progress for 3 s \(CUBE_HANG_TIMEOUT\) in|was in) step 2 \(micro-batch 0\)"
    assert re.search(said.format(r=1) + r": waiting in __next__ \(.*hang_worker.py:\d+: time.sleep\(3600\)", err1), err1
    assert "called from the generated code" in err1 and "next_batch" in err1
    assert re.search(said.format(r=0), err0), err0
    assert "made no progress" in err0 + err1


@pytest.mark.multirank
def test_a_skipped_collective_stops_every_rank(tmp_path):
    procs, ((out0, err0), (out1, err1)), elapsed = _run(tmp_path, "collective")
    assert procs[0].returncode != 0 and procs[1].returncode != 0, (err0, err1)
    assert elapsed < BOUND_SECONDS
    named = [e for e in (err0, err1) if "made no progress" in e]
    assert named, (err0, err1)
    assert any("in step 1" in e or "in step 2" in e for e in named), named
    # rank 1 names the collective it made and the script line that made it
    assert "made no progress" not in err1 or "hang_worker.py" in err1 and "dist.all_reduce(torch.ones(3))" in err1
