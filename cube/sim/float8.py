"""What a float8 linear piece does beyond bf16's, as ``cube.runtime.float8`` runs it in eager kernels.

``precision="fp8"`` (``cube.passes.float8``) runs each chosen ``aten.linear`` as
``cube.runtime.float8.linear``: its three matrix products go through ``torch._scaled_mm`` on
1-byte operands, and around them eager PyTorch launches one kernel per operation of the recipe.
Per operand of ``n`` elements of ``s`` bytes (the input and weight in forward, the output's
gradient in backward) that is, in order:

- the amax: ``abs`` (reads ``s n``, writes ``s n``), ``max`` (reads ``s n``), its ``to(float32)``
  (a scalar; no kernel when ``s`` is 4);
- one ``stack`` of the amaxes (per direction; a vector of float32), then per operand the scale
  ``fp8_max / clamp(amax.double())``: five scalar kernels;
- the cast: ``to(float32)`` (reads ``s n``, writes ``4 n``; none when ``s`` is 4), ``* scale`` and
  ``clamp`` (each reads and writes ``4 n``), ``to(float8)`` (reads ``4 n``, writes ``n``).

Each product takes the reciprocals of its two scales (two scalar kernels) and a column-major copy
of an operand that is not (``scaled_mm``): none in forward, the weight's in the input's gradient,
the gradient's and the input's in the weight's (each reads and writes its ``n`` bytes). A bias is
one more kernel each way: its add (reads the output and the bias, writes the output) and its
gradient's sum (reads the output's gradient, writes the bias's). Autograd keeps the 1-byte input
and weight and their two float32 scales, not the bf16 input. ``tests/test_sim_float8.py`` counts
all of this on a real call.

On a CUDA device the runtime fuses each amax and each cast into one ``torch.compile`` kernel
(``CUBE_FP8_FUSED``, default ``auto``; ``cube.runtime.float8``): the amax reads ``s n`` bytes and
the cast reads ``s n`` and writes ``n``, one launch each. The simulator prices a GPU, so it prices
the fused kernels unless ``CUBE_FP8_FUSED=0`` asks for the eager ones above.

A kernel costs its bytes at the device's memory rate; each one's launch is the profile's
``launch_us`` (``cube.sim.cluster.DeviceCosts``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

SCALE_KERNELS = 5   # to(float64), clamp, reciprocal and mul (fp8_max / amax), to(float32)
SCALE_BYTES = 4     # each saved scale: a float32 scalar


@dataclass(frozen=True)
class Passes:
    """Memory-bound work: ``bytes`` moved by ``kernels`` kernels."""

    bytes: int = 0
    kernels: int = 0

    def __add__(self, other: "Passes") -> "Passes":
        return Passes(self.bytes + other.bytes, self.kernels + other.kernels)


def amax(n: int, s: int, fused: bool = False) -> Passes:
    """``x.detach().abs().max().to(float32)`` of ``n`` elements of ``s`` bytes (``fused``: one kernel)."""
    return Passes(s * n, 1) if fused else Passes(3 * s * n, 2 + (s != 4))


def quantize(n: int, s: int, fused: bool = False) -> Passes:
    """``(x.to(float32) * scale).clamp(-top, top).to(float8)`` of ``n`` elements of ``s`` bytes
    (``fused``: one kernel reading the operand and writing its float8 copy)."""
    if fused:
        return Passes((s + 1) * n, 1)
    widen = Passes((s + 4) * n, 1) if s != 4 else Passes()
    return widen + Passes(8 * n + 8 * n + 5 * n, 3)


def scaled(operands, fused: bool = False) -> Passes:
    """Amaxes, one stack, scales and casts of ``operands`` (each ``(elements, bytes each)``)."""
    out = Passes(4 * len(operands), 1)   # torch.stack of the float32 amaxes (all-reduced when ranks share scales)
    for n, s in operands:
        out = out + amax(n, s, fused) + quantize(n, s, fused) + Passes(0, SCALE_KERNELS)
    return out


def copy(n: int) -> Passes:
    """A column-major copy of a 1-byte operand of ``n`` elements."""
    return Passes(2 * n, 1)


PRODUCT = Passes(0, 2)   # the reciprocals of a product's two scales


@dataclass(frozen=True)
class Float8Linear:
    """What one float8 linear piece moves around its products.

    Attributes:
        forward: the passes before and around the forward product (amax, scale and cast of the
            input and weight; the product's reciprocals; a bias's add).
        backward: the output gradient's amax, scale and cast, the two products' reciprocals and
            column-major copies, a bias's gradient.
        saved: bytes of each tensor autograd keeps for backward: the float8 input, its scale, the
            float8 weight, its scale.
    """

    forward: Passes
    backward: Passes
    saved: Tuple[int, ...]


def float8_linear(x: Tuple[int, int], w: Tuple[int, int], out: Tuple[int, int], grad_x: bool,
                  bias: Optional[Tuple[int, int]] = None, fused: bool = False) -> Float8Linear:
    """The passes of a float8 linear whose input, weight, output and bias have ``(elements, bytes
    each)`` ``x``, ``w``, ``out``, ``bias`` (None: no bias; the output's gradient has the output's
    dtype); ``grad_x``: the input needs a gradient (the weight always does: ``cube.passes.float8``
    converts trainable ones); ``fused``: each amax and cast one kernel (the runtime's on CUDA)."""
    (nx, _), (nw, _), (no, so) = x, w, out
    forward = scaled([x, w], fused) + PRODUCT
    backward = scaled([out], fused) + PRODUCT + copy(no) + copy(nx)   # grad_w = g8.t() @ x8: both copied
    if grad_x:
        backward = backward + PRODUCT + copy(nw)                # grad_x = g8 @ w8: the weight copied
    if bias is not None:
        nb = bias[0] * bias[1]
        forward = forward + Passes(2 * so * no + nb, 1)
        backward = backward + Passes(so * no + nb, 1)
    return Float8Linear(forward, backward, (nx, SCALE_BYTES, nw, SCALE_BYTES))


def product_bytes(a: int, b: int, out: int) -> int:
    """Bytes one ``_scaled_mm`` moves: its two 1-byte operands of ``a`` and ``b`` elements and its
    output of ``out`` bytes."""
    return a + b + out


@dataclass(frozen=True)
class Float8Seconds:
    """Device seconds of one float8 linear piece (``cube.sim.cluster.DeviceCosts.float8_seconds``).

    Attributes:
        products: the forward product, the weight's gradient, the input's (0 when it needs none):
            each the larger of its FLOPs on the fp8 peak and its bytes at the memory rate.
        passes: ``(forward, backward)`` seconds of the memory-bound kernels around them (``Float8Linear``).
        launches: ``(forward, backward)`` kernels launched (products included).
        casts: seconds of the copies of inputs read in another dtype (each way, as under bf16).
        work: what the passes move and what autograd keeps.
    """

    products: Tuple[float, float, float]
    passes: Tuple[float, float]
    launches: Tuple[int, int]
    casts: float
    work: Float8Linear
