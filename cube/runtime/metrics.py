"""Training metrics, measured once per step: time, throughput, MFU, peak memory, loss, gradient norm.

    metrics = cube.Metrics(model, tokens_per_step=batch * seq, log_every=10, total_steps=steps)
    for step in range(steps):
        loss = train_iter(model, dataloader)
        norm = cube.clip_grad_norm_(model, 1.0, optimizer=optimizer)
        optimizer.step(); optimizer.zero_grad()
        metrics.step(loss, grad_norm=norm)
    print(metrics.summary())

Each record (``metrics.records``, one dict per step, every rank) holds:

- ``step``: the step's index (``start_step`` for the first call);
- ``loss``, ``grad_norm``: as given (None when not given);
- ``step_time``: wall seconds since the previous call (the first: since the
  ``Metrics`` was made, so it includes compile and warm-up). On CUDA the clock is
  read after ``torch.cuda.synchronize``;
- ``tokens_per_s``: ``tokens_per_step / step_time``, over all ranks;
  ``tokens_per_s_per_device``: that over the world size;
- ``tflops_per_device``: achieved model TFLOP/s per device,
  ``flops_per_token * tokens_per_s_per_device / 1e12``;
- ``mfu``: that over the device's peak (a fraction; None when the peak is unknown);
- ``peak_mem_gb``: this rank's peak memory so far, GB (10**9 bytes):
  ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak resident
  set size (``resource.getrusage``);
- ``elapsed``: seconds since the ``Metrics`` was made.

Model FLOPs: ``flops_per_token`` defaults to ``6 * N`` with ``N`` the number of
parameters of the single-device model (2 FLOPs per parameter per token forward,
4 backward; the attention score term and recompute are not counted, embeddings
are). The peak is ``peak_tflops=``, else ``CUBE_PEAK_TFLOPS``, else the dense
bf16/fp16 number of a known CUDA device (:data:`PEAK_TFLOPS`); on CPU or an
unknown GPU MFU is "n/a".
"""
from __future__ import annotations

import atexit
import contextlib
import csv as _csv
import math
import os
import sys
import time
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from cube import config

# substring of torch.cuda.get_device_name() -> dense bf16/fp16 TFLOP/s of one device; first match wins
PEAK_TFLOPS: Tuple[Tuple[str, float], ...] = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),     # SXM
    ("H200", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),     # before "L4", which they contain
    ("L40", 181.0),
    ("L4", 121.0),
    ("V100", 125.0),     # fp16 tensor cores
)

FIELDS = ("step", "loss", "grad_norm", "step_time", "tokens_per_s", "tokens_per_s_per_device",
          "tflops_per_device", "mfu", "peak_mem_gb", "elapsed")
_AVERAGED = ("loss", "grad_norm", "step_time", "tokens_per_s", "tokens_per_s_per_device", "tflops_per_device",
             "mfu")


