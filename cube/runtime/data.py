"""Which part of the global batch a rank consumes: ``cube.runtime.data.part()``.

The answer is read from the rank's generated program (the data of the plan,
the same whether it was just compiled or came from the cache): the batch
tensors its ops read, the piece of each that its forward keeps
(``runtime.piece(x, [(dim, start, stop)])``), and the micro-batches a step cuts
its batch into.

A step always takes one batch, the global batch. A pipeline plan cuts it along
dim 0 into ``nmicros`` micro-batches (``cube.runtime.pipeline.micro_batches``)
so that a rank keeping part ``dp_rank`` of ``dp_size`` of each micro-batch reads
exactly rows ``[dp_rank * B / dp_size, (dp_rank + 1) * B / dp_size)`` of the
global batch over the step, as without a pipeline.

A rank none of whose ops reads a batch tensor (a middle pipeline stage) needs
no data: after compile's first read the compiled step never calls ``next()``
on its dataloader, and feeds the schedule placeholders of the traced shapes.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from cube.runtime import session


@dataclass(frozen=True)
class BatchPart:
    """This rank's part of each global batch.

    Attributes:
        reads: whether any op of this rank reads a batch tensor; when False the
            compiled step never takes a batch from the dataloader.
        items: per batch tensor, the piece this rank keeps as ``[(dim, start, stop)]``
            (``[]``: all of it), or None when the rank does not read it.
        shapes: the global shape of each batch tensor.
        dp_rank, dp_size: this rank's slice of the batch dim: the global batch
            is cut into ``dp_size`` equal parts along dim 0 and the rank reads
            part ``dp_rank`` (0 and 1 when it reads the whole batch or none), also
            under a pipeline plan (its micro-batches are cut so).
        nmicros: micro-batches a step cuts its one global batch into (1 without a
            pipeline). A step always takes one batch from the dataloader.
    """
    reads: bool
    items: Tuple[Optional[list], ...]
    shapes: Tuple[tuple, ...]
    dp_rank: int
    dp_size: int
    nmicros: int


def part(step=None) -> BatchPart:
    """This rank's part of the global batch under ``step`` (default: the latest ``cube.compile``).

    Raises:
        ValueError: nothing was compiled yet.
    """
    if step is None:
        step = session.latest()
        if step is None:
            raise ValueError("cube.runtime.data.part(): nothing was compiled yet; decorate the training step "
                             "with @cube.compile(model, dataloader, PAS=...) first")
    return read_part(Path(step.path))


def read_part(path: Path) -> BatchPart:
    """The ``BatchPart`` of the generated program at ``path``."""
    tree = ast.parse(Path(path).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenModel")
    methods = {f.name: f for f in cls.body if isinstance(f, ast.FunctionDef)}
    names = [a.arg for a in methods["forward"].args.args if a.arg not in ("self", "stage")]
    bodies = [f for n, f in methods.items() if n.startswith("stage_")] or [methods["forward"]]
    if "_micro_counts" in methods:   # counts the valid targets of the global batch: reads it
        bodies.append(methods["_micro_counts"])
    used = {n.id for f in bodies for n in ast.walk(f) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    pieces = {}
    for f in bodies:
        for node in ast.walk(f):
            call = node.value if isinstance(node, ast.Assign) else None
            if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "piece"
                    and call.args and isinstance(call.args[0], ast.Name) and call.args[0].id in names):
                pieces[call.args[0].id] = [tuple(s) for s in ast.literal_eval(call.args[1])]
    step_fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "train_step")
    shapes, nmicros = (), 1
    for node in ast.walk(step_fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "next_batch":
            shapes = tuple(tuple(s) for s in ast.literal_eval(node.args[2]))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "micro_batches":
            nmicros = ast.literal_eval(node.args[1])
    names = names[:len(shapes)]   # after the batch tensors: the counts a pipeline step passes in
    items = tuple(pieces.get(n, []) if n in used else None for n in names)
    dp_rank, dp_size = 0, 1
    for item, shape in zip(items, shapes):
        cut = [s for s in (item or []) if s[0] == 0]
        if cut:   # the piece is of one micro-batch of shape[0] // nmicros rows
            _, start, stop = cut[0]
            dp_size, dp_rank = shape[0] // nmicros // (stop - start), start // (stop - start)
            break
    return BatchPart(any(i is not None for i in items), items, shapes, dp_rank, dp_size, nmicros)


class Placeholders:
    """Endless batches of zeros of the global batch's shapes and dtypes: what a rank that reads no
    batch tensor hands its step instead of taking batches from the dataloader (a pipeline step cuts
    it into micro-batches of the micro-batch shapes, views of the same zeros)."""

    def __init__(self, sample: Sequence[torch.Tensor], structure: str):
        self.batch: List[torch.Tensor] = [torch.zeros(t.shape, dtype=t.dtype) for t in sample]
        self.structure = structure

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        return self.batch[0] if self.structure == "tensor" else tuple(self.batch)

    def state_dict(self) -> dict:
        """Nothing to save: every batch is the same zeros."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore (see ``state_dict``)."""


