"""torch -> fx: ``torch.export`` (non-strict) of the model on one batch."""
from __future__ import annotations

import inspect
import os
import re
import threading
import traceback
from contextlib import contextmanager
from typing import Iterator

import torch

from cube.trace import flex, functions
from cube.trace.repeat import export_repeated


class TraceError(ValueError):
    """The model could not be traced; the message says where and why."""


def _model_location(model: torch.nn.Module) -> str:
    cls = type(model)
    try:
        file = inspect.getsourcefile(cls.forward)
        _, line = inspect.getsourcelines(cls.forward)
        return f"{cls.__qualname__}.forward at {file}:{line}"
    except (OSError, TypeError):
        return f"{cls.__qualname__}.forward"


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch and cube: where the model failed."""
    torch_dir = os.path.dirname(torch.__file__)
    cube_dir = os.path.dirname(os.path.dirname(__file__))
    found = ""
    for fr in traceback.extract_tb(exc.__traceback__):
        if fr.filename.startswith(torch_dir) or fr.filename.startswith(cube_dir):
            continue
        found = f"{fr.filename}:{fr.lineno} in {fr.name}: {fr.line}"
    return found


@contextmanager
def _on_one_device(model: torch.nn.Module, args: tuple) -> Iterator[tuple]:
    """Gives ``args`` on the model's device for tracing, whatever device the batch is on.

    A model holding meta tensors (built under ``torch.device("meta")``) is traced
    on the meta device: the batch becomes meta tensors of the same shapes, and a
    model holding some meta and some real tensors has the real ones swapped for
    meta stand-ins while it is exported (restored afterwards). Tracing only needs
    shapes and dtypes, so no storage is allocated for the model.
    """
    tensors = [(m, store, k, t) for m in model.modules() for store in (m._parameters, m._buffers)
               for k, t in store.items() if t is not None]
    devices = {t.device for *_, t in tensors}
    if not devices:
        yield args
        return
    if any(d.type == "meta" for d in devices):
        stand_in = {}
        for _, store, k, t in tensors:
            if t.device.type != "meta":
                if id(t) not in stand_in:
                    meta = torch.empty_like(t, device="meta")
                    if isinstance(t, torch.nn.Parameter):
                        meta = torch.nn.Parameter(meta, requires_grad=t.requires_grad)
                    stand_in[id(t)] = meta
                store[k] = stand_in[id(t)]
        try:
            yield tuple(torch.empty_like(a, device="meta") if isinstance(a, torch.Tensor) else a for a in args)
        finally:
            for _, store, k, t in tensors:
                store[k] = t
        return
    device = next(iter(devices))
    if len(devices) == 1:
        args = tuple(a.to(device) if isinstance(a, torch.Tensor) and a.device != device else a for a in args)
    yield args


@contextmanager
def _sizes_not_specialized() -> Iterator[None]:
    """Tracing where a dynamic dim of size 1 is not specialized to 1 (torch.export otherwise
    takes the size-1 path of every op: other views and broadcasts than at any other size)."""
    try:
        from torch.fx.experimental import _config as fx_config
    except ImportError:   # torch without the switch: specialized as before
        yield
        return
    if not hasattr(fx_config, "backed_size_oblivious"):
        yield
        return
    with fx_config.patch(backed_size_oblivious=True):
        yield


def _batch_dims(args: tuple) -> tuple:
    """``dynamic_shapes`` for ``args``: dim 0 of every tensor is the batch's, of any size."""
    dim = getattr(torch.export.Dim, "DYNAMIC", None) or torch.export.Dim("batch", min=1)
    return tuple({0: dim} if isinstance(a, torch.Tensor) and a.ndim else None for a in args)


# torch.export patches process-wide settings while it traces (a dynamic batch's size-oblivious sizes, torch's
# flex_attention device check): the ranks of the in-process world (threads) trace one at a time
_EXPORT_LOCK = threading.RLock()


