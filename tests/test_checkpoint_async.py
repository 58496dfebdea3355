"""Asynchronous saves (``save_checkpoint(..., async_save=True)``): what they write, when they wait, how they fail.

An asynchronous save writes the files a synchronous one writes (byte for byte but ``meta.json``'s
token and time), holds the state of the moment it was called although training goes on, is waited
for by the next save and ``cube.wait_checkpoint()``, and reports a failure in its writer thread at
the next of those calls, leaving a directory no reader takes for a checkpoint. On 2 ranks of the
in-process world the ranks' writers meet through marker files, not the process group.
``python -m benchmarks.checkpoint`` measures the step-time stall of both kinds.
"""
from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch

import cube
import cube.debug
from cube.runtime import checkpoint_write as writer
from cube.runtime.data import ShuffledBatches
from policies.single import PASSingle
from tests.models import build
from tests.parity import compile_step


@pytest.fixture
def fault(monkeypatch):
    """Sets ``checkpoint_write.FAULT`` for the test."""
    def set_(fn):
        monkeypatch.setattr(writer, "FAULT", fn)
    return set_


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    model, sample = build("mlp")
    data = tuple(torch.cat([t] * 4) for t in sample)
    loader = ShuffledBatches(data, sample[0].shape[0], seed=1)
    step = compile_step(model, loader, PASSingle, d / "cache")
    gen = cube.load_model()
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)

    def train(n=1):
        for _ in range(n):
            step(gen, loader)
            opt.step()
            opt.zero_grad()
    train()
    return d, gen, opt, loader, train


def _files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")}


def test_async_writes_what_sync_writes(trained, tmp_path):
    _, gen, opt, loader, _ = trained
    state = torch.get_rng_state()
    cube.save_checkpoint(tmp_path / "sync", gen, opt, extra={"step": 1}, dataloader=loader)
    torch.set_rng_state(state)
    cube.save_checkpoint(tmp_path / "async", gen, opt, extra={"step": 1}, dataloader=loader, async_save=True)
    cube.wait_checkpoint()
    a, b = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sorted(a) == sorted(b) == ["meta.json", "rank0.pt", "rank0.safetensors"]
    assert a["rank0.safetensors"] == b["rank0.safetensors"] and a["rank0.pt"] == b["rank0.pt"]
    meta_a, meta_b = json.loads(a["meta.json"]), json.loads(b["meta.json"])
    assert meta_a["files"] == meta_b["files"] and meta_a["token"] != meta_b["token"]
    assert not [p for p in (tmp_path / "async").iterdir() if p.name.startswith(".")]   # markers removed
    assert cube.latest_checkpoint(tmp_path) == tmp_path / "async"


def test_async_keeps_the_state_of_the_call(trained, tmp_path, fault):
    """Training changes the parameters and optimizer state while the writer still writes."""
    _, gen, opt, _, train = trained
    go = threading.Event()
    fault(lambda point: go.wait(10) if point == "before rank0.safetensors" else None)
    want = {k: v.detach().clone() for k, v in gen.state_dict().items()}
    want_opt = copy.deepcopy(opt.state_dict())
    cube.save_checkpoint(tmp_path / "ckpt", gen, opt, async_save=True)
    assert writer.pending(0) and not (tmp_path / "ckpt" / "meta.json").exists()
    train(2)
    go.set()
    cube.wait_checkpoint()
    fresh = copy.deepcopy(gen)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(opt.state_dict())
    cube.load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k]), k
    got = fresh_opt.state_dict()["state"]
    for i, st in want_opt["state"].items():
        assert all(torch.equal(st[key], got[i][key]) for key in st), i


def test_next_save_waits_for_the_previous(trained, tmp_path, fault):
    _, gen, opt, _, _ = trained
    seen = []

    def slow(point):
        seen.append(point)
        if point == "before rank0.pt":
            time.sleep(0.3)
    fault(slow)
    cube.save_checkpoint(tmp_path / "a", gen, opt, async_save=True)
    cube.save_checkpoint(tmp_path / "b", gen, opt)
    assert seen.index("after meta.json") < seen.index("before rank0.safetensors", 1)
    assert writer.complete(tmp_path / "a") and writer.complete(tmp_path / "b")
    cube.wait_checkpoint()   # nothing in flight: returns at once


