"""Process group and device set-up: torchrun, or one process in SINGLE_DEV_MODE."""
from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import types
from datetime import timedelta
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from cube import config
from cube.runtime import cpu_memory, failfast, watchdog

log = logging.getLogger("cube")


@dataclass(frozen=True)
class Env:
    """Where this process runs: its rank, the world size and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init(backend: Optional[str] = None) -> Env:
    """Initialises the process group (once) and returns this process's ``Env``.

    Under torchrun (``WORLD_SIZE`` set) the backend is NCCL when CUDA is
    available, gloo otherwise (``CUBE_BACKEND`` overrides); each rank takes
    ``cuda:{LOCAL_RANK}``. With ``SINGLE_DEV_MODE=1`` or outside torchrun
    there is no process group and the world size is 1.
    """
    env = config.launch_env()
    cuda = torch.cuda.is_available()
    if not cuda:
        cpu_memory.keep_freed_memory()
    if config.single_dev_mode() or "WORLD_SIZE" not in env:
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return Env(0, 1, 0, device)
    local = env.get("LOCAL_RANK", 0)
    backend = backend or config.backend() or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ValueError("the NCCL backend (CUBE_BACKEND=nccl, or init(backend='nccl')) needs CUDA, and torch "
                         "sees no GPU here: leave the backend unset to use gloo")
    device = _device(local, backend) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        store = _attempt_store()
        if store is not None:
            kwargs.update(store=store, rank=env["RANK"], world_size=env["WORLD_SIZE"])
        dist.init_process_group(backend=backend, **kwargs)
        failfast.install(dist.get_rank())
        if dist.get_world_size() > 1:
            watchdog.install(dist.get_rank(), config.hang_timeout())
        atexit.register(_shutdown)
        log.debug("initialised process group: backend=%s world=%d", backend, dist.get_world_size())
    return Env(dist.get_rank(), dist.get_world_size(), local, device)


def _device(local_rank: int, backend: str) -> torch.device:
    """``cuda:{local_rank}``; with more local ranks than GPUs, gloo ranks share them round-robin
    (a test set-up: NCCL refuses two ranks on one GPU, so that is an error naming the fix)."""
    count = torch.cuda.device_count()
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if backend != "gloo":
        raise ValueError(f"local rank {local_rank} has no GPU of its own ({count} visible) and NCCL cannot "
                         f"put two ranks on one GPU: start at most {count} processes per node "
                         f"(torchrun --nproc_per_node={count}), or set CUBE_BACKEND=gloo to share GPUs in a test")
    log.warning("cube: local rank %d shares cuda:%d (%d GPUs visible, gloo)", local_rank, local_rank % count, count)
    return torch.device("cuda", local_rank % count)


def _attempt_store():
    """Under torchrun, the launcher's store with a prefix per restart attempt (None elsewhere).

    The launcher's store outlives ``--max-restarts`` restarts; without a prefix
    the restarted ranks read the addresses the dead ones published and cannot
    connect.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(minutes=10))
    return dist.PrefixStore(f"/cube/attempt_{attempt}", store)


def _shutdown() -> None:
    """At exit: wait for posted sends and take the process group down in order, so no
    communication thread is left running while the interpreter tears down."""
    from cube.runtime import p2p, session
    failfast.uninstall()
    if failfast.failed_here():
        return   # this rank failed: waiting for its peers could hang; the process is ending anyway
    states = session.live_states()
    try:
        for state in states:   # every program's posted sends
            p2p.finish(state.p2p)
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # exiting anyway: say why the shutdown was not clean
        log.warning("cube: process group shutdown at exit failed: %s", e)
    # Drop every reference cube keeps to process groups, posted work and the store, and collect
    # them now: left to the interpreter's teardown, a group's C++ destructor (which joins its
    # communication threads, and frees tensors held by finished work) can run after Python is half
    # gone and abort the process ("terminate called without an active exception").
    session.process_groups().clear()
    for state in states:
        p2p.forget(state.p2p)
    del states
    failfast.forget()
    _release_default_groups()
    gc.collect()


def _release_default_groups() -> None:
    """Drops the process groups torch's own functions hold as default arguments.

    ``torch.distributed.nn.functional`` declares ``group=group.WORLD``, evaluated when the module is
    imported; an optimizer's first construction imports it (through ``torch._dynamo``), so after
    ``init_process_group`` each of its functions holds the world group for good. The group then
    outlives ``destroy_process_group`` with its gloo threads, and a thread that finishes a work
    while the interpreter tears down (dropping a tensor needs the GIL, which a finalizing
    interpreter refuses) aborts the process with "terminate called without an active exception".
    None is what those defaults are before ``init_process_group``: the default group at call time.
    """
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not name.startswith("torch.distributed") or not isinstance(namespace, dict):
            continue
        for f in list(namespace.values()):
            # type(), not isinstance: isinstance reads __class__, which the deprecated torch.distributed.reduce_op
            # answers with a FutureWarning printed at the end of every multi-rank run
            if type(f) is not types.FunctionType:
                continue
            if f.__defaults__ and any(isinstance(d, dist.ProcessGroup) for d in f.__defaults__):
                f.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in f.__defaults__)
            if f.__kwdefaults__ and any(isinstance(d, dist.ProcessGroup) for d in f.__kwdefaults__.values()):
                f.__kwdefaults__ = {k: None if isinstance(d, dist.ProcessGroup) else d
                                    for k, d in f.__kwdefaults__.items()}