def export(model: torch.nn.Module, args: tuple, dynamic_batch: bool = False) -> "torch.export.ExportedProgram":
    """Exports ``model(*args)`` to ATen training IR (a long stack of identical blocks is
    exported once and repeated: ``cube.trace.repeat``).

    With ``dynamic_batch``, dim 0 of every tensor of ``args`` is traced as a size of any value, so
    a batch of one sample takes the same ops as any larger batch (a pipeline's micro-batches of
    one sample, compared op for op with the global batch); the graph's sizes are this batch's.

    A model on the meta device is traced on it, whatever device ``args`` are on
    (``_on_one_device``); a batch on another device than a real model's is moved there.

    Raises:
        TraceError: export failed; the message holds the model's location, the
            line of the model it failed on and the exporter's own message.
    """
    try:
        with _EXPORT_LOCK, _on_one_device(model, tuple(args)) as traced_args, flex.device_check_off(), \
                functions.watch() as applied:
            # new tensor objects over the same data: a dynamic export marks the tensors it is given (torch's
            # _dynamo_dynamic_indices), which a later static export of the same batch would read
            traced_args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in traced_args)
            if dynamic_batch:
                with _sizes_not_specialized():
                    program = torch.export.export(model, traced_args, dynamic_shapes=_batch_dims(traced_args),
                                                  strict=False)
            else:
                def whole():
                    return torch.export.export(model, traced_args, strict=False)
                program = export_repeated(model, whole) or whole()
        functions.report(applied)
        return program
    except Exception as e:  # any failure of export becomes one clear error
        where = _user_frame(e)
        first = str(e).strip().splitlines()
        msg = "\n".join(first[:12])
        if _data_dependent(e):
            fix = _branch_fix(where) if _BRANCH.search(where) else _DATA_DEPENDENT_FIX
        else:
            fix = ("Fix: make forward traceable for the sample batch (no data-dependent Python control "
                   "flow on tensor values, no unsupported ops), or wrap the offending part in a function "
                   "registered with cube.register_op.")
        raise TraceError(
            f"cube could not trace {_model_location(model)} with torch.export (non-strict).\n"
            + (f"It failed at {where}\n" if where else "")
            + f"{type(e).__name__}: {msg}\n" + fix) from e


_DATA_DEPENDENT_FIX = (
    "The shape of a tensor there depends on the values of another (a data-dependent shape: .tolist() or "
    ".item() feeding a size, boolean indexing, nonzero, tokens split per expert by their counts). cube "
    "compiles a static graph whose every shape follows from the batch's shape. Fix: compute with fixed "
    "shapes (pad to a capacity, a dense dispatch over all experts, torch.where instead of boolean "
    "indexing), or wrap the code in a function registered with cube.register_op.")


# the failing line is a Python branch (``if x < p:``): export could not decide it from the batch's shape
_BRANCH = re.compile(r" in \w+: (if|elif|while|assert)\b|\bif\b.*\belse\b")


def _branch_fix(where: str) -> str:
    """The fix for a Python branch on a tensor's value; LayerDrop (Hugging Face's
    ``if torch.rand([]) < self.layerdrop: continue``, on by default in M2M100 and NLLB-MoE) by name."""
    head = ("A Python branch there reads a tensor's value (a test of the data, or a random choice each step); "
            "cube compiles one static graph, the same on every rank, micro-batch and step. ")
    if "layerdrop" in where.lower():
        return head + ("It is LayerDrop: each training step skips whole layers at random. Fix: set the model's "
                       "layer drop probability to 0 (Hugging Face: config.encoder_layerdrop = "
                       "config.decoder_layerdrop = 0.0, or config.layerdrop = 0.0) before building the model.")
    return head + ("Fix: compute both branches and pick with torch.where, decide it outside forward (a Python "
                   "number, not a tensor), or wrap the code in a function registered with cube.register_op.")


def _data_dependent(e: BaseException) -> bool:
    """Whether export failed on a size computed from a tensor's values (an unbacked symbol)."""
    while e is not None:
        if "DataDependent" in type(e).__name__ or "data-dependent" in str(e)[:300]:
            return True
        e = e.__cause__ or e.__context__
    return False
