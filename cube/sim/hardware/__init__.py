"""Hardware profiles: what the simulator knows of a cluster, as data files (``<name>.json`` here).

A profile holds the device's peak rates (FLOP/s per precision, memory bandwidth),
achievable efficiency per op class (GEMM, attention, convolution: a saturating
curve of the op's size; memory-bound ops: a share of the bandwidth), the host
dispatch cost per kernel, and the network of a node and between nodes
(alpha-beta per hop, NCCL's ring and tree). Each number's source is cited in
the file's ``sources`` (``fp8``: the float8 tensor cores' peak, where the silicon has
them; MFU is counted against bf16's, ``mfu_precision``). Shipped: ``dgx-a100-80g``, ``dgx-h100``,
``h100-hbm2e-500w`` and ``cpu-host`` (this machine as the simulator measures it: ops profiled,
collectives calibrated on gloo). ``python -m cube.sim.calibrate --out
my-cluster.json`` fits a profile of the machine it runs on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Union

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Curve:
    """Efficiency of a compute-bound op class: ``max * f / (f + half)`` of the peak at ``f`` FLOPs."""
    max: float
    half_gflop: float

    def at(self, flops: float) -> float:
        return self.max * flops / (flops + self.half_gflop * 1e9) if flops > 0 else self.max


@dataclass(frozen=True)
class Hardware:
    """A parsed profile (see the module docstring and the shipped files for the fields)."""
    name: str
    kind: str                      # "gpu" (or another accelerator) or "host" (this machine, measured)
    raw: dict
    source: str

    @property
    def is_host(self) -> bool:
        return self.kind == "host"

    @property
    def device(self) -> dict:
        return self.raw["device"]

    def peak_flops(self, precision: str) -> float:
        """FLOP/s of the dense matrix units at ``precision`` (``fp8``, ``bf16``, ``fp16``, ``tf32``, ``fp32``).

        Raises:
            ValueError: the profile gives no peak for ``precision`` (``fp8``: its GPUs have no
                float8 tensor cores, e.g. the A100's).
        """
        peaks = self.device["peak_tflops"]
        if precision == "fp8" and precision not in peaks:
            having = [n for n in names() if n != self.name and "fp8" in load(n).device.get("peak_tflops", {})]
            raise ValueError(f"precision='fp8': hardware profile {self.name!r} has no fp8 peak (its peak_tflops: "
                             f"{', '.join(sorted(peaks))}): its GPUs have no float8 tensor cores. Pass "
                             f"precision='bf16' (--precision bf16), or a profile with an 'fp8' entry in "
                             f"peak_tflops ({', '.join(having)})")
        if precision not in peaks:
            raise ValueError(f"hardware profile {self.name!r} gives no peak for {precision!r}; it has "
                             f"{sorted(peaks)}")
        return peaks[precision] * 1e12

    def curve(self, op_class: str) -> Curve:
        eff = self.device["efficiency"]
        got = eff.get(op_class) or eff["gemm"]
        return Curve(float(got["max"]), float(got["half_gflop"]))

    @property
    def memory_rate(self) -> float:
        """Bytes/s memory-bound kernels reach."""
        return self.device["hbm_gbps"] * 1e9 * self.device["efficiency"]["memory"]

    @property
    def launch(self) -> float:
        return self.device.get("launch_us", 0.0) * 1e-6

    @property
    def memory_bytes(self) -> int:
        return int(self.device["memory_gib"] * 2**30)

    @property
    def gpus_per_node(self) -> int:
        return int(self.raw.get("node", {}).get("gpus", 1))

    @property
    def network(self) -> dict:
        return self.raw["network"]


def mfu_precision(precision: str) -> str:
    """The peak MFU is counted against at ``precision``: its own, bf16's under ``fp8`` (the plan mixes
    bf16 and float8 products; torchtitan notes MFU is ill-defined there and keeps the bf16 peak)."""
    return "bf16" if precision == "fp8" else precision


def names() -> List[str]:
    """The shipped profiles."""
    return sorted(p.stem for p in HERE.glob("*.json"))


_REQUIRED = {"gpu": ("peak_tflops", "hbm_gbps", "efficiency", "memory_gib")}   # of any device not this host


def load(name_or_path: Union[str, Path]) -> Hardware:
    """A shipped profile by name (``dgx-a100-80g``) or a JSON file (``my-cluster.json``).

    Raises:
        ValueError: an unknown name, a file that is not a profile, or a missing field.
    """
    text = str(name_or_path)
    path = Path(text)
    if not text.endswith(".json"):
        path = HERE / f"{text}.json"
        if not path.is_file():
            raise ValueError(f"unknown hardware profile {text!r}; shipped: {', '.join(names())}, or pass a "
                             f"JSON file (python -m cube.sim.calibrate --out my-cluster.json writes one)")
    elif not path.is_file():
        raise ValueError(f"no hardware profile file {text!r}")
    try:
        raw: Dict = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {path} is not valid JSON: {e}") from e
    device = raw.get("device")
    if not isinstance(device, dict) or "kind" not in device:
        raise ValueError(f"hardware profile {path} has no device.kind")
    kind = device["kind"]
    missing = [] if kind == "host" else [k for k in _REQUIRED["gpu"] if k not in device]
    if kind != "host" and "network" not in raw:
        missing.append("network")
    if missing:
        raise ValueError(f"hardware profile {path} lacks {', '.join(missing)}")
    return Hardware(raw.get("name", path.stem), kind, raw, str(path))
