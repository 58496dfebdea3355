"""Costs on a cluster described by a hardware profile (``cube.sim.hardware``), not measured here.

``DeviceCosts``: an op piece's seconds from its FLOPs and bytes at its local
shapes: ``max(flops / (peak * efficiency(flops)), bytes / memory rate)`` on the
device, with the profile's efficiency curve of the op's class (GEMM, attention,
convolution; others are bound by memory), the backward a multiple of the
forward (per op class), AdamW bound by memory. Under mixed precision (the plan's
``precision``) each tensor is counted at the dtype it has when the rank runs
(``cube.sim.precision``), and an op pays the cast of each input it reads in
another dtype (a copy, and its gradient's back): autocast's, from its op lists,
or the casts a main-parameter plan's generated code prints (``cube.passes.precision``). The
host: a profile's ``launch_us`` is added to every op (dispatch the device does
not hide); with a calibrated ``host_us_per_op`` (the host's seconds per op of
an eager training step, forward and backward) ops cost the device alone and
the host issues them on a clock of its own (``cube.sim.engine``), so a busy
device hides the host and a slow host leaves the device waiting.

Under ``precision="fp8"`` every op is priced as under ``"bf16"`` except the linear layers the
plan runs in float8 (``cube.passes.precision.LowPrecision.float8``): their forward product and
the two backward products on the profile's ``fp8`` peak (its GEMM curve), and the amax, scale and
cast passes ``cube.runtime.float8`` runs around them (fused by ``torch.compile`` on CUDA unless
``CUBE_FP8_FUSED=0``), each bound by memory and launched on its own (``cube.sim.float8``);
autograd keeps their 1-byte operands. A profile
without an ``fp8`` peak refuses it.

``ClusterComm``: collectives over the ranks they actually join. Ranks are
numbered node by node (``rank // gpus_per_node`` is the node, as torchrun and
Megatron number them). Inside a node, the NVLink bus bandwidth; across nodes
a ring runs at the slower of NVLink and the InfiniBand rails the group has on
each node (one rail per GPU, ``nic_gbps_per_gpu``), and an all-reduce takes the
cheaper of that ring and NCCL's tree (latency growing with log2 of the nodes).
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Optional, Sequence, Tuple, Union

import torch

from cube import config
from cube.ir.ops import flops as op_flops
from cube.ir.tensor import TensorKind
from cube.ir.ops import op_info
from cube.sim.comm import shape_of
from cube.passes.precision import low_weight
from cube.runtime.amp import DTYPES
from cube.sim.float8 import Float8Seconds, float8_linear, product_bytes
from cube.sim.costs import Estimator, OpCost, adamw_workspace, local_shapes, needs_grad
from cube.sim.hardware import Hardware, mfu_precision

PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2, "tf32": 4, "fp32": 4}


class DeviceCosts(Estimator):
    """Op, optimizer and copy costs of one device of ``hardware`` training at ``precision``
    (``bf16``/``fp16``: matmuls on the half-precision peak; ``fp8``: as ``bf16``, the float8
    linear layers' products on the fp8 peak; None: float32 on the fp32 peak).

    ``half_model``: price the step as a runtime that keeps the model itself in the low precision
    (Megatron-LM's fp16/bf16 training: half-precision weights and activations, float32 main
    parameters in the optimizer): every float activation at 2 bytes and no autocast casts. By
    default the step is priced as cube runs it (``torch.autocast`` over float32 weights).

    ``moe_imbalance``: in a MoE layer split by experts, the busiest rank of an expert parallel group
    receives this many times the mean (token, expert) rows (1: a balanced router); its all-to-alls
    and its experts' compute grow by it, and so does the step (``cube.sim.program``)."""

    def __init__(self, hardware: Hardware, precision: Optional[str] = "bf16", half_model: bool = False,
                 moe_imbalance: float = 1.0):
        if hardware.is_host:
            raise ValueError(f"{hardware.name!r} is this host: its costs are measured (cube.sim.profile), not "
                             f"read from a profile")
        if not moe_imbalance >= 1.0:
            raise ValueError(f"moe_imbalance={moe_imbalance!r}: the busiest rank of an expert parallel group "
                             f"receives at least the mean rows; pass 1 (balanced) or more (1.2: 20% over the mean)")
        super().__init__()
        self.moe_imbalance = float(moe_imbalance)
        self.hw = hardware
        self.precision = precision or "fp32"
        # fp8: every product but the float8 linears' on the bf16 peak (refused without an fp8 peak)
        self.fp8_peak = hardware.peak_flops("fp8") if self.precision == "fp8" else None
        self.peak = hardware.peak_flops(mfu_precision(self.precision))
        self.act_bytes = PRECISION_BYTES.get(self.precision, 4)
        self.launch = hardware.launch
        factor = hardware.device.get("backward_factor", 2.0)
        # one factor for every op, or one per op class ("default" for the rest)
        self.backward_factors = {k: float(v) for k, v in factor.items()} if isinstance(factor, dict) else {}
        self.backward_factor = float(self.backward_factors.get("default", 2.0) if self.backward_factors
                                     else factor)
        host = hardware.device.get("host_us_per_op")
        self.host = (host["forward"] * 1e-6, host["backward"] * 1e-6) if host else None
        self.low = DTYPES.get(self.precision)   # autocast's dtype (None in float32)
        self.half_model = bool(half_model) and self.low is not None
        self.price_casts = not self.half_model   # cube.sim.program prices the weights' casts
        self.dtypes: Optional[dict] = None       # activation id -> dtype under autocast (bind_dtypes)
        self.casts: Optional[dict] = None        # the low-precision forward's casts (bind_dtypes)
        self.float8: dict = {}                   # ids of the traced ops run in float8 (bind_dtypes)
        self._memo: dict = {}

    def bind_dtypes(self, dtypes: Optional[dict], casts: Optional[dict] = None, float8: Optional[dict] = None,
                    precision: Optional[str] = None) -> None:
        """The dtypes of the graph about to be simulated (``cube.sim.precision.run_dtypes``; None:
        every float tensor at the precision's activation size; always so for a ``half_model``).
        ``casts``: a main-parameter plan's casts (``cube.passes.precision.LowPrecision.casts``), the
        only ones its ops pay; None: autocast's, from each op's list. ``float8``: the ops the plan
        runs in float8 (``LowPrecision.float8``); ``precision``: the graph's.

        Raises:
            ValueError: the graph runs ``precision="fp8"`` and these costs another precision, or
                the reverse (the float8 products would be priced at the wrong rate, or not at all).
        """
        if precision is not None and (precision == "fp8") != (self.precision == "fp8"):
            raise ValueError(f"DeviceCosts({self.hw.name!r}, {self.precision!r}) prices a plan traced with "
                             f"precision={precision!r}: pass the same precision to both (DeviceCosts(hardware, "
                             f"{precision!r}) and simulate_policy(..., precision={precision!r}))")
        self.dtypes = None if self.half_model else dtypes
        self.casts = None if self.half_model else casts
        self.float8 = dict(float8 or {})

    def _dtype(self, t):
        """``t``'s dtype when the op runs (autocast's, once bound; a main-parameter plan's weights
        in its low precision)."""
        if self.dtypes is None:
            return t.dtype
        if self.casts is not None and self.low is not None and low_weight(t):
            return self.low
        return self.dtypes.get(id(t), t.dtype)

    def _itemsize(self, t) -> int:
        if not t.dtype.is_floating_point:
            return t.dtype.itemsize
        return self.act_bytes if self.dtypes is None else self._dtype(t).itemsize

    def op_cost(self, call) -> OpCost:
        ins, outs = local_shapes(call)
        op = call.op
        # the same op at the same shapes costs the same: thousands of layers and micro-batches repeat
        fp8 = self.is_float8(op)
        key = (op.name, tuple(map(tuple, ins)), tuple(map(tuple, outs)), tuple(map(self._dtype, op.inputs)),
               tuple(map(self._dtype, op.outputs)), tuple(self._targets(op)), needs_grad(call), _causal(op), fp8)
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self._float8_cost(call, ins, outs) if fp8 else super().op_cost(call)
        return got

    def is_float8(self, op) -> bool:
        """Whether the op piece runs as ``cube.runtime.float8.linear`` (the plan's float8 set)."""
        return bool(self.float8) and id(op.root) in self.float8

    def _float8_cost(self, call, ins, outs) -> OpCost:
        """A float8 linear piece's ``OpCost``: ``float8_seconds``, each kernel launched on its own
        (the profile's ``launch_us``); autograd keeps the float8 input and weight and their scales."""
        got = self.float8_seconds(call, ins, outs)
        grad = needs_grad(call)
        fw = got.products[0] + got.passes[0] + got.casts
        bw = got.products[1] + got.products[2] + got.passes[1] + got.casts if grad else 0.0
        if self.host is None:   # one launch per kernel: the products, and every pass around them
            fw += self.launch * got.launches[0]
            if grad:
                bw += self.launch * got.launches[1]
        saved = tuple(("x", n) for n in got.work.saved) if grad else ()
        return OpCost(fw, bw, saved, tuple(-1 for _ in call.op.outputs), measured=False)

    def float8_seconds(self, call, ins=None, outs=None) -> Float8Seconds:
        """The device seconds of a float8 linear piece (``cube.sim.float8``), at its local shapes:
        its three products on the fp8 peak with the profile's GEMM curve, each at least its 1-byte
        operands' and its output's bytes at the memory rate; the amax, scale and cast passes and
        column-major copies around them, bound by memory."""
        if ins is None:
            ins, outs = local_shapes(call)
        op = call.op
        nx, nw, no = _numel(ins[0]), _numel(ins[1]), _numel(outs[0])
        sx, sw, so = self._read_itemsize(op, 0), self._read_itemsize(op, 1), self._itemsize(op.outputs[0])
        grad = needs_grad(call)
        grad_x = grad and op.inputs[0].requires_grad and 0 not in call.layout.unread
        bias = (_numel(ins[2]), self._read_itemsize(op, 2)) if len(op.inputs) > 2 else None   # linear(x, w, b)
        work = float8_linear((nx, sx), (nw, sw), (no, so), grad_x, bias, fused=config.fp8_fused() != "0")
        flops = op_flops(op.name, ins, outs)
        compute = flops / (self.fp8_peak * self.hw.curve(op_info(op.name).cost).at(flops)) if flops else 0.0
        rate = self.hw.memory_rate

        def product(a: int, b: int, nbytes: int) -> float:
            return max(compute, product_bytes(a, b, nbytes) / rate)

        products = (product(nx, nw, no * so),                                  # out = x8 @ w8.T
                    product(no, nx, nw * sw) if grad else 0.0,                 # grad_w = g8.T @ x8
                    product(no, nw, nx * sx) if grad_x else 0.0)               # grad_x = g8 @ w8
        passes = (work.forward.bytes / rate, work.backward.bytes / rate if grad else 0.0)
        launches = (1 + work.forward.kernels, (1 + grad_x + work.backward.kernels) if grad else 0)
        return Float8Seconds(products, passes, launches, self._cast_seconds(op, ins), work)

    def _read_itemsize(self, op, k: int) -> int:
        """Bytes per element of input ``k`` as the op reads it (after a cast the plan prints)."""
        t = op.inputs[k]
        target = self._targets(op)[k]
        return target.itemsize if target is not None else self._itemsize(t)

    def _cast_seconds(self, op, ins) -> float:
        """Seconds of the copies of the inputs ``op`` reads in another dtype than they have."""
        nbytes = sum(_numel(s) * (self._itemsize(t) + target.itemsize)
                     for s, t, target in zip(ins, op.inputs, self._targets(op)) if target is not None)
        return nbytes / self.hw.memory_rate

    def _targets(self, op):
        """Per input of ``op``: the dtype it is cast to before the op reads it, or None."""
        if self.casts is not None:   # a main-parameter plan: the casts its generated code prints
            wanted = self.casts.get(id(op.root), {})
            return [wanted.get(id(t.logical)) for t in op.inputs]
        target = None
        if self.dtypes is not None and self.low is not None:
            target = {"low": self.low, "fp32": torch.float32}.get(op_info(op.name).autocast)
        if target is None:
            return [None] * len(op.inputs)
        # weights: autocast casts them once per forward call (cube.sim.program)
        return [target if t.dtype.is_floating_point and self._dtype(t) != target and t.kind is not TensorKind.PARAM
                else None for t in op.inputs]

    def backward_seconds(self, op, fw: float) -> float:
        return self.backward_factors.get(op_info(op.name).cost, self.backward_factor) * fw

    def device_seconds(self, op, ins, outs) -> Tuple[float, float]:
        """``(the op's kernel, autocast's casts of its inputs)``: device seconds of the forward."""
        nbytes = 0
        for s, t, target in zip(ins, op.inputs, self._targets(op)):   # each read in the dtype the op runs in
            nbytes += _numel(s) * (target.itemsize if target is not None else self._itemsize(t))
        nbytes += sum(_numel(s) * self._itemsize(t) for s, t in zip(outs, op.outputs))
        op_class = op_info(op.name).cost
        flops = op_flops(op.name, ins, outs)
        work = flops
        if op_class == "attention" and _causal(op):
            work = flops / 2   # fused attention kernels skip the blocks the causal mask hides
        compute = work / (self.peak * self.hw.curve(op_class).at(flops)) if flops else 0.0
        return max(compute, nbytes / self.hw.memory_rate), self._cast_seconds(op, ins)

    def seconds(self, op, ins, outs, is_view: bool, grad: bool) -> Tuple[float, float]:
        if is_view:
            return 0.0, 0.0   # metadata only: no kernel
        kernel, cast = self.device_seconds(op, ins, outs)
        fw, bw = kernel + cast, (self.backward_seconds(op, kernel) + cast if grad else 0.0)   # casts' grads back
        if self.host is None:
            return self.launch + fw, (self.launch + bw if grad else 0.0)
        return fw, bw   # the host's dispatch runs on its own clock (host_seconds)

    def host_seconds(self, cat: str) -> float:
        if self.host is None:
            return 0.0
        return self.host[1] if cat == "backward" else self.host[0]

    def forward_seconds(self, op, ins, outs, is_view: bool) -> float:
        return self.seconds(op, ins, outs, is_view, False)[0]

    def optimizer_cost(self, numels: Sequence[int]) -> float:
        per_param = float(self.hw.device.get("optimizer_bytes_per_param", 28))
        # multi-tensor AdamW: a few kernels per group of tensors, bound by memory
        launch = self.launch if self.host is None else 0.0   # with a host clock: the host's, not the device's
        return 4 * launch * max(1, len(numels) // 32) + sum(numels) * per_param / self.hw.memory_rate

    def optimizer_workspace(self, numels: Sequence[int]) -> int:
        """AdamW's temporaries as its multi-tensor (``foreach``) step on a GPU makes them."""
        return adamw_workspace(numels, foreach=True)

    def copy_cost(self, nbytes: int) -> float:
        return (self.launch if self.host is None else 0.0) + 2 * nbytes / self.hw.memory_rate


def _causal(op) -> bool:
    """Whether an attention op masks causally (``is_causal``, keyword or sixth argument)."""
    if op_info(op.name).cost != "attention":
        return False
    return bool(op.kwargs.get("is_causal", op.args[5] if len(op.args) > 5 else False))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class ClusterComm:
    """Collective costs on the profile's network (see the module docstring). ``cost(kind, nbytes,
    ranks)`` takes the ranks (or their count, for ranks ``0..n-1``)."""

    backend = "nccl"
    calibrated = False

    def __init__(self, hardware: Hardware):
        net = hardware.network
        self.hw = hardware
        self.gpus = hardware.gpus_per_node
        self.intra_bus = net["intra"]["busbw_gbps"] * 1e9
        self.intra_p2p = net["intra"].get("p2p_gbps", net["intra"]["busbw_gbps"]) * 1e9
        self.intra_alpha = net["intra"]["alpha_us"] * 1e-6
        inter = net.get("inter")
        self.rail = inter["nic_gbps_per_gpu"] * 1e9 * inter.get("efficiency", 1.0) if inter else 0.0
        self.inter_alpha = inter["alpha_us"] * 1e-6 if inter else 0.0

    def _nodes(self, ranks) -> Counter:
        return Counter(r // self.gpus for r in ranks)

    def cost(self, kind: str, nbytes: int, ranks: Union[int, Sequence[int]]) -> float:
        ranks = list(range(ranks)) if isinstance(ranks, int) else list(ranks)
        n = len(ranks)
        if kind != "p2p" and n <= 1:
            return 0.0
        nodes = self._nodes(ranks)
        if kind == "p2p":
            if len(nodes) <= 1:
                return self.intra_alpha + nbytes / self.intra_p2p
            return self.inter_alpha + nbytes / self._rail()
        k, local = len(nodes), max(nodes.values())
        if kind == "all_to_all":   # pairwise sends at once; what leaves the node goes through its rails
            share = nbytes / n
            intra = (local - 1) * share / self.intra_p2p
            inter = (n - local) * share / self._rail() if k > 1 else 0.0   # each rank its own rail
            return (self.inter_alpha if k > 1 else self.intra_alpha) + max(intra, inter)
        steps, factor = shape_of(kind, n)
        if k == 1:
            return steps * self.intra_alpha + factor * nbytes / self.intra_bus
        bus = min(self.intra_bus, local * self._rail())
        ring = steps * self.inter_alpha + factor * nbytes / bus
        if kind != "all_reduce":
            return ring
        # NCCL's tree: ring inside each node, double binary tree across nodes
        tree = 2 * (math.ceil(math.log2(k)) * self.inter_alpha + (local - 1) * self.intra_alpha) + \
            2 * nbytes / bus
        return min(ring, tree)

    def _rail(self) -> float:
        if not self.rail:
            raise ValueError(f"hardware profile {self.hw.name!r} has no inter-node network (network.inter), but "
                             f"the plan spans more than one node of {self.gpus} devices")
        return self.rail

    def to_json(self) -> dict:
        return {"backend": self.backend, "hardware": self.hw.name, "calibrated": False}
