"""cube.Metrics: step time, tokens/s, MFU, peak memory, the printed line, CSV, TensorBoard, rich."""
import csv
import io
import re

import pytest
import torch
import torch.distributed as dist

import cube
import cube.debug
from cube.runtime import metrics as M
from tests.launch import ROOT, single

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Clock:
    """A fake ``time.perf_counter``: each ``tick(s)`` moves it ``s`` seconds on."""

    def __init__(self, monkeypatch, start=100.0):
        self.now = start
        monkeypatch.setattr(M.time, "perf_counter", lambda: self.now)

    def tick(self, seconds):
        self.now += seconds


@pytest.fixture
def world(monkeypatch):
    """Pretends torch.distributed is initialised with ``world(size, rank)``."""
    def set_world(size, rank=0):
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: size)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    return set_world


def _metrics(**kw):
    args = dict(tokens_per_step=1000, flops_per_token=1e9, log_every=1, rich=False)
    args.update(kw)
    return cube.Metrics(None, **args)


def test_rates_per_device_and_mfu_from_the_clock(monkeypatch, world):
    monkeypatch.setenv("CUBE_PEAK_TFLOPS", "2")
    world(4)
    clock = Clock(monkeypatch)
    m = _metrics()
    clock.tick(0.5)
    r = m.step(torch.tensor(2.5), grad_norm=torch.tensor(1.5))
    assert r["step"] == 0 and r["loss"] == 2.5 and r["grad_norm"] == 1.5
    assert r["step_time"] == pytest.approx(0.5)
    assert r["tokens_per_s"] == pytest.approx(2000)              # 1000 tokens / 0.5 s, all ranks
    assert r["tokens_per_s_per_device"] == pytest.approx(500)    # over 4 ranks
    assert r["tflops_per_device"] == pytest.approx(0.5)          # 1e9 FLOP/token x 500 tok/s
    assert r["mfu"] == pytest.approx(0.25)                       # 0.5 of 2 TFLOP/s
    assert r["peak_mem_gb"] > 0
    clock.tick(0.25)
    assert m.step(2.0)["tokens_per_s"] == pytest.approx(4000)
    assert [r["step"] for r in m.records] == [0, 1]
    assert m.records[1]["elapsed"] == pytest.approx(0.75)


def test_mfu_is_none_on_cpu_without_a_peak(monkeypatch, capsys):
    monkeypatch.delenv("CUBE_PEAK_TFLOPS", raising=False)
    clock = Clock(monkeypatch)
    m = _metrics()
    clock.tick(1.0)
    r = m.step(1.0)
    assert r["mfu"] is None and r["tflops_per_device"] == pytest.approx(1.0)
    assert "| MFU n/a |" in capsys.readouterr().out
    # an explicit peak wins over the environment
    monkeypatch.setenv("CUBE_PEAK_TFLOPS", "100")
    m = _metrics(peak_tflops=4)
    clock.tick(1.0)
    assert m.step(1.0)["mfu"] == pytest.approx(0.25)


