"""Every environment variable cube reads, read in this one place."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Tuple, Union


def single_dev_mode() -> bool:
    """``SINGLE_DEV_MODE=1``: run the script in one process, world size 1, no torchrun."""
    return os.environ.get("SINGLE_DEV_MODE", "0") not in ("", "0", "false", "False")


def cache_dir() -> Path:
    """Where generated code is kept: ``CUBE_CACHE_DIR``, else ``~/.cache/cube``."""
    env = os.environ.get("CUBE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cube"


def launch_env() -> dict:
    """``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` as torchrun sets them (absent: one process)."""
    return {k: int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}


def backend() -> Optional[str]:
    """``CUBE_BACKEND``: ``nccl`` or ``gloo`` to override the default (NCCL with CUDA, gloo without)."""
    env = os.environ.get("CUBE_BACKEND", "").strip().lower()
    if env and env not in ("nccl", "gloo"):
        raise ValueError(f"CUBE_BACKEND must be 'nccl' or 'gloo', got {env!r}")
    return env or None


def cpu_malloc() -> str:
    """``CUBE_CPU_MALLOC``: ``cache`` (default) keeps the memory CPU ranks free for their next
    step (``cube.runtime.cpu_memory``); ``system`` leaves the C library's allocator as it is."""
    env = os.environ.get("CUBE_CPU_MALLOC", "cache").strip().lower() or "cache"
    if env not in ("cache", "system"):
        raise ValueError(f"CUBE_CPU_MALLOC must be 'cache' or 'system', got {env!r}")
    return env


def bucket_bytes(default: int) -> int:
    """Gradient bucket size of the reducer: ``CUBE_BUCKET_MB`` (MiB), else ``default`` bytes."""
    env = os.environ.get("CUBE_BUCKET_MB")
    if not env:
        return default
    try:
        mb = float(env)
    except ValueError:
        raise ValueError(f"CUBE_BUCKET_MB must be a number of MiB, got {env!r}") from None
    if mb <= 0:
        raise ValueError(f"CUBE_BUCKET_MB must be positive, got {env!r}")
    return int(mb * 2**20)


def peak_tflops() -> Optional[float]:
    """``CUBE_PEAK_TFLOPS``: one device's peak TFLOP/s for the MFU of ``cube.Metrics`` (unset: None)."""
    env = os.environ.get("CUBE_PEAK_TFLOPS", "").strip()
    if not env:
        return None
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"CUBE_PEAK_TFLOPS must be a number of TFLOP/s such as 989, got {env!r}") from None
    if not value > 0:
        raise ValueError(f"CUBE_PEAK_TFLOPS must be positive, got {env!r}")
    return value


def p2p_strict() -> bool:
    """``CUBE_P2P_ORDER=strict``: point-to-point messages between two ranks match in posting order, tags
    ignored (NCCL's rule), on gloo and in the in-process world too, so a schedule that relies on tags
    fails on a CPU as it would on GPUs (``cube.runtime.p2p``). Default ``tags``: matched by tag."""
    env = os.environ.get("CUBE_P2P_ORDER", "tags").strip().lower() or "tags"
    if env not in ("tags", "strict"):
        raise ValueError(f"CUBE_P2P_ORDER must be 'strict' or 'tags', got {env!r}")
    return env == "strict"


def fused_cut() -> bool:
    """``CUBE_FUSED_CUT=0``: keep fused projections (GPT-2's ``c_attn``, GPT-NeoX's ``query_key_value``)
    one matmul (``cube.trace.fused``); tensor parallel then keeps them whole. Default on: cut into one
    matmul per block (query, key, value) over views of the fused weight, so tensor parallel splits them."""
    return os.environ.get("CUBE_FUSED_CUT", "1") not in ("0", "false", "False")


def _positive_int(name: str, default: int) -> int:
    env = os.environ.get(name)
    if not env:
        return default
    if not env.isdigit() or int(env) < 1:
        raise ValueError(f"{name} must be a positive integer, got {env!r}")
    return int(env)


def tensor_parallel_degree(default: int = 2) -> int:
    """``CUBE_TP``: the tensor-parallel degree of hybrid policies (``cube/policies/hybrid.py``)."""
    return _positive_int("CUBE_TP", default)


def pipeline_degree(default: int = 2) -> int:
    """``CUBE_PP``: the pipeline stages of ``PASMegatron`` (``cube/policies/megatron3d.py``)."""
    return _positive_int("CUBE_PP", default)


def micro_batches(default: int = 4) -> int:
    """``CUBE_MICROS``: micro-batches per step of the pipeline policies (``cube/policies/pipeline.py``)."""
    return _positive_int("CUBE_MICROS", default)


def virtual_stages(default: int = 2) -> int:
    """``CUBE_VIRTUAL``: pipeline stages per device of ``PAS1F1BInterleaved`` (``cube/policies/pipeline.py``;
    ``PASMegatron`` reads it with default 1)."""
    return _positive_int("CUBE_VIRTUAL", default)


def stage_ranks(default: Tuple[int, ...] = (1, 1)) -> Tuple[int, ...]:
    """``CUBE_STAGE_RANKS=1,2``: devices per pipeline stage of ``PASPipeDream`` (``cube/policies/pipedream.py``)."""
    env = os.environ.get("CUBE_STAGE_RANKS", "").strip()
    if not env:
        return default
    parts = [p.strip() for p in env.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"CUBE_STAGE_RANKS must be positive device counts per stage such as '1,2', got {env!r}")
    return tuple(int(p) for p in parts)


def recompute_text() -> str:
    """The raw value of ``CUBE_RECOMPUTE`` (``""`` when unset)."""
    return os.environ.get("CUBE_RECOMPUTE", "").strip()


def recompute() -> Optional[Union[str, Tuple[int, ...]]]:
    """``CUBE_RECOMPUTE``: which blocks the shipped policies recompute (``cube.ir.blocks``).

    Returns:
        ``"all"``, a tuple of block indices (``CUBE_RECOMPUTE=0,2``), or None
        (unset, empty or ``none``: no recompute).

    Raises:
        ValueError: anything else.
    """
    env = recompute_text()
    if env.lower() in ("", "none", "off"):
        return None
    if env.lower() == "all":
        return "all"
    parts = [p.strip() for p in env.split(",")]
    if not all(p.isdigit() for p in parts):
        raise ValueError(f"CUBE_RECOMPUTE must be 'all' or comma-separated block indices such as '0,2', "
                         f"got {env!r}")
    return tuple(int(p) for p in parts)


def auto_plan_path(default: str = "cube_auto_plan.json") -> str:
    """``CUBE_AUTO_PLAN``: the plan file ``cube.policies.auto.PASAuto`` reads (unset: ``default``)."""
    return os.environ.get("CUBE_AUTO_PLAN") or default


def plan_settings() -> str:
    """The variables that change what the shipped policies plan or what codegen emits (``CUBE_PROFILE``
    adds profiling regions), for the code cache key."""
    names = ("CUBE_TP", "CUBE_PP", "CUBE_MICROS", "CUBE_VIRTUAL", "CUBE_RECOMPUTE", "CUBE_PROFILE",
             "CUBE_STAGE_RANKS")
    return " ".join(f"{k}={os.environ.get(k, '')}" for k in names)


def trace_repeat() -> bool:
    """``CUBE_TRACE_REPEAT``: export a long stack of alike blocks once and repeat it
    (``cube.trace.repeat``; default on, ``0``/``false``/``off`` turns it off)."""
    return os.environ.get("CUBE_TRACE_REPEAT", "1").strip() not in ("0", "false", "False", "off")


def restart_attempt() -> str:
    """``TORCHELASTIC_RESTART_COUNT``: which restart of the job this is under ``torchrun --max-restarts``
    (``"0"`` for the first run and outside torchrun)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


PROFILERS = ("torch", "viztracer")


def profiler() -> Optional[str]:
    """``CUBE_PROFILE``: the profiler of the compiled step, ``torch`` or ``viztracer`` (unset, ``0``,
    ``off`` or ``none``: None).

    Raises:
        ValueError: an unknown profiler name.
    """
    value = os.environ.get("CUBE_PROFILE", "").strip().lower()
    if not value or value in ("0", "off", "none"):
        return None
    if value not in PROFILERS:
        raise ValueError(f"CUBE_PROFILE={value!r}: use one of {', '.join(PROFILERS)} (or leave it unset)")
    return value


def profile_steps() -> range:
    """``CUBE_PROFILE_STEPS``: the (0-based) steps to record, ``2`` (the default) or a range ``1-3``.

    Raises:
        ValueError: neither a step number nor a range.
    """
    value = os.environ.get("CUBE_PROFILE_STEPS", "2").strip()
    try:
        lo, _, hi = value.partition("-")
        return range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise ValueError(f"CUBE_PROFILE_STEPS={value!r}: give a step number or a range such as 1-3") from None


def profile_dir() -> Path:
    """``CUBE_PROFILE_DIR``: where step traces are written (default ``./cube_traces``)."""
    return Path(os.environ.get("CUBE_PROFILE_DIR", "cube_traces"))


def child_env(pythonpath: str) -> dict:
    """The environment for a child Python process: this one's, with ``pythonpath`` first on ``PYTHONPATH``."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")]))


def check_graphs() -> bool:
    """``CUBE_CHECK_GRAPHS=1``: run the graph checker after every compile stage and pass
    (``cube.passes.check.check_stage``); the test suite turns it on."""
    return os.environ.get("CUBE_CHECK_GRAPHS", "0") not in ("", "0", "false", "False")


def hang_timeout() -> float:
    """``CUBE_HANG_TIMEOUT``: seconds a rank may spend in one step (or one checkpoint call) before the
    watchdog names where it waits and stops the job (``cube.runtime.watchdog``); default 1800, ``0``: off."""
    env = os.environ.get("CUBE_HANG_TIMEOUT", "").strip()
    if not env:
        return 1800.0
    try:
        value = float(env)
    except ValueError:
        raise ValueError(f"CUBE_HANG_TIMEOUT must be a number of seconds (0: no watchdog), got {env!r}") from None
    if value < 0:
        raise ValueError(f"CUBE_HANG_TIMEOUT must be 0 (off) or positive, got {env!r}")
    return value


def fp8_fused() -> str:
    """``CUBE_FP8_FUSED``: how ``precision="fp8"`` runs its amax and scale-and-cast kernels
    (``cube.runtime.float8``): ``auto`` (default) fuses each into one ``torch.compile`` kernel on a
    CUDA device and runs them eagerly elsewhere; ``1`` fuses them on every device; ``0`` never."""
    env = os.environ.get("CUBE_FP8_FUSED", "auto").strip().lower() or "auto"
    if env not in ("auto", "0", "1"):
        raise ValueError(f"CUBE_FP8_FUSED must be 'auto', '1' or '0', got {env!r}")
    return env
