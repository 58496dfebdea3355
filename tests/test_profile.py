"""CUBE_PROFILE: one switch records chosen steps into a trace file per rank, with model names."""
import json

import pytest

import cube
from tests.models import build
from tests.parity import compile_step


def _profile(tmp_path, monkeypatch, which):
    monkeypatch.setenv("CUBE_PROFILE", which)
    monkeypatch.setenv("CUBE_PROFILE_DIR", str(tmp_path / "traces"))
    monkeypatch.setenv("CUBE_PROFILE_STEPS", "1")
    model, sample = build("mlp")
    step = compile_step(model, iter([sample] * 3), "cube.policies.single:PASSingle", tmp_path / "cache")
    gen = cube.load_model()
    assert "runtime.profile.region('layers.0 " in step.source   # regions named after the model
    for _ in range(3):
        step(gen, iter([sample]))
    files = sorted((tmp_path / "traces").iterdir())
    assert [f.name for f in files] == ["rank0.step1.json"]   # only the asked-for step
    return json.loads(files[0].read_text())


def test_torch_profiler_trace_names_model_lines(tmp_path, monkeypatch):
    trace = _profile(tmp_path, monkeypatch, "torch")
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("layers.0 linears.py:") for n in names), sorted(names)[:20]
    assert any("aten::linear" in n or "aten::addmm" in n for n in names)


def test_viztracer_trace_names_model_lines(tmp_path, monkeypatch):
    pytest.importorskip("viztracer")
    trace = _profile(tmp_path, monkeypatch, "viztracer")
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any(n.startswith("layers.0 linears.py:") for n in names), sorted(names)[:20]


def test_unknown_profiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CUBE_PROFILE", "nsys")
    with pytest.raises(ValueError, match="CUBE_PROFILE='nsys': use one of torch, viztracer"):
        cube.runtime.profile.mode()
