"""What a checkpoint keeps beyond tensors so that a resumed run continues exactly as an uninterrupted one.

Two things decide what a step computes besides the parameters and the
optimizer state: the random numbers it draws and the batch it is given.

Random generators (:func:`rng_state`, :func:`restore_rng`): torch's CPU
generator, the CUDA generator of the rank's device (when CUDA is in use),
Python's ``random`` and NumPy's global generator (when NumPy is loaded), and
cube's own count of the model's steps, from which the default mode of
``cube.runtime.rng`` keys each dropout mask (without it a resumed process would
count from 0 and redraw step 0's masks). ``exact_rng=True`` draws from torch's
CPU generator, which is restored too.

The data loader (:func:`loader_state`, :func:`restore_loader`): any loader with
``state_dict()`` and ``load_state_dict()``, the convention of torchdata's
``StatefulDataLoader`` (``cube.runtime.data.ShuffledBatches`` is one). Two
details of ``cube.compile`` matter here:

- compile reads the loader's first batch to trace and hands it to the first
  step. A save before that step would otherwise record a loader one batch
  ahead, so the compiled step keeps the loader's state from before its read
  (``_Batches.before``) and the save uses it while that batch is pending.
- after a restore, a batch compile read from the same loader object is stale
  (it is the fresh loader's first batch, not the one at the restored
  position): the compiled step drops it, and its first call takes the next
  batch from the restored loader.

A rank of a pipeline plan whose ops read no batch tensor never takes a batch,
so its loader's state says nothing about the run: each rank's record says
whether its plan read batches, and a rank loading a checkpoint takes its own
record when it read batches and the world size is the same, else the first
record of a rank that did.
"""
from __future__ import annotations

import random
import sys
from typing import Any, List, Optional

import torch

from cube.runtime import session


# ---------------------------------------------------------------------- random generators
def rng_state(model) -> dict:
    """This rank's random generator states and ``model``'s step count (plain values and CPU tensors)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "cube_steps": int(model.__dict__.get("_rng_steps", 0))}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss)]
    device = getattr(model, "device", torch.device("cpu"))
    if device.type == "cuda" and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng(model, state: Optional[dict]) -> None:
    """Sets the generators and ``model``'s step count to ``state`` (nothing for a checkpoint without one).
    A CUDA state is restored only onto a CUDA device (a run moved between CPU and GPU keeps its own)."""
    if not state:
        return
    torch.set_rng_state(state["torch"])
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss_value = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss_value))
    device = getattr(model, "device", torch.device("cpu"))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    model.__dict__["_rng_steps"] = int(state["cube_steps"])


# ---------------------------------------------------------------------- data loader
def check_stateful(dataloader, fn: str) -> None:
    """Raises the ``TypeError`` for a loader without ``state_dict()``/``load_state_dict()``."""
    if not (callable(getattr(dataloader, "state_dict", None)) and callable(getattr(dataloader, "load_state_dict", None))):
        raise TypeError(f"cube.{fn}(dataloader=...) takes a loader with state_dict() and load_state_dict() "
                        f"(torchdata's StatefulDataLoader, cube.runtime.data.ShuffledBatches); "
                        f"{type(dataloader).__name__} has no such methods. Give it these two methods (the "
                        f"position in the data and any random state of its own), or leave dataloader out")


def _steps_reading(dataloader) -> List[Any]:
    """Compiled steps of this process whose dataloader is ``dataloader`` (identity)."""
    return [s for s in session.steps() if getattr(getattr(s, "batches", None), "source", None) is dataloader]


def loader_state(dataloader) -> dict:
    """``{"state": dataloader.state_dict(), "reads": bool}`` for this rank's record (see the module docstring)."""
    check_stateful(dataloader, "save_checkpoint")
    steps = _steps_reading(dataloader)
    state = None
    for s in steps:
        if s.batches.pending and s.batches.before is not None:   # compile's batch not yet handed to a step
            state = s.batches.before
    if state is None:
        state = dataloader.state_dict()
    reads = not steps or any(getattr(s, "_placeholders", None) is None for s in steps)
    return {"state": state, "reads": reads}


def restore_loader(dataloader, records: List[dict], rank: int, same_world: bool, where: str) -> None:
    """Loads the saved loader state this rank should continue from into ``dataloader`` (module docstring).

    Raises:
        ValueError: the checkpoint holds no loader state.
    """
    check_stateful(dataloader, "load_checkpoint")
    saved = [r.get("data") for r in records]
    if all(d is None for d in saved):
        raise ValueError(f"{where} holds no data loader state (it was saved without dataloader=): load it "
                         f"without dataloader=, or save with cube.save_checkpoint(..., dataloader=loader)")
    mine = saved[rank] if same_world and rank < len(saved) else None
    if mine is None or not mine["reads"]:
        mine = next((d for d in saved if d is not None and d["reads"]), None) or next(d for d in saved if d)
    dataloader.load_state_dict(mine["state"])
    for s in _steps_reading(dataloader):   # compile's batch came from before the restored position
        s.batches.pending = False
