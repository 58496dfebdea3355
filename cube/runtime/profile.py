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

The open region and the recording belong to the running program's runtime
state (``cube.runtime.session``): the compiled step records inside it.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional

import torch

from cube import config
from cube.runtime import session
from cube.runtime.compiled import outside_graph

log = logging.getLogger("cube")

MODES = config.PROFILERS


def mode() -> Optional[str]:
    """The profiler ``CUBE_PROFILE`` asks for (None when unset).

    Raises:
        ValueError: an unknown profiler name.
    """
    return config.profiler()


def steps() -> range:
    """The (0-based) step numbers to record, from ``CUBE_PROFILE_STEPS`` (``2`` or ``1-3``)."""
    return config.profile_steps()


@outside_graph
def region(name: Optional[str]) -> None:
    """Closes the open region and opens ``name`` (None: just close). A no-op unless recording."""
    rec = session.current().profile
    handle = rec["handle"]
    if handle is not None:
        handle.__exit__(None, None, None)
        rec["handle"] = None
    if name is None or rec["mode"] is None:
        return
    if rec["mode"] == "torch":
        handle = torch.autograd.profiler.record_function(name)
    else:
        from viztracer import get_tracer
        handle = get_tracer().log_event(name)
    handle.__enter__()
    rec["handle"] = handle


@contextlib.contextmanager
def record(rank: int, step: int) -> Iterator[Optional[Path]]:
    """Records one step into ``CUBE_PROFILE_DIR/rank{rank}.step{step}.json`` when asked to."""
    which = mode()
    if which is None or step not in steps():
        yield None
        return
    rec = session.current().profile
    folder = config.profile_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.step{step}.json"
    rec["mode"] = which
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
        rec["mode"] = None
    log.info("cube: rank %d step %d profile written to %s", rank, step, path)
