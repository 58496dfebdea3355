"""Crash-safe saves, proven: a rank killed (SIGKILL) anywhere in a save loses no complete checkpoint.

Two real processes (gloo) train a data-parallel MLP and save ``step1``, then ``step2``, during
which one rank kills itself at a named point of ``cube.runtime.checkpoint_write`` (before, during
and after each of its files; rank 0 also around ``meta.json``; asynchronous saves also around the
marker files their writers meet through). The test then kills the survivor, as torchrun's agent
would, and checks: ``cube.latest_checkpoint`` finds ``step2`` when the kill came after its
``meta.json`` (or, in an asynchronous save, after the killed rank 1 handed its files to rank 0's
writer, which may complete the checkpoint before the test stops it), else ``step1``; that checkpoint merges (every checksum verified) to exactly the
parameters, AdamW state, loader state and step the run had when it saved; and ``step2``, when
partial, is refused, naming ``meta.json`` as missing.

The default tier kills at four points (both ranks, both kinds of save, inside a file and around
``meta.json``); ``CUBE_SLOW=1`` runs all 36. ``python -m tests.test_checkpoint_faults`` prints the
table of every point and its outcome.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import cube
from tests.launch import ROOT, _env, _free_port
from tests.models import build
from tests.tiers import tiered

WORKER = ROOT / "tests" / "workers" / "ckpt_fault_worker.py"


def points(mode: str):
    """``(point, victim rank)`` of every kill point of a save of that mode."""
    out = []
    for rank in (0, 1):
        files = [f"rank{rank}.safetensors", f"rank{rank}.pt"] + ([f".rank{rank}.done.json"] if mode == "async" else [])
        out += [(f"{when} {f}", rank) for f in files for when in ("before", "during", "after")]
    return out + [(f"{when} meta.json", 0) for when in ("before", "during", "after")]


CASES = [(mode, point, rank) for mode in ("sync", "async") for point, rank in points(mode)]
IDS = [f"{mode}-r{rank}-{point.replace(' ', '-')}" for mode, point, rank in CASES]
FAST = {"sync-r1-during-rank1.safetensors", "sync-r0-before-meta.json", "async-r0-during-rank0.pt",
        "async-r0-after-meta.json"}


def kill_and_check(root: Path, cache: Path, mode: str, point: str, victim: int) -> dict:
    """Runs the workers with the kill at ``point`` on rank ``victim``; checks the directory; one table row."""
    root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = _env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(root), str(cache), point, str(victim), mode],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        procs[victim].wait(timeout=180)
        time.sleep(0.2)
    finally:
        for p in procs:   # the survivor waits for the dead rank (gloo, or its writer for a marker)
            if p.poll() is None:
                p.kill()
    outs = [p.communicate() for p in procs]
    assert procs[victim].returncode == -9, (point, victim, outs)
    assert f"rank {victim}: saved step1" in outs[victim][0], outs[victim]

    # step2 is complete once meta.json is; an asynchronous save is also complete when the rank killed is not
    # rank 0 and had written its marker (its files are all there: rank 0 commits them), if rank 0 wrote
    # meta.json before the test stopped it
    complete_step = 2 if (root / "step2" / "meta.json").exists() else 1
    may = point == "after meta.json" or (mode == "async" and victim != 0 and point == f"after .rank{victim}.done.json")
    assert (complete_step == 2) <= may and (complete_step == 2) >= (point == "after meta.json"), (point, complete_step)
    latest = cube.latest_checkpoint(root)
    assert latest == root / f"step{complete_step}", (point, latest, sorted(p.name for p in root.iterdir()))
    _check_equal(latest, torch.load(root / f"ref{complete_step}.pt", weights_only=True))
    refused = ""
    if complete_step == 1:
        with pytest.raises(ValueError, match="incomplete: meta.json is missing") as e:
            cube.merge_checkpoint(root / "step2")
        refused = str(e.value).split(": ", 1)[1].split(" (")[0]
    return {"mode": mode, "point": point, "rank": victim, "latest": latest.name, "lost": 0,
            "step2": "complete" if complete_step == 2 else f"refused ({refused})"}


def _check_equal(folder: Path, ref: dict) -> None:
    """The checkpoint holds exactly the run's state at the save: parameters, AdamW state, loader, step."""
    model, _ = build("mlp")
    state, opt_state = cube.merge_checkpoint(folder)
    assert state.keys() == ref["params"].keys()
    for name, t in ref["params"].items():
        assert torch.equal(state[name], t), name
    for i, (name, _) in enumerate(model.named_parameters()):
        for key, v in ref["opt"][name].items():
            assert torch.equal(opt_state["state"][i][key], v), (name, key)
    records = [torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(r["extra"] == {"step": ref["step"]} and r["data"]["state"] == ref["loader"] for r in records)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("fault-cache")   # one compile for every case


@pytest.mark.multirank
@pytest.mark.parametrize("mode,point,victim", tiered(CASES, IDS, slow=set(IDS) - FAST))
def test_a_rank_killed_in_a_save_loses_no_complete_checkpoint(mode, point, victim, tmp_path, cache):
    kill_and_check(tmp_path / "ckpt", cache, mode, point, victim)


def main() -> None:
    """Every kill point, one after another; prints the outcome table (Markdown)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rows = [kill_and_check(Path(d) / f"case{i}", Path(d) / "cache", *c) for i, c in enumerate(CASES)]
    print("| save | kill point | rank killed | newest complete | complete checkpoints lost | step2 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['point']} | {r['rank']} | {r['latest']} | {r['lost']} | {r['step2']} |")
    print(f"{len(rows)} kill points, {sum(r['lost'] for r in rows)} complete checkpoints lost, "
          f"{sum(r['step2'].startswith('refused') for r in rows)} partial ones refused")


if __name__ == "__main__":
    main()
