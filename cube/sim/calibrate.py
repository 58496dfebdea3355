"""``python -m cube.sim.calibrate --out my-cluster.json``: a hardware profile fitted on this machine.

Measures, on ``cuda:0`` when there is one (else the CPU):

- a GEMM sweep (square matmuls of growing size in the profile's precision):
  seconds are linear in FLOPs, ``t = (f + half) / peak``, so a least-squares
  line gives the peak and the size at which half of it is reached (the
  profile's ``gemm`` curve with ``max`` 1 of the fitted peak); attention and
  convolution take the same curve;
- memory bandwidth (a large copy: bytes read and written per second);
- the dispatch time of a tiny kernel;
- the network: kept from ``--base`` (a shipped profile) on a GPU, since one
  process on one device cannot measure NVLink or InfiniBand; on the CPU, gloo's
  calibrated costs (``cube.sim.comm``) for both hops.

The file is usable at once: ``python -m cube.sim SPEC --hardware my-cluster.json ...``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import torch

from cube.sim import hardware
from cube.sim.profile import time_call

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gemm_sweep(device: torch.device, dtype: torch.dtype, sizes: Sequence[int], repeat: int = 5
               ) -> List[Tuple[float, float]]:
    """``[(flops, seconds)]`` of square matmuls."""
    points = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        points.append((2.0 * n ** 3, time_call(lambda: torch.matmul(a, b), device, repeat)))
    return points


def fit_curve(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(peak FLOP/s, FLOPs at half the peak)`` from the line ``t = f / peak + half / peak``.

    Raises:
        ValueError: fewer than two points, or times that do not grow with FLOPs.
    """
    if len(points) < 2:
        raise ValueError("fit_curve needs at least two (flops, seconds) points")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    if slope <= 0:
        raise ValueError(f"GEMM times do not grow with size ({points}); the device is too busy to calibrate")
    intercept = max(my - slope * mx, 0.0)
    return 1.0 / slope, intercept / slope


def bandwidth(device: torch.device, nbytes: int, repeat: int = 5) -> float:
    """Bytes per second a copy moves (read plus write)."""
    n = nbytes // 4
    x, y = torch.empty(n, device=device), torch.randn(n, device=device)
    return 2 * nbytes / time_call(lambda: x.copy_(y), device, repeat)


def launch(device: torch.device, repeat: int = 9) -> float:
    x = torch.zeros(1, device=device)
    return time_call(lambda: x.add_(1), device, repeat)


def profile(precision: str = "bf16", quick: bool = False, base: str = "dgx-a100-80g", name: str = "my-cluster",
            log: Callable[[str], None] = print, calibrate_network: bool = True) -> dict:
    """The measured profile as a dict (see the module docstring)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    if not cuda and precision != "fp32":
        log(f"no GPU: calibrating the CPU in fp32 (asked {precision})")
        precision = "fp32"
    dtype = DTYPES[precision]
    sizes = ([512, 1024, 2048, 4096] if quick else [512, 1024, 2048, 3072, 4096, 6144, 8192]) if cuda else \
        ([64, 128, 256, 384] if quick else [128, 256, 384, 512, 768, 1024])
    for attempt in range(3):   # another program's burst can flatten one sweep; measure again
        points = gemm_sweep(device, dtype, sizes)
        try:
            peak, half = fit_curve(points)
            break
        except ValueError:
            if attempt == 2:
                raise
            log("GEMM times did not grow with size (the device is busy): measuring again")
    log("GEMM sweep: " + ", ".join(f"{round((f / 2) ** (1 / 3))}^3 {f / t / 1e12:.2f} TFLOP/s" for f, t in points))
    log(f"fit: peak {peak / 1e12:.2f} TFLOP/s, half of it at {half / 1e9:.3f} GFLOP")
    rate = bandwidth(device, (64 << 20) if quick else (512 << 20) if cuda else (128 << 20))
    dispatch = launch(device)
    log(f"memory: {rate / 1e9:.1f} GB/s; kernel dispatch {dispatch * 1e6:.1f} us")
    name_of = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else 0
    if cuda:
        network, node = hardware.load(base).network, hardware.load(base).raw.get("node", {"gpus": 8})
        net_source = f"kept from the {base} profile (one device cannot measure its network)"
    else:
        from cube.sim import comm as comm_mod
        model = comm_mod.load(2, calibrate_missing=calibrate_network)
        alpha, beta = model.alpha["all_reduce"], model.beta["all_reduce"]
        hop = {"busbw_gbps": 1 / beta / 1e9, "p2p_gbps": 1 / model.beta["p2p"] / 1e9, "alpha_us": alpha * 1e6}
        network = {"intra": hop, "inter": {"nic_gbps_per_gpu": hop["busbw_gbps"], "efficiency": 1.0,
                                           "alpha_us": hop["alpha_us"]}}
        node = {"gpus": 1}
        net_source = "gloo on this host, calibrated by cube.sim.comm"
    when = datetime.datetime.now().isoformat(timespec="seconds")
    curve = {"max": 1.0, "half_gflop": half / 1e9}
    return {
        "name": name,
        "description": f"Fitted by python -m cube.sim.calibrate on {name_of} ({device.type}) at {when}.",
        "sources": {"device": f"measured: GEMM sweep {sizes} in {precision}, a copy, a one-element kernel",
                    "network": net_source},
        "device": {"kind": "gpu" if cuda else "cpu", "name": name_of, "memory_gib": round(memory, 1),
                   "peak_tflops": {precision: peak / 1e12},
                   "hbm_gbps": rate / 1e9,
                   "efficiency": {"gemm": curve, "attention": curve, "conv": curve, "memory": 1.0},
                   "launch_us": dispatch * 1e6, "backward_factor": 2.0, "optimizer_bytes_per_param": 28},
        "node": node,
        "network": network,
        "measurements": {"gemm": [[f, t] for f, t in points]},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cube.sim.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the profile to write (JSON)")
    p.add_argument("--precision", choices=sorted(DTYPES), default="bf16", help="GEMM precision (GPU)")
    p.add_argument("--base", default="dgx-a100-80g", help="shipped profile whose network a GPU profile keeps")
    p.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller measurements")
    p.add_argument("--no-calibrate", action="store_true", help="CPU: gloo's default costs, no network calibration")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.suffix != ".json":
        p.error("--out must end in .json (the simulator reads profiles by that suffix)")
    data = profile(args.precision, args.quick, args.base, args.name or out.stem,
                   calibrate_network=not args.no_calibrate)
    out.write_text(json.dumps(data, indent=2) + "\n")
    hardware.load(out)   # what the simulator will read: checked now
    print(f"profile written to {out}; use it: python -m cube.sim SPEC --hardware {out} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