def device_peak_tflops(device: torch.device) -> Optional[float]:
    """Dense bf16/fp16 TFLOP/s of one ``device`` from :data:`PEAK_TFLOPS`; None on CPU or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_TFLOPS:
        if key in name:
            return tflops
    return None


def model_parameters(model: torch.nn.Module) -> int:
    """Parameters of the single-device model.

    For a module from ``cube.load_model()``: every parameter named in any rank's
    ``PARAMS`` table counted once, at its full shape (``FULL_SHAPES``); the
    names of a tied weight count once. Collective when the world is larger than
    one (every rank calls it). For any other module: its parameters' sizes.
    """
    params = getattr(type(model), "PARAMS", None)
    shapes = getattr(type(model), "FULL_SHAPES", None)
    if params is None or shapes is None:
        return sum(p.numel() for p in model.parameters())
    mine = [(list(names), tuple(shapes[names[0]])) for names, _ in params.values()]
    every = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    seen, total = set(), 0
    for entries in every:
        for names, shape in entries:
            if not seen.isdisjoint(names):
                continue
            seen.update(names)
            total += math.prod(shape)
    return total


def _number(value, what: str) -> Optional[float]:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Metrics.step: {what} must be a scalar, got a tensor of shape {tuple(value.shape)}: "
                             f"pass loss.mean() or the float")
        return float(value.detach().float().item())
    if isinstance(value, (int, float)):
        return float(value)
    raise TypeError(f"Metrics.step: {what} must be a tensor or a number, got {type(value).__name__}")


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9   # bytes on macOS, KiB on Linux


def _require_tensorboard(logdir: str) -> None:
    import importlib.util
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"Metrics(tensorboard={logdir!r}) needs the tensorboard package, which is not installed: "
                         f"`pip install tensorboard`, or leave tensorboard=None")


def _summary_writer(logdir: str):
    """A TensorBoard ``SummaryWriter`` writing into ``logdir``."""
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir=logdir)


def _fmt(value: Optional[float], spec: str, none: str = "n/a") -> str:
    return none if value is None else format(value, spec)


class Metrics:
    """Measures and reports every training step; call :meth:`step` once after each optimizer step.

    Every rank measures and keeps its records; only rank 0 prints and writes the
    outputs. Every ``log_every`` steps rank 0 shows one line: the step's loss
    and gradient norm, and time, throughput and MFU averaged over the steps
    since the previous line::

        step 19: loss 5.1234 | 0.123 s/step | 13,245 tok/s (3,311 /dev) | MFU 41.2% | peak 3.21 GB | grad 1.23

    On a terminal the lines are drawn with ``rich`` under a live progress bar;
    otherwise they are plain ``print`` lines (flushed).

    Args:
        model: the module from ``cube.load_model()`` (or any module): its
            device, and its parameter count for the default ``flops_per_token``
            (counting is collective: every rank makes its ``Metrics``). May be
            None when ``flops_per_token`` is given.
        tokens_per_step: tokens of the global batch in one step (batch x sequence).
        flops_per_token: model FLOPs per token, forward and backward; default
            ``6 * parameters of the single-device model``.
        log_every: steps between lines.
        csv: a CSV file that gets one row per step (header written once, rows
            appended) on rank 0; with ``{rank}`` in the path every rank writes its own.
        tensorboard: a directory for TensorBoard scalars (rank 0; needs the
            ``tensorboard`` package).
        total_steps: the index the loop stops before (the progress bar's total).
        start_step: the first step's index (a resumed run).
        peak_tflops: one device's peak TFLOP/s for MFU; default ``CUBE_PEAK_TFLOPS``,
            else :data:`PEAK_TFLOPS` by the CUDA device's name.
        loss_format: format spec of the loss in the line.
        rich: draw with rich (True), print plain lines (False), or rich exactly
            when stdout is a terminal (None; plain lines where rich is not installed).
        console: the ``rich.console.Console`` to draw on (implies ``rich``).

    Raises:
        ValueError: a non-positive ``tokens_per_step``, ``flops_per_token`` or
            ``peak_tflops``, ``log_every`` < 1, no model and no
            ``flops_per_token``, or ``tensorboard`` / ``rich=True`` without the package.
    """

    def __init__(self, model: Optional[torch.nn.Module], tokens_per_step: Union[int, float],
                 flops_per_token: Optional[float] = None, log_every: int = 10, csv: Optional[str] = None,
                 tensorboard: Optional[str] = None, total_steps: Optional[int] = None, start_step: int = 0,
                 peak_tflops: Optional[float] = None, loss_format: str = ".4f", rich: Optional[bool] = None,
                 console=None):
        if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
            raise ValueError(f"Metrics: log_every must be an integer >= 1 (steps between lines), got {log_every!r}")
        if not isinstance(tokens_per_step, (int, float)) or tokens_per_step <= 0:
            raise ValueError(f"Metrics: tokens_per_step must be a positive number (global batch x sequence "
                             f"length), got {tokens_per_step!r}")
        if flops_per_token is not None and flops_per_token <= 0:
            raise ValueError(f"Metrics: flops_per_token must be positive, or None for 6 x parameters, "
                             f"got {flops_per_token!r}")
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"Metrics: peak_tflops must be positive, or None to look the device up, "
                             f"got {peak_tflops!r}")
        if model is None and flops_per_token is None:
            raise ValueError("Metrics: pass the model (from cube.load_model()) or flops_per_token, "
                             "to know the FLOPs of a step")
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"Metrics: total_steps must be >= 1 or None, got {total_steps!r}")
        if tensorboard is not None:
            _require_tensorboard(str(tensorboard))   # on every rank, before the collective count below
        use_rich = _use_rich(rich, console)
        self.tokens_per_step = float(tokens_per_step)
        self.log_every, self.total_steps, self.loss_format = log_every, total_steps, loss_format
        self.device = self._device(model)
        self.rank, self.world_size = 0, 1
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.flops_per_token = float(flops_per_token) if flops_per_token is not None \
            else 6.0 * model_parameters(model)
        peak = peak_tflops if peak_tflops is not None else config.peak_tflops()
        self.peak_tflops = peak if peak is not None else device_peak_tflops(self.device)
        self.records: List[Dict[str, Optional[float]]] = []
        self._next_step = start_step
        self._logged = 0   # records already summed into a line
        self._csv = None
        if csv is not None and ("{rank}" in str(csv) or self.rank == 0):
            self._csv = str(csv).replace("{rank}", str(self.rank))
        self._writer = _summary_writer(str(tensorboard)) if tensorboard is not None and self.rank == 0 else None
        self._view = None
        if self.rank == 0 and use_rich:
            self._view = _RichView(console, total_steps, start_step)
        self._sync()
        self._start = self._last = time.perf_counter()

    @staticmethod
    def _device(model) -> torch.device:
        if model is None:
            return torch.device("cpu")
        device = getattr(model, "device", None)
        if isinstance(device, torch.device):
            return device
        for p in model.parameters():
            return p.device
        return torch.device("cpu")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ per step
    def step(self, loss=None, grad_norm=None) -> Dict[str, Optional[float]]:
        """Records one step (call it after the optimizer step) and reports it when due.

        Args:
            loss: the step's loss (a scalar tensor or a number; None: not shown).
            grad_norm: the gradient norm, e.g. what ``cube.clip_grad_norm_`` returns.

        Returns:
            The step's record (see the module docstring).
        """
        loss_value, norm = _number(loss, "loss"), _number(grad_norm, "grad_norm")
        self._sync()
        now = time.perf_counter()
        step_time, self._last = now - self._last, now
        tokens_per_s = self.tokens_per_step / step_time if step_time > 0 else None
        record = {"step": self._next_step, "loss": loss_value, "grad_norm": norm, "step_time": step_time,
                  "elapsed": now - self._start, "peak_mem_gb": _peak_memory_gb(self.device)}
        record.update(self._rates(tokens_per_s))
        self._next_step += 1
        self.records.append(record)
        if self._csv is not None:
            self._write_csv(record)
        if self._writer is not None:
            for key in FIELDS[1:]:
                if record[key] is not None:
                    self._writer.add_scalar(f"train/{key}", record[key], record["step"])
        if self.rank == 0:
            due = (record["step"] + 1) % self.log_every == 0 or \
                (self.total_steps is not None and record["step"] + 1 >= self.total_steps)
            if due:
                self._report(self.line())
                self._logged = len(self.records)
            if self._view is not None:
                self._view.advance(record["step"] + 1, self._short(record))
                if self.total_steps is not None and record["step"] + 1 >= self.total_steps:
                    self.close()
        return record

    def _rates(self, tokens_per_s: Optional[float]) -> Dict[str, Optional[float]]:
        if tokens_per_s is None:
            return {"tokens_per_s": None, "tokens_per_s_per_device": None, "tflops_per_device": None, "mfu": None}
        per_device = tokens_per_s / self.world_size
        tflops = self.flops_per_token * per_device / 1e12
        return {"tokens_per_s": tokens_per_s, "tokens_per_s_per_device": per_device, "tflops_per_device": tflops,
                "mfu": tflops / self.peak_tflops if self.peak_tflops else None}

    def line(self) -> str:
        """The line of the last step: its loss and gradient norm, time, throughput and MFU over the steps
        since the previous line."""
        if not self.records:
            return "no step recorded yet"
        window = self.records[self._logged:] or self.records[-1:]
        last = window[-1]
        seconds = sum(r["step_time"] for r in window)
        rates = self._rates(len(window) * self.tokens_per_step / seconds if seconds > 0 else None)
        parts = [f"step {last['step']}: loss {_fmt(last['loss'], self.loss_format)}",
                 f"{seconds / len(window):.3f} s/step",
                 f"{_fmt(rates['tokens_per_s'], ',.0f')} tok/s ({_fmt(rates['tokens_per_s_per_device'], ',.0f')} /dev)",
                 f"MFU {_fmt(None if rates['mfu'] is None else 100 * rates['mfu'], '.1f')}"
                 f"{'' if rates['mfu'] is None else '%'}",
                 f"peak {last['peak_mem_gb']:.2f} GB"]
        if last["grad_norm"] is not None:
            parts.append(f"grad {last['grad_norm']:.3g}")
        return " | ".join(parts)

    def _short(self, record) -> str:
        mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
        return (f"loss {_fmt(record['loss'], self.loss_format)} | {_fmt(record['tokens_per_s'], ',.0f')} tok/s | "
                f"MFU {mfu}")

    def _report(self, line: str) -> None:
        if self._view is not None:
            self._view.print(line)
        else:
            print(line, flush=True)

    def _write_csv(self, record) -> None:
        new = not os.path.exists(self._csv) or os.path.getsize(self._csv) == 0
        with open(self._csv, "a", newline="") as f:
            writer = _csv.writer(f)
            if new:
                writer.writerow(FIELDS)
            writer.writerow(["" if record[k] is None else record[k] for k in FIELDS])

    @contextlib.contextmanager
    def paused(self):
        """Leaves the time spent inside out of the next step's time (an evaluation or a checkpoint
        between steps), so step time, tokens/s and MFU measure training alone::

            with metrics.paused():
                val_loss = evaluate(...)
        """
        self._sync()
        start = time.perf_counter()
        try:
            yield self
        finally:
            self._sync()
            self._last += time.perf_counter() - start

    # ------------------------------------------------------------------ results
    def summary(self) -> Dict[str, object]:
        """The last record and averages.

        Returns:
            ``{"steps": n, "last": last record, "mean": {field: mean}, "peak_mem_gb": max}``;
            the means leave out the first step (compile and warm-up) when there are
            others, and are None for a field never given.
        """
        if not self.records:
            return {"steps": 0, "last": None, "mean": {k: None for k in _AVERAGED}, "peak_mem_gb": None}
        steady = self.records[1:] or self.records
        mean = {}
        for key in _AVERAGED:
            values = [r[key] for r in steady if r[key] is not None]
            mean[key] = sum(values) / len(values) if values else None
        return {"steps": len(self.records), "last": dict(self.records[-1]), "mean": mean,
                "peak_mem_gb": max(r["peak_mem_gb"] for r in self.records)}

    def close(self) -> None:
        """Stops the progress bar and closes the TensorBoard writer (also done after ``total_steps``)."""
        if self._view is not None:
            self._view.close()
            self._view = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _use_rich(rich: Optional[bool], console) -> bool:
    """Whether to draw with rich: as asked, else when given a console or stdout is a terminal
    (and rich is installed: without it, plain lines)."""
    import importlib.util
    installed = importlib.util.find_spec("rich") is not None
    if rich or (rich is None and console is not None):
        if not installed:
            raise ValueError("Metrics(rich=True) or a console needs the rich package: `pip install rich`, "
                             "or leave rich=None for plain lines")
        return True
    if rich is False:
        return False
    try:
        return installed and sys.stdout.isatty()
    except (AttributeError, ValueError):   # stdout replaced or closed
        return False


class _RichView:
    """A live rich progress bar (with the latest step's fields) and the log lines printed above it."""

    def __init__(self, console, total: Optional[int], start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, \
            TimeElapsedColumn, TimeRemainingColumn
        console = console if console is not None else Console()
        columns = [TextColumn("[bold]train"), BarColumn() if total else SpinnerColumn(),
                   MofNCompleteColumn() if total else TextColumn("{task.completed} steps"),
                   TimeElapsedColumn()] + ([TimeRemainingColumn()] if total else []) + \
            [TextColumn("{task.fields[stats]}")]
        self.progress = Progress(*columns, console=console)
        self.task = self.progress.add_task("train", total=total, completed=start, stats="")
        self.progress.start()
        atexit.register(self.close)   # a loop left early still gives the terminal its cursor back

    def advance(self, done: int, stats: str) -> None:
        self.progress.update(self.task, completed=done, stats=stats)

    def print(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False)

    def close(self) -> None:
        self.progress.stop()
        atexit.unregister(self.close)
