"""The simulator's prediction as data: what ``python -m cube.sim ... --json`` prints."""
from __future__ import annotations

from typing import Optional

from cube.sim.hardware import mfu_precision
from cube.sim.simulate import SimResult

GIB = 2**30


def prediction(result: SimResult, hardware, ngpus: int, precision: Optional[str], seconds: float,
               policy: Optional[str] = None, options: Optional[dict] = None) -> dict:
    """``step_time_s``, ``peak_memory_gib``, ``seconds`` (wall time of the prediction), the model FLOPs
    of a step, TFLOP/s per device and MFU against the profile's peak (``mfu_peak``: bf16's under fp8;
    None on this host), and per
    simulated rank its compute, blocking communication and idle (bubble) seconds and its peak memory.

    With a symmetric simulation the ranks listed are those simulated (one per class), numbered in
    the real world; ``symmetry`` says how the world was folded."""
    step = result.step_time
    peak = None
    if not hardware.is_host:   # fp8: against the bf16 peak (mfu_precision)
        peak = hardware.peak_flops(mfu_precision(precision or "fp32"))
    tflops = result.model_flops / step / ngpus / 1e12 if step > 0 else 0.0
    fold = result.fold
    ranks = {}
    for r, s in sorted(result.ranks.items()):
        comm = max(s.comm - s.waiting, 0.0)
        ranks[str(result.real_rank(r))] = {"end_s": s.end, "compute_s": s.compute, "comm_s": comm,
                            "bubble_s": max(s.end - s.compute - comm, 0.0), "peak_memory_gib": s.peak / GIB}
    out = {
        "hardware": hardware.name,
        "ngpus": ngpus,
        "policy": policy,
        "options": options or {},
        "precision": precision or "fp32",
        "step_time_s": step,
        "peak_memory_gib": result.peak_memory / GIB,
        "seconds": seconds,
        "model_flops": result.model_flops,
        "tflops_per_device": tflops,
        "mfu": (tflops * 1e12 / peak) if peak else None,
        "mfu_peak": mfu_precision(precision or "fp32") if peak else None,
        "memory_fits": (result.peak_memory <= hardware.memory_bytes) if not hardware.is_host else None,
        "ranks": ranks,
    }
    if fold is not None:
        out["symmetry"] = {"mesh": dict(zip(fold.names, fold.real)), "simulated_mesh": dict(zip(fold.names, fold.shape)),
                           "ranks_simulated": len(result.ranks)}
    if result.micro is not None:
        out["micro_batches"] = {"simulated": result.micro[0], "real": result.micro[1]}
    return out
