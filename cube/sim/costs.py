"""Compute costs of op pieces: what the simulator asks, and estimates that need no measurement.

A cost model answers three questions (the ``Profiler`` measures, the others estimate):

- ``op_cost(call)``: an op piece's forward and backward seconds at its local
  shapes, and which of its tensors autograd keeps for backward (``OpCost``);
- ``optimizer_cost(numels)``: seconds of one AdamW step over tensors of these sizes, and
  ``optimizer_workspace(numels)``: the bytes of the temporaries it allocates while it runs;
- ``copy_cost(nbytes)``: seconds to copy that many bytes (flattening buckets, chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

from cube.ir.layout import box_shape
from cube.ir.ops import flops as op_flops
from cube.ir.ops import op_info
from cube.passes.rank_plans import Call


@dataclass
class OpCost:
    """Cost of one op piece.

    Attributes:
        fw: forward seconds.
        bw: backward seconds (0 when nothing it reads needs a gradient).
        saved: what autograd keeps for backward: ``("in", k)`` input ``k``,
            ``("out", j)`` output ``j``, ``("x", nbytes)`` a tensor of its own.
        alias: per output, the input whose memory it shares (a view), else -1.
        measured: True when timed on the device, False when estimated.
    """

    fw: float
    bw: float = 0.0
    saved: Tuple[tuple, ...] = ()
    alias: Tuple[int, ...] = ()
    measured: bool = False

    def to_json(self) -> dict:
        return {"fw": self.fw, "bw": self.bw, "saved": [list(s) for s in self.saved],
                "alias": list(self.alias), "measured": self.measured}

    @staticmethod
    def from_json(d: dict) -> "OpCost":
        return OpCost(d["fw"], d["bw"], tuple(tuple(s) for s in d["saved"]), tuple(d["alias"]), d["measured"])


def adamw_workspace(numels: Sequence[int], foreach: bool, itemsize: int = 4) -> int:
    """Bytes of the temporaries ``torch.optim.AdamW`` allocates during its step: the ``foreach``
    implementation (torch's default for CUDA tensors) makes ``sqrt(exp_avg_sq)`` for every tensor of
    the group at once (one state-sized tensor each); the single-tensor loop (CPU) makes it and its
    quotient for one tensor at a time (two of the largest)."""
    if not numels:
        return 0
    return itemsize * (sum(numels) if foreach else 2 * max(numels))


def local_shapes(call: Call):
    """``(input shapes, output shapes)`` of an op piece: the boxes of its layout."""
    lay = call.layout
    return [box_shape(b) for b in lay.inputs], [box_shape(b) for b in lay.outputs]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def needs_grad(call: Call) -> bool:
    """Whether autograd runs a backward for this op piece (some float input needs a gradient)."""
    op = call.op
    if not op.grad_enabled:
        return False
    unread = set(call.layout.unread)
    return any(t.requires_grad and t.dtype.is_floating_point and k not in unread for k, t in enumerate(op.inputs))


@dataclass
class Estimator:
    """Costs from FLOPs and bytes moved (no measurement): ``max(flops / flops_rate, bytes / mem_rate)``.

    Args:
        flops_rate: FLOP/s of matmul-like ops.
        mem_rate: bytes/s of memory-bound ops and copies.
        launch: seconds of fixed overhead per op (Python and dispatch).
        adam_rate: parameter elements per second one AdamW step updates.
    """

    flops_rate: float = 30e9
    mem_rate: float = 5e9
    launch: float = 10e-6
    adam_rate: float = 150e6
    backward_factor: float = 2.0   # backward seconds per forward second

    def op_cost(self, call: Call) -> OpCost:
        op = call.op
        ins, outs = local_shapes(call)
        is_view = op_info(op.name).alias   # a view of input 0: no new memory
        grad = needs_grad(call)
        fw, bw = self.seconds(op, ins, outs, is_view, grad)
        keeps = op_info(op.name).saves_inputs and not is_view and grad
        saved = tuple(("in", k) for k, t in enumerate(op.inputs) if t.dtype.is_floating_point and keeps)
        alias = tuple(0 if is_view else -1 for _ in op.outputs)
        return OpCost(fw, bw, saved, alias, measured=False)

    def seconds(self, op, ins, outs, is_view: bool, grad: bool) -> Tuple[float, float]:
        """``(forward, backward)`` seconds of ``op`` at local shapes (backward 0 without ``grad``)."""
        fw = self.forward_seconds(op, ins, outs, is_view)
        return fw, self.backward_seconds(op, fw) if grad else 0.0

    def backward_seconds(self, op, fw: float) -> float:
        """Backward seconds of ``op`` whose forward takes ``fw``."""
        return self.backward_factor * fw

    def forward_seconds(self, op, ins, outs, is_view: bool) -> float:
        """Forward seconds of ``op`` at local shapes ``ins``/``outs``."""
        itemsize = op.outputs[0].dtype.itemsize if op.outputs else 4
        nbytes = sum(_numel(s) * t.dtype.itemsize for s, t in zip(ins, op.inputs)) + \
            sum(_numel(s) for s in outs) * itemsize
        out = sum(_numel(s) for s in outs)
        flops = op_flops(op.name, ins, outs) or out   # a memory-bound op: one per output element
        return self.launch + (0.0 if is_view else max(flops / self.flops_rate, nbytes / self.mem_rate))

    def host_seconds(self, cat: str) -> float:
        """Seconds the host spends issuing one compute instruction of category ``cat`` ahead of the
        device (0: the host is the device, or dispatch is in the op's own seconds)."""
        return 0.0

    def optimizer_cost(self, numels: Sequence[int]) -> float:
        return len(numels) * self.launch * 4 + sum(numels) / self.adam_rate

    def optimizer_workspace(self, numels: Sequence[int]) -> int:
        """AdamW's temporaries as its single-tensor loop makes them (a CPU's)."""
        return adamw_workspace(numels, foreach=False)

    def copy_cost(self, nbytes: int) -> float:
        return 2 * nbytes / self.mem_rate


@dataclass
class FixedCosts:
    """Costs given by hand (tests, what-if studies): every op piece costs ``fw`` forward and ``bw``
    backward unless ``by_name`` (op name -> (fw, bw)) or ``fn`` (call -> OpCost or None) says otherwise.

    Saved tensors: an op keeps its float inputs (``saved_inputs``) for backward.
    """

    fw: float = 1.0
    bw: float = 2.0
    by_name: Dict[str, Tuple[float, float]] = field(default_factory=dict)
    fn: Optional[Callable[[Call], Optional[OpCost]]] = None
    optimizer: float = 0.0
    copy_rate: float = 0.0   # bytes/s; 0: copies are free
    saved_inputs: bool = True

    def op_cost(self, call: Call) -> OpCost:
        if self.fn is not None:
            got = self.fn(call)
            if got is not None:
                return got
        fw, bw = self.by_name.get(call.op.name, (self.fw, self.bw))
        grad = needs_grad(call)
        saved = tuple(("in", k) for k, t in enumerate(call.op.inputs)
                      if self.saved_inputs and grad and t.dtype.is_floating_point)
        return OpCost(fw, bw if grad else 0.0, saved, tuple(-1 for _ in call.op.outputs), measured=False)

    def optimizer_cost(self, numels: Sequence[int]) -> float:
        return self.optimizer

    def optimizer_workspace(self, numels: Sequence[int]) -> int:
        return 0

    def copy_cost(self, nbytes: int) -> float:
        return nbytes / self.copy_rate if self.copy_rate else 0.0
