"""Errors cube raises that are not about a user's input.

A user's mistake (a model cube cannot trace, a policy that splits an op the
wrong way, a batch of another shape) is a ``ValueError`` or ``TypeError``
naming the object and the fix. :class:`CubeInternalError` is the other kind:
an invariant of cube's own work broke, so the fix belongs in cube.
"""
from __future__ import annotations


class CubeInternalError(RuntimeError):
    """An invariant of cube's own planning broke: a bug in cube, never a user's mistake."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, a rank that died, ...); raised by the call after an
    asynchronous save failed (the next ``save_checkpoint`` or ``cube.wait_checkpoint()``). The directory of
    that save has no ``meta.json``, so no reader takes it for a checkpoint."""


class NonFiniteError(RuntimeError):
    """A training step produced a NaN or Inf in the loss or a gradient (``cube.check_finite(...,
    on_nonfinite="stop")``); the message names the step, the rank and the gradients, and how to find
    the op that produced it (``cube.find_nonfinite``)."""
