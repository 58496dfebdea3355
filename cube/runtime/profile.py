"""Profiling the compiled step with one switch: ``CUBE_PROFILE=torch`` or ``viztracer``.

The switch is a plan setting: compiled with it, the generated forward opens a
named region at each model line it runs (``runtime.profile.region("layers.0.attn
model.py:45")``), so the trace names the model's modules and source lines, not
only ATen ops. The compiled step records steps ``CUBE_PROFILE_STEPS`` (default
``2``: one warm step first; ``1-3`` for a range) into one trace file per rank
and step under ``CUBE_PROFILE_DIR`` (default ``./cube_traces``):
``rank{r}.step{n}.json`` (Chrome trace format: open it in Perfetto or
chrome://tracing). The pipeline executor's backward runs outside the regions
and appears under autograd's own names.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Iterator, Optional

import torch

log = logging.getLogger("cube")

MODES = ("torch", "viztracer")
_open = {"handle": None, "mode": None}


def mode() -> Optional[str]:
    """The profiler ``CUBE_PROFILE`` asks for (None when unset).

    Raises:
        ValueError: an unknown profiler name.
    """
    value = os.environ.get("CUBE_PROFILE", "").strip().lower()
    if not value or value in ("0", "off", "none"):
        return None
    if value not in MODES:
        raise ValueError(f"CUBE_PROFILE={value!r}: use one of {', '.join(MODES)} (or leave it unset)")
    return value


def steps() -> range:
    """The (0-based) step numbers to record, from ``CUBE_PROFILE_STEPS`` (``2`` or ``1-3``)."""
    value = os.environ.get("CUBE_PROFILE_STEPS", "2").strip()
    try:
        lo, _, hi = value.partition("-")
        return range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"CUBE_PROFILE_STEPS={value!r}: give a step number or a range such as 1-3") from None


def region(name: Optional[str]) -> None:
    """Closes the open region and opens ``name`` (None: just close). A no-op unless recording."""
    handle = _open["handle"]
    if handle is not None:
        handle.__exit__(None, None, None)
        _open["handle"] = None
    if name is None or _open["mode"] is None:
        return
    if _open["mode"] == "torch":
        handle = torch.autograd.profiler.record_function(name)
    else:
        from viztracer import get_tracer
        handle = get_tracer().log_event(name)
    handle.__enter__()
    _open["handle"] = handle


@contextlib.contextmanager
def record(rank: int, step: int) -> Iterator[Optional[Path]]:
    """Records one step into ``CUBE_PROFILE_DIR/rank{rank}.step{step}.json`` when asked to."""
    which = mode()
    if which is None or step not in steps():
        yield None
        return
    folder = Path(os.environ.get("CUBE_PROFILE_DIR", "cube_traces"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.step{step}.json"
    _open["mode"] = which
    try:
        if which == "torch":
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities, record_shapes=True) as prof:
                yield path
            prof.export_chrome_trace(str(path))
        else:
            try:
                from viztracer import VizTracer
            except ImportError:
                raise ValueError("CUBE_PROFILE=viztracer needs viztracer: pip install viztracer") from None
            tracer = VizTracer(output_file=str(path), verbose=0)
            tracer.start()
            try:
                yield path
            finally:
                tracer.stop()
                tracer.save()
    finally:
        region(None)
        _open["mode"] = None
    log.info("cube: rank %d step %d profile written to %s", rank, step, path)