class ShuffledBatches:
    """Endless global batches of a dataset of tensors, reshuffled every epoch, that a checkpoint can resume.

    Epoch ``e`` visits the samples in the order ``torch.randperm`` gives with a
    generator seeded from ``(seed, e)``, ``batch_size`` at a time (the last
    samples of an epoch that do not fill a batch are dropped, so every batch has
    one shape); then epoch ``e + 1`` starts. Its state is the epoch and the
    position in it (``state_dict()``/``load_state_dict()``, the convention of
    torchdata's ``StatefulDataLoader``), so ``cube.save_checkpoint(...,
    dataloader=loader)`` and ``cube.load_checkpoint(..., dataloader=loader)``
    resume it at the next batch an uninterrupted run would get.

    Args:
        data: one tensor or a tuple of tensors with one leading sample dim of equal size.
        batch_size: samples per batch (the global batch; cube takes each rank's part).
        seed: seeds every epoch's order.
        shuffle: False visits the samples in order every epoch.

    Raises:
        ValueError: no tensors, sample dims of different sizes, or fewer samples than ``batch_size``.
    """

    def __init__(self, data, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.single = isinstance(data, torch.Tensor)
        self.tensors = (data,) if self.single else tuple(data)
        if not self.tensors or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in self.tensors):
            raise ValueError("ShuffledBatches takes a tensor or a tuple of tensors with a leading sample dim")
        sizes = {t.shape[0] for t in self.tensors}
        if len(sizes) != 1:
            raise ValueError(f"ShuffledBatches: the tensors' sample dims differ ({sorted(sizes)}); give every "
                             f"tensor one row per sample")
        self.size = sizes.pop()
        if not 0 < batch_size <= self.size:
            raise ValueError(f"ShuffledBatches: batch_size={batch_size} for {self.size} samples; it must be "
                             f"between 1 and the number of samples")
        self.batch_size, self.seed, self.shuffle = int(batch_size), int(seed), bool(shuffle)
        self.epoch, self.index = 0, 0
        self._order: Optional[Tuple[int, torch.Tensor]] = None   # (epoch, its order)

    def __iter__(self) -> "ShuffledBatches":
        return self

    def __next__(self):
        if self.index + self.batch_size > self.size:
            self.epoch, self.index = self.epoch + 1, 0
        rows = self.order(self.epoch)[self.index:self.index + self.batch_size]
        self.index += self.batch_size
        out = tuple(t.index_select(0, rows) for t in self.tensors)
        return out[0] if self.single else out

    def order(self, epoch: int) -> torch.Tensor:
        """The samples' order in ``epoch``."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
                self._order = (epoch, torch.randperm(self.size, generator=gen))
            else:
                self._order = (epoch, torch.arange(self.size))
        return self._order[1]

    def state_dict(self) -> dict:
        """Where the next batch starts, and what the order depends on."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": self.size,
                "batch_size": self.batch_size, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Continues at ``state``'s position.

        Raises:
            ValueError: ``state`` is of a loader over another number of samples, batch size, seed or shuffle.
        """
        mine = self.state_dict()
        other = {k: state.get(k) for k in ("size", "batch_size", "seed", "shuffle")}
        if any(mine[k] != v for k, v in other.items()):
            raise ValueError(f"ShuffledBatches.load_state_dict: the state is of a loader with {other}, this one "
                             f"has { {k: mine[k] for k in other} }; build the loader as the saved run did")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
