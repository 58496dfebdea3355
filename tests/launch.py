"""Starting scripts the way users do: torchrun (gloo on CPU) or SINGLE_DEV_MODE=1."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""   # the multi-rank tests are CPU/gloo tests
    env["PYTHONFAULTHANDLER"] = "1"   # a rank that aborts in C++ still prints where Python was
    env.pop("SINGLE_DEV_MODE", None)
    env.update(extra)
    return env


def torchrun(script, nproc: int, args=(), env=None, timeout: int = 240) -> subprocess.CompletedProcess:
    """Runs ``script`` under torchrun with ``nproc`` local processes; fails loudly."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(script), *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, env=_env(env or {}), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"torchrun failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return out


def single(script, args=(), env=None, timeout: int = 240) -> subprocess.CompletedProcess:
    """Runs ``script`` in one process with SINGLE_DEV_MODE=1."""
    cmd = [sys.executable, str(script), *map(str, args)]
    out = subprocess.run(cmd, cwd=ROOT, env=_env({"SINGLE_DEV_MODE": "1", **(env or {})}),
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"script failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")
    return out


def parity_across_ranks(model: str, policy: str, nproc: int, tmp_path, steps: int = 5, nmicros: int = 1,
                        optimizer: str = "adamw", zero: int = 0, clip: float = 0.0, precision: str = "",
                        env=None, backend: str = "") -> list:
    """Runs tests/workers/parity_worker.py on ``nproc`` ranks; returns each rank's errors.

    ``zero``: build a ZeRO optimizer of that stage; ``clip``: clip the gradient norm each step;
    ``precision``: "bf16"/"fp16" compile and compare with the plain model under the same autocast;
    ``backend``: a ``torch.compile`` backend for the generated compute (``cube.compile(backend=)``).
    """
    import json
    torchrun(ROOT / "tests" / "workers" / "parity_worker.py", nproc, [model, policy, steps, tmp_path, nmicros],
             env={"CUBE_PARITY_OPT": optimizer, "CUBE_PARITY_ZERO": str(zero), "CUBE_PARITY_CLIP": str(clip),
                  "CUBE_PARITY_PRECISION": precision, "CUBE_PARITY_BACKEND": backend,
                  **(env or {})})
    results = [json.loads((Path(tmp_path) / f"rank{r}.json").read_text()) for r in range(nproc)]
    assert [r["rank"] for r in results] == list(range(nproc))
    assert all(r["world"] == nproc and r["steps"] == steps and r["nparams"] > 0 for r in results)
    return results