def test_device_peak_table(monkeypatch):
    assert M.device_peak_tflops(torch.device("cpu")) is None
    for name, peak in [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
                       ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA L4", 121), ("NVIDIA L40S", 362),
                       ("Tesla V100-SXM2-16GB", 125), ("Some Future GPU", None)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert M.device_peak_tflops(torch.device("cuda", 0)) == peak, name


def test_plain_line_every_log_every_steps_averages_the_window(monkeypatch, capsys, world):
    monkeypatch.setenv("CUBE_PEAK_TFLOPS", "4")
    world(2)
    clock = Clock(monkeypatch)
    m = _metrics(log_every=2, loss_format=".6f")
    for seconds, loss, norm in [(0.5, 3.0, None), (1.5, 2.5, 1.25), (1.0, 2.0, None)]:
        clock.tick(seconds)
        m.step(loss, grad_norm=norm)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines   # step 1 only: the line after every 2 steps
    # the window of steps 0 and 1: 2000 tokens in 2 s, 500 per device, 0.5 TFLOP/s of 4
    assert re.fullmatch(r"step 1: loss 2\.500000 \| 1\.000 s/step \| 1,000 tok/s \(500 /dev\) \| MFU 12\.5% \| "
                        r"peak \d+\.\d\d GB \| grad 1\.25", lines[0]), lines[0]
    # the per-step records keep each step's own rate
    assert [r["tokens_per_s"] for r in m.records] == pytest.approx([2000, 1000 / 1.5, 1000])


def test_last_step_prints_and_other_ranks_stay_silent(monkeypatch, capsys, world):
    clock = Clock(monkeypatch)
    m = _metrics(log_every=10, total_steps=3, start_step=1)   # resumed at step 1: steps 1 and 2 remain
    for _ in range(2):
        clock.tick(0.1)
        m.step(1.0)
    out = capsys.readouterr().out
    assert out.startswith("step 2: loss 1.0000 | ") and out.count("\n") == 1, out
    world(2, rank=1)
    m = _metrics()
    clock.tick(0.1)
    assert m.step(1.0)["tokens_per_s"] == pytest.approx(10000)   # measured all the same
    assert capsys.readouterr().out == ""


def test_summary_leaves_out_the_first_step(monkeypatch):
    clock = Clock(monkeypatch)
    m = _metrics()
    assert m.summary()["steps"] == 0
    for seconds, loss in [(5.0, 4.0), (0.5, 3.0), (1.5, 2.0)]:   # the first step compiles
        clock.tick(seconds)
        m.step(loss)
    s = m.summary()
    assert s["steps"] == 3 and s["last"]["loss"] == 2.0 and s["last"]["step"] == 2
    assert s["mean"]["step_time"] == pytest.approx(1.0) and s["mean"]["loss"] == pytest.approx(2.5)
    assert s["mean"]["tokens_per_s"] == pytest.approx((2000 + 1000 / 1.5) / 2)
    assert s["mean"]["grad_norm"] is None and s["mean"]["mfu"] is None
    assert s["peak_mem_gb"] == max(r["peak_mem_gb"] for r in m.records)


def test_csv_rows_and_one_header(monkeypatch, tmp_path):
    monkeypatch.setenv("CUBE_PEAK_TFLOPS", "1")
    clock = Clock(monkeypatch)
    path = tmp_path / "m.csv"
    for run in range(2):   # a second run appends below the same header
        m = _metrics(csv=str(path), start_step=2 * run)
        for _ in range(2):
            clock.tick(0.5)
            m.step(1.0, grad_norm=0.5 if run else None)
    rows = list(csv.DictReader(path.open()))
    assert path.read_text().count("step,") == 1
    assert list(rows[0]) == list(M.FIELDS)
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    assert float(rows[0]["tokens_per_s"]) == pytest.approx(2000) and float(rows[0]["mfu"]) == pytest.approx(2.0)
    assert rows[0]["grad_norm"] == "" and float(rows[3]["grad_norm"]) == 0.5


def test_csv_on_rank_0_unless_the_path_names_the_rank(monkeypatch, tmp_path, world):
    world(2, rank=1)
    _metrics(csv=str(tmp_path / "shared.csv")).step(1.0)
    _metrics(csv=str(tmp_path / "r{rank}.csv")).step(1.0)
    assert not (tmp_path / "shared.csv").exists()
    assert len((tmp_path / "r1.csv").read_text().splitlines()) == 2


def test_tensorboard_scalars(monkeypatch):
    class Writer:
        def __init__(self, logdir):
            self.logdir, self.scalars, self.closed = logdir, [], False

        def add_scalar(self, tag, value, step):
            self.scalars.append((tag, value, step))

        def close(self):
            self.closed = True

    monkeypatch.setattr(M, "_require_tensorboard", lambda logdir: None)
    monkeypatch.setattr(M, "_summary_writer", Writer)
    clock = Clock(monkeypatch)
    m = _metrics(tensorboard="runs/x")
    clock.tick(0.5)
    m.step(3.0)
    writer = m._writer
    assert writer.logdir == "runs/x"
    tags = {tag: (value, step) for tag, value, step in writer.scalars}
    assert tags["train/loss"] == (3.0, 0) and tags["train/tokens_per_s"] == (pytest.approx(2000), 0)
    assert "train/grad_norm" not in tags and "train/mfu" not in tags   # not given / unknown peak
    m.close()
    assert writer.closed


def test_bad_arguments_are_clear_errors(monkeypatch):
    with pytest.raises(ValueError, match="log_every must be an integer >= 1"):
        _metrics(log_every=0)
    for tokens in (0, -5):
        with pytest.raises(ValueError, match="tokens_per_step must be a positive number"):
            _metrics(tokens_per_step=tokens)
    with pytest.raises(ValueError, match="pass the model .* or flops_per_token"):
        cube.Metrics(None, tokens_per_step=10)
    with pytest.raises(ValueError, match="peak_tflops must be positive"):
        _metrics(peak_tflops=0)
    monkeypatch.setenv("CUBE_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="CUBE_PEAK_TFLOPS must be a number"):
        _metrics()
    monkeypatch.delenv("CUBE_PEAK_TFLOPS")
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard"
                        else find_spec(name, *a))
    with pytest.raises(ValueError, match="needs the tensorboard package.*pip install tensorboard"):
        _metrics(tensorboard="runs")
    m = _metrics()
    with pytest.raises(ValueError, match="loss must be a scalar"):
        m.step(torch.ones(3))
    with pytest.raises(TypeError, match="tensor or a number, got str"):
        m.step("1.0")


def test_rich_progress_on_a_terminal(monkeypatch):
    from rich.console import Console
    monkeypatch.setenv("CUBE_PEAK_TFLOPS", "1")
    buf = io.StringIO()
    clock = Clock(monkeypatch)
    m = _metrics(rich=None, console=Console(file=buf, force_terminal=True, width=200), total_steps=2)
    for _ in range(2):
        clock.tick(0.5)
        m.step(2.0, grad_norm=1.0)
    raw = buf.getvalue()
    assert "\x1b[" in raw   # drawn with terminal control codes
    text = ANSI.sub("", raw)
    assert "step 0: loss 2.0000 | 0.500 s/step | 2,000 tok/s (2,000 /dev) | MFU 200.0% | peak" in text
    assert "step 1: loss 2.0000" in text
    assert "2/2" in text   # the bar reached the total and stopped
    assert m._view is None


def test_plain_when_stdout_is_not_a_terminal(monkeypatch, capsys):
    clock = Clock(monkeypatch)
    m = _metrics(rich=None)   # capsys: not a terminal
    assert m._view is None
    clock.tick(0.5)
    m.step(1.0)
    assert capsys.readouterr().out.startswith("step 0: loss 1.0000 | 0.500 s/step | 2,000 tok/s")


def test_rich_exactly_on_a_terminal_and_when_installed(monkeypatch):
    import importlib.util
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    clock = Clock(monkeypatch)
    monkeypatch.setattr(sys, "stdout", Terminal())
    m = _metrics(rich=None, total_steps=1)
    assert m._view is not None   # stdout is a terminal: a live bar
    clock.tick(0.5)
    m.step(1.0)
    assert m._view is None and "step 0: loss 1.0000" in ANSI.sub("", sys.stdout.getvalue())
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "rich" else find_spec(name, *a))
    assert _metrics(rich=None)._view is None   # no rich: plain lines
    with pytest.raises(ValueError, match="needs the rich package: `pip install rich`"):
        _metrics(rich=True)


