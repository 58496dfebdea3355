"""A rank that fails stops the others within a bounded time, with the failing rank's message.

The ranks are started as plain processes (not torchrun, whose agent would stop
them too), so only cube's own mechanism can end the healthy rank, which is
blocked in a collective waiting for the failed one.
"""
import subprocess
import sys
import time

import pytest

from tests.launch import ROOT, _env, _free_port

BOUND_SECONDS = 60   # generous for a loaded 2-core machine; it takes about a second once the error is raised


@pytest.mark.multirank
def test_failing_rank_stops_the_others_with_its_message(tmp_path):
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "workers" / "failfast_worker.py"),
                                       str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    start = time.time()
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=BOUND_SECONDS + 120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    elapsed = time.time() - start
    (out0, err0), (out1, err1) = outs
    assert "first step done" in out0 and "first step done" in out1, (out0, err0, out1, err1)
    assert procs[1].returncode != 0 and "compiled for shape" in err1, err1
    assert procs[0].returncode != 0, (out0, err0)
    assert "second step done" not in out0
    # the healthy rank names the failed one and its error: its watcher stops it, or, when gloo
    # notices the closed connection first, its own error ends with the cause
    cause = "rank 1 failed: ValueError: batch item 0"
    assert f"cube: stopping rank 0 because {cause}" in err0 or \
        f"cube: rank 0 stopped because {cause}" in err0.strip().splitlines()[-1], err0
    assert elapsed < BOUND_SECONDS, elapsed
