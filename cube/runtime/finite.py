"""NaN and Inf in float32/bf16 runs: a check each step, and a debug mode that names the op.

The fp16 loss scaler skips a step whose gradients overflowed; without it a NaN
or Inf in the loss or a gradient goes into the optimizer and poisons every
parameter from then on. :func:`check_finite`, called after the step and
before ``optimizer.step()``, looks at the loss and this rank's gradients and
agrees with the other ranks in one all-reduce of a flag, so every rank skips
(or stops) together::

    loss = train_iter(model, loader)
    if cube.check_finite(model, loss, on_nonfinite="skip"):   # False: gradients zeroed, step skipped
        optimizer.step()
    optimizer.zero_grad()

:func:`find_nonfinite` is the debug mode: it runs the single-device model's
forward and backward on one batch in this process, watching the output of
every ATen op as it runs, and names the first op whose output holds a NaN or
Inf, with the model's source line that called it (for backward ops, the
forward line of the op whose gradient it computes, as autograd's anomaly
mode records it).
"""
from __future__ import annotations

import logging
import os
import re
import traceback
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cube.errors import NonFiniteError
from cube.runtime import collectives

log = logging.getLogger("cube")
ACTIONS = ("stop", "skip")


def check_finite(model, loss: torch.Tensor, on_nonfinite: str = "stop") -> bool:
    """Whether the loss and every rank's gradients are finite (one all-reduce of a flag; call it on every rank).

    Args:
        model: this rank's module from ``cube.load_model()``, after the step's backward.
        loss: the loss the compiled step returned.
        on_nonfinite: ``"stop"`` raises :class:`cube.errors.NonFiniteError`; ``"skip"`` logs a warning,
            drops the gradients and returns False (do not call ``optimizer.step()`` then).

    Returns:
        True when everything is finite on every rank.

    Raises:
        ValueError: ``on_nonfinite`` is neither ``"stop"`` nor ``"skip"``.
        NonFiniteError: a NaN or Inf with ``on_nonfinite="stop"``.
    """
    if on_nonfinite not in ACTIONS:
        raise ValueError(f"cube.check_finite: on_nonfinite must be one of {ACTIONS}, got {on_nonfinite!r}")
    count = model.__dict__.get("_finite_checks", 0)
    model.__dict__["_finite_checks"] = count + 1
    grads = model.gradients()   # a ZeRO optimizer's gradient chunks too
    flag = torch.zeros(2, device=loss.device)
    flag[0] = (~torch.isfinite(loss.detach())).any()
    if grads:
        flag[1] = ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())
    if dist.is_initialized() and dist.get_world_size() > 1:
        wired = flag.to(collectives.wire(flag.device))
        dist.all_reduce(wired, op=dist.ReduceOp.MAX)
        flag = wired
    bad_loss, bad_grads = (bool(v) for v in flag.tolist())
    if not (bad_loss or bad_grads):
        return True
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = [model.PARAMS[local][0][0] for local, p in model.named_parameters()
            if p.grad is not None and not torch.isfinite(p.grad).all()]
    if bad_grads and not mine and any(not torch.isfinite(g).all() for g in grads):
        mine = ["(a ZeRO gradient chunk)"]
    what = []
    if bad_loss:
        what.append(f"the loss is {loss.detach().float().item()}")
    if bad_grads:
        what.append(f"gradients are not finite ({f'on rank {rank}: {mine[:5]}' if mine else 'on other ranks'}"
                    f"{f' and {len(mine) - 5} more' if len(mine) > 5 else ''})")
    message = (f"step {count} (counting checks) of {type(model).__name__}: {' and '.join(what)}. To name the first "
               f"op that made it, run cube.find_nonfinite(model, *batch) on the single-device model with this "
               f"step's batch and the parameters before it (cube.merge_checkpoint of the latest checkpoint)")
    if on_nonfinite == "stop":
        raise NonFiniteError(message)
    log.warning("cube: skipping %s", message)
    for p in model.parameters():
        p.grad = None
    zero = getattr(model, "_zero", None)
    for shard in (zero.shards if zero is not None else ()):
        shard.param.grad = None
    model.__dict__["_skipped_steps"] = model.__dict__.get("_skipped_steps", 0) + 1
    return False


@dataclass(frozen=True)
class NonFiniteOp:
    """The first op whose output was not finite.

    Attributes:
        op: the ATen op (``aten.log.default``).
        phase: ``"forward"`` or ``"backward"``.
        where: the model's source line that called it (``file:line: code``), or ``""`` when unknown.
        value: what the output held (``nan``, ``inf``...).
    """

    op: str
    phase: str
    where: str
    value: str

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.op} ({self.phase}){at} made {self.value}"


_SKIP = (os.sep + "torch" + os.sep, os.sep + "cube" + os.sep + "runtime" + os.sep, "<frozen")


def _user_line(stack: List[traceback.FrameSummary]) -> str:
    for f in reversed(stack):
        if not any(s in f.filename for s in _SKIP) and not f.filename.endswith("contextlib.py"):
            return f"{f.filename}:{f.lineno}: {(f.line or '').strip()}"
    return ""


class _Watch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found: Optional[NonFiniteOp] = None
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.found is None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() \
                        and not torch.isfinite(t).all():
                    value = "nan" if torch.isnan(t).any() else "inf"
                    where = _user_line(traceback.extract_stack()) if self.phase == "forward" else _forward_line()
                    self.found = NonFiniteOp(str(func), self.phase, where, value)
                    break
        return out


def _forward_line() -> str:
    """The model line of the forward op whose backward is running (anomaly mode's record), or ``""``."""
    node = torch._C._current_autograd_node()
    trace = getattr(node, "metadata", {}).get("traceback_", []) if node is not None else []
    text = "".join(t if isinstance(t, str) else "".join(traceback.format_list(t)) for t in trace)
    lines = text.splitlines()
    for i in reversed(range(len(lines))):
        m = re.match(r'\s*File "(.+)", line (\d+), in ', lines[i])
        if m and not any(s in m.group(1) for s in _SKIP):
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File ") else ""
            return f"{m.group(1)}:{m.group(2)}: {code}"
    return ""


def find_nonfinite(model: torch.nn.Module, *inputs, backward: bool = True) -> Optional[NonFiniteOp]:
    """The first op of ``model(*inputs)`` (then of its backward) whose output holds a NaN or Inf, or None.

    Runs in this process on the single-device model (the original ``nn.Module``, e.g. loaded from
    ``cube.merge_checkpoint``), every ATen op watched as it runs.

    Args:
        model: the single-device model; its forward returns the loss.
        inputs: the step's batch, as the model takes it.
        backward: also run and watch the backward of the loss (when the model returns one scalar).

    Returns:
        The op, its phase, the model's source line and what it made; None when every output is finite.
        A backward op is named with the forward line whose gradient it computes.
    """
    watch = _Watch()
    with torch.autograd.set_detect_anomaly(backward, check_nan=False), watch:
        loss = model(*inputs)
        if watch.found is None and backward and isinstance(loss, torch.Tensor) and loss.requires_grad \
                and loss.numel() == 1:
            watch.phase = "backward"
            loss.backward()
    return watch.found
