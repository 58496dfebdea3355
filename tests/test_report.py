"""The plan report: per-rank text and pictures, made in one process without launching."""
import xml.etree.ElementTree as ET

import cube
from tests.models import build


def test_report_of_a_pipeline_with_tensor_parallel_stages(tmp_path):
    model, sample = build("gpt_nobias")
    paths = cube.explain(model, sample, "tests/extra_policies.py:PAS1F1BTensor", 4, tmp_path)
    assert sorted(p.name for p in paths) == ["placement.svg", "plan.txt", "schedule.svg"]
    text = (tmp_path / "plan.txt").read_text()
    assert text.startswith("plan of GPT: 4 ranks")
    for r in range(4):
        assert f"== rank {r}" in text
    # pieces, partial sums and the collective that completes them, with their ranks
    assert "layers.0.attn.q_proj.weight[0:16, :]" in text
    assert "(partial sum)" in text and "all_reduce           linear_3  ranks=(0, 1)" in text
    assert "schedule: F0 F1 B0" in text or "schedule: F0 F1 F2" in text
    for name in ("placement.svg", "schedule.svg"):
        root = ET.parse(tmp_path / name).getroot()   # well-formed SVG
        assert root.tag.endswith("svg") and len(root) > 4
    placement = (tmp_path / "placement.svg").read_text()
    assert "layers.1.mlp.c_fc.weight [128, 32]" in placement


def test_report_of_data_parallel_lists_gradient_sums(tmp_path):
    model, sample = build("mlp")
    cube.explain(model, sample, "cube.policies.data:PASData", 2, tmp_path, zero=3)
    text = (tmp_path / "plan.txt").read_text()
    assert "ZeRO-3" in text.splitlines()[0]
    assert "gradients summed after backward (reducer):" in text and "over (0, 1)" in text
    assert not (tmp_path / "schedule.svg").exists()


def test_compile_logs_phases_cache_and_plan_summary_once(tmp_path, caplog):
    import logging

    from tests.parity import compile_step
    model, sample = build("mlp")
    with caplog.at_level(logging.INFO, logger="cube"):
        compile_step(model, iter([sample]), "cube.policies.single:PASSingle", tmp_path)
        compile_step(model, iter([sample]), "cube.policies.single:PASSingle", tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "cube"]
    assert sum("compiled plan" in m and "trace" in m and "codegen" in m for m in lines) == 1, lines
    assert sum("reused plan" in m for m in lines) == 1, lines
    assert sum(m.startswith("cube: plan: rank 0 holds 8 parameters") for m in lines) == 2, lines


def test_quiet_by_default(tmp_path, capsys):
    from tests.parity import compile_step
    model, sample = build("mlp")
    compile_step(model, iter([sample]), "cube.policies.single:PASSingle", tmp_path)
    captured = capsys.readouterr()
    assert "cube:" not in captured.out and "cube:" not in captured.err
