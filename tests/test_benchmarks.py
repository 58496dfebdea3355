"""The benchmark runner finds modules and reads its command line; no benchmark runs here (the GPU
recipes' steps are built and run once on the CPU, slow tier)."""
import importlib
import importlib.util

import pytest

runner = importlib.import_module("benchmarks.__main__")


def test_discovers_the_shipped_benchmarks_without_importing_them():
    found = runner.discover()
    assert found["parallel"] is None and found["compile_scaling"] is None
    assert list(found)[:2] == ["parallel", "compile_scaling"]


def test_modules_without_main_quick_are_skipped_with_the_reason(tmp_path):
    (tmp_path / "good.py").write_text("def main(quick=False):\n    return []\n")
    (tmp_path / "cli.py").write_text("def main(argv=None):\n    return 0\n")
    (tmp_path / "lib.py").write_text("X = 1\n")
    (tmp_path / "_private.py").write_text("def main(quick=False):\n    pass\n")
    found = runner.discover(tmp_path)
    assert found["good"] is None
    assert "takes no quick argument" in found["cli"]
    assert "no main(quick)" in found["lib"]
    assert "_private" not in found


def test_arguments():
    args = runner.parse_args(["--quick", "--only", "parallel"], ["parallel", "compile_scaling"])
    assert args.quick and args.only == ["parallel"] and not args.list
    assert runner.parse_args([], ["parallel"]).only is None


def test_unknown_benchmark_is_an_error_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        runner.parse_args(["--only", "nope"], ["parallel", "compile_scaling"])
    err = capsys.readouterr().err
    assert "nope" in err and "parallel, compile_scaling" in err


def test_summary_lists_ratios_and_exponents():
    rows = [{"benchmark": "x", "name": "a / b", "time_ratio": 0.9, "target": "<= 1.00", "ms_per_step": 3.0},
            {"benchmark": "x", "name": "growth", "total_exponent": 1.02}]
    got = runner.summary({"x": (rows, None)})
    assert got == [("x", "a / b", "time_ratio", 0.9, "<= 1.00"), ("x", "growth", "total_exponent", 1.02, "")]


def test_compile_scaling_helpers():
    cs = importlib.import_module("benchmarks.compile_scaling")
    assert cs.skip_reason(16, "PAS1F1B", 64) and cs.skip_reason(64, "PAS1F1B", 64) is None
    assert cs.skip_reason(4, "PASMegatronTP", 64) is None and cs.skip_reason(4, "PASData", 64) is None
    rows = [{"policy": "P", "ranks": 8, "nodes": n, "total": 2.0 * n} for n in (100, 1000, 10000)]
    assert cs.growth(rows)[("P", 8)] == pytest.approx(1.0)


@pytest.mark.parametrize("n", [2, 4])
def test_layouts_plans_move_the_optimal_bytes(n):
    lay = importlib.import_module("benchmarks.layouts")
    assert runner.discover()["layouts"] is None
    plans = {"D -> R": "all_gather", "V -> R": "all_reduce", "V -> D": "reduce_scatter",
             "D(0) -> D(1)": "all_to_all", f"D/{n} -> R/1": "exchange (3 sends)" if n == 4 else "exchange (1 send)",
             "R/1 -> D/2": "exchange (1 send)"}
    if n == 4:
        plans["D/2 -> D/4"] = "exchange (3 sends)"
    specs = lay.pairs(8 * n, 4 * n, n)
    assert set(specs) == set(plans)
    for name, spec in specs.items():
        kind, planned = lay.plan(spec)
        assert lay.describe(kind, planned) == plans[name], name
        sent = lay.bytes_sent(kind, planned)
        got = max(sent.values()) if spec["basis"] == "per rank" else sum(sent.values())
        assert got == pytest.approx(spec["optimum"]) and got > 0, name
    full = 8 * n * 4 * n * lay.ELEM
    assert specs["V -> R"]["optimum"] == pytest.approx(2 * (n - 1) / n * full)
    assert specs["R/1 -> D/2"]["optimum"] == full // 2


def test_sim_accuracy_reproducibility_ranks_runs_against_runs():
    acc = importlib.import_module("benchmarks.sim_accuracy")
    run = lambda meas, pred: [{"measured_ms": m, "loaded_ms": p} for m, p in zip(meas, pred)]   # noqa: E731
    runs = [run([1, 2, 3, 4], [1, 2, 3, 4]), run([1, 2, 4, 3], [2, 1, 3, 4]), run([1, 2, 3, 4], [1, 2, 3, 4])]
    rep = acc.reproducibility(runs)
    # measured against measured: each unordered pair of runs once
    assert rep["measured"] == pytest.approx([acc.spearman([1, 2, 3, 4], [1, 2, 4, 3]), 1.0,
                                             acc.spearman([1, 2, 4, 3], [1, 2, 3, 4])])
    # a prediction against every other run's measurement (ordered pairs)
    assert len(rep["predicted"]) == 6 and rep["predicted"][1] == pytest.approx(1.0)
    assert rep["predicted"][0] == pytest.approx(0.8)   # [1,2,3,4] against [1,2,4,3]


@pytest.mark.slow
def test_gpu_recipe_steps_build_and_run_on_the_cpu(tmp_path):
    """``python -m benchmarks.gpu --recipes --fp8`` times these steps on a GPU; here each is built on
    a small GPT on the CPU (float8 emulated) and runs one step, so the GPU's code path is exercised."""
    import torch
    gpu = importlib.import_module("benchmarks.gpu")
    model, batch = gpu.build(meta=False, layers=1, dim=32, heads=2, batch=2, seq=16, vocab=64)
    steps = gpu.recipe_steps(model, batch, str(tmp_path), torch.device("cpu"), fp8=True)
    expected = {"cube bf16", "cube bf16-autocast", "cube fp8"}
    if importlib.util.find_spec("torchao") is not None:
        expected |= {"eager bf16", "torchao fp8"}
    assert set(steps) == expected
    for step in steps.values():
        step()