def test_a_failure_in_the_background_surfaces_at_the_next_call(trained, tmp_path, fault):
    _, gen, opt, _, _ = trained
    cube.save_checkpoint(tmp_path / "good", gen, opt)

    def full(point):
        if point == "during rank0.safetensors":
            raise OSError(28, "No space left on device")
    fault(full)
    cube.save_checkpoint(tmp_path / "bad", gen, opt, async_save=True)   # returns: the failure comes later
    with pytest.raises(cube.CheckpointError, match="No space left on device.*previous complete one stands"):
        cube.save_checkpoint(tmp_path / "next", gen, opt)
    assert not (tmp_path / "next").exists()   # the failed call saved nothing
    with pytest.raises(ValueError, match="incomplete: meta.json is missing"):
        cube.load_checkpoint(tmp_path / "bad", gen)
    assert not [p for p in (tmp_path / "bad").iterdir() if p.name.endswith(".tmp")]   # temporary file removed
    assert cube.latest_checkpoint(tmp_path) == tmp_path / "good"
    cube.wait_checkpoint()   # reported once

    cube.save_checkpoint(tmp_path / "bad2", gen, opt, async_save=True)
    with pytest.raises(cube.CheckpointError, match="No space left"):
        cube.wait_checkpoint()


@pytest.mark.multirank
@pytest.mark.parametrize("zero", [0, 3])
def test_two_ranks_commit_through_markers(tmp_path, zero):
    """2 ranks in one process: each writer writes its files and marker; rank 0's writes meta.json.
    Under ZeRO-3 the copies are taken while the parameters are gathered whole."""
    from policies.data import PASData
    model, sample = build("mlp")

    def body():
        loader = ShuffledBatches(tuple(torch.cat([t] * 2) for t in sample), sample[0].shape[0], seed=1)
        step = compile_step(copy.deepcopy(model), loader, PASData, tmp_path / "cache", zero=zero)
        gen = cube.load_model()
        opt = cube.build_optimizer(gen, torch.optim.SGD, zero=zero, lr=0.1)
        step(gen, loader)
        opt.step()
        cube.save_checkpoint(tmp_path / "sync", gen, opt, dataloader=loader)
        cube.save_checkpoint(tmp_path / "async", gen, opt, dataloader=loader, async_save=True)
        step(gen, loader)   # a collective while the writers write
        opt.step()
        cube.wait_checkpoint()
        return gen.state_dict()
    cube.debug.run(body, 2)
    sync, async_ = cube.merge_checkpoint(tmp_path / "sync"), cube.merge_checkpoint(tmp_path / "async")
    for k in sync[0]:
        assert torch.equal(sync[0][k], async_[0][k]), k
    assert sync[1]["param_groups"] == async_[1]["param_groups"]
    meta = json.loads((tmp_path / "async" / "meta.json").read_text())
    assert sorted(meta["files"]) == [f"rank{r}.{k}" for r in range(2) for k in ("pt", "safetensors")]
    assert not [p for p in (tmp_path / "async").iterdir() if p.name.startswith(".")]


def test_latest_checkpoint_skips_partial_saves(trained, tmp_path):
    _, gen, opt, _, _ = trained
    assert cube.latest_checkpoint(tmp_path) is None
    for name in ("step9", "step10", "step11"):
        cube.save_checkpoint(tmp_path / name, gen, opt)
    assert cube.latest_checkpoint(tmp_path) == tmp_path / "step11"
    (tmp_path / "step11" / "meta.json").unlink()   # a save cut short
    with open(tmp_path / "step10" / "rank0.safetensors", "ab") as f:   # a file cut or grown after the save
        f.write(b"x")
    assert cube.latest_checkpoint(tmp_path) == tmp_path / "step9"
    assert cube.latest_checkpoint(tmp_path / "step9") == tmp_path / "step9"   # a checkpoint directory itself
    with pytest.raises(ValueError, match="not a directory"):
        cube.latest_checkpoint(tmp_path / "nowhere")


def test_ranks_must_pass_one_path(tmp_path):
    from policies.data import PASData
    model, sample = build("mlp")

    def body():
        loader = iter([sample] * 2)
        compile_step(copy.deepcopy(model), loader, PASData, tmp_path / "cache")
        gen = cube.load_model()
        cube.save_checkpoint(tmp_path / f"rank{cube.debug.rank()}", gen)
    with pytest.raises(RuntimeError, match="the ranks passed different paths"):
        cube.debug.run(body, 2)
