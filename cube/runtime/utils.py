"""Helpers for training scripts."""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import Callable, Sequence, Union

import torch


class DummyDataloader:
    """An endless iterator that yields the same batch, built from a sample.

    Args:
        sample: one sample (a tensor or a tuple of tensors) without the batch dim,
            or with it when ``batch_size`` is None.
        batch_size: stack ``batch_size`` copies of ``sample`` along a new dim 0.
    """

    def __init__(self, sample: Union[torch.Tensor, Sequence[torch.Tensor]], batch_size: int | None = None):
        def batched(t):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"create_dummy_dataloader: samples must be tensors, got {type(t).__name__}")
            return t if batch_size is None else t.unsqueeze(0).repeat(batch_size, *([1] * t.dim()))
        if isinstance(sample, torch.Tensor):
            self.batch = batched(sample)
        else:
            self.batch = tuple(batched(t) for t in sample)

    def __iter__(self):
        return self

    def __next__(self):
        return self.batch

    def state_dict(self) -> dict:
        """Nothing to save: every batch is the same (the ``StatefulDataLoader`` convention)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see ``state_dict``)."""


def create_dummy_dataloader(sample, batch_size: int | None = None) -> DummyDataloader:
    """An endless dataloader of one fixed batch (for examples and benchmarks)."""
    return DummyDataloader(sample, batch_size)


def atomic_write(path: Path, write: Callable) -> None:
    """Writes ``path`` through ``write(file)`` on a temporary file in the same directory, fsync and a
    rename, so a reader (or a crash) never sees half a file."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"   # the usual permissions
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):   # make the rename itself durable
        dirfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)