def _tiny_gpt():
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return GPT(config), (ids, torch.roll(ids, -1, dims=1))


def test_flops_per_token_counts_the_single_device_model_once(tmp_path):
    """2 pipeline stages: each rank holds part of the GPT (the tied embedding on both);
    every rank's Metrics counts all its parameters, the tied weight once."""
    from cube.policies.pipeline import PAS1F1B
    user, batch = _tiny_gpt()
    want = sum(p.numel() for p in user.parameters())   # parameters() lists the tied weight once

    def rank():
        model, _ = _tiny_gpt()
        loader = iter([batch] * 8)

        @cube.compile(model, loader, PAS=PAS1F1B, cache_dir=str(tmp_path))
        def train_iter(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss

        gen = cube.load_model()
        local = sum(p.numel() for p in gen.parameters())
        return local, cube.Metrics(gen, tokens_per_step=32, rich=False).flops_per_token

    out = cube.debug.run(rank, 2)
    assert all(flops == 6 * want for _, flops in out), (out, want)
    assert all(local < want for local, _ in out), out   # no rank holds the whole model


def test_gpt_example_prints_throughput_mfu_and_memory(tmp_path):
    out = single(ROOT / "examples" / "gpt" / "train.py",
                 ["--layers", "1", "--dim", "64", "--seq", "16", "--batch", "4", "--steps", "3", "--clip", "1.0",
                  "--metrics-csv", tmp_path / "m.csv"],
                 {"CUBE_CACHE_DIR": str(tmp_path), "CUBE_PEAK_TFLOPS": "1"}).stdout
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 3, out
    for i, line in enumerate(lines):
        assert re.fullmatch(rf"step {i}: loss \d+\.\d{{6}} \| \d+\.\d{{3}} s/step \| [\d,]+ tok/s \([\d,]+ /dev\) \| "
                            r"MFU \d+\.\d% \| peak \d+\.\d\d GB \| grad \S+", line), line
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["peak_mem_gb"]) > 0 for r in rows)
