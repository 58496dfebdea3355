"""Geometry of a spatial split: which input rows each block of an op's output reads.

A convolution or pooling split along a spatial dim (``h~`` in its annotation)
runs each piece on a *window* of its input: its own block plus a halo from its
neighbours, padded at the global borders as the op's padding would. This module
computes the windows from the op's arguments (kernel, stride, padding,
dilation), checks that a split is one cube computes exactly, and rewrites the
op's arguments for a piece (no padding along a split dim: the window holds it;
an adaptive pool's or an upsampling's output size becomes the block's).

Two geometries read their input differently. A transposed convolution scatters
each input row over ``extent`` output rows ``stride`` apart: an output block
reads the input rows whose contributions land in it, and the piece runs the op
without padding on that window and crops its block out of the result
(:meth:`Stencil.crop`). A linear interpolation (``upsample_bilinear2d``) reads
the two input rows around each output row's source coordinate, which depends
on the global sizes: its window is those rows (plus one each side, so float
rounding of the coordinate never reads past it), and the piece interpolates
with the global coordinates (``cube.runtime.halo.linear``).

Everything here is a pure function of the op; ``cube.passes.inside`` turns it
into the piece's call and ``cube.runtime.halo`` exchanges the windows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from cube.errors import CubeInternalError
from cube.ir.operator import IRFwOperation

Window = Tuple[int, int]   # [start, stop) in the global coordinates of the input dim (may leave [0, size))


@dataclass(frozen=True)
class Stencil:
    """How one spatial dim of an op's output reads its input.

    Attributes:
        size_in, size_out: the input's and the output's size along the dim.
        extent: the input rows one output row reads (``dilation * (kernel - 1) + 1``).
        stride: input rows between two output rows.
        pad: zero (or -inf) rows the op adds before the input.
        upsample: the integer factor of a nearest upsampling (output row ``o`` reads input row
            ``o // upsample``), else 0.
        transposed: a transposed convolution: input row ``i`` adds to output rows
            ``i * stride - pad + [0, extent)``.
        linear: a linear interpolation's ``align_corners`` (None: not one).
        scale: a linear interpolation's input rows per output row (as ATen computes it).
    """

    size_in: int
    size_out: int
    extent: int = 1
    stride: int = 1
    pad: int = 0
    upsample: int = 0
    transposed: bool = False
    linear: Optional[bool] = None
    scale: float = 0.0

    def window(self, o0: int, o1: int) -> Window:
        """The input rows output rows ``[o0, o1)`` read."""
        if self.upsample:
            return o0 // self.upsample, -(-o1 // self.upsample)
        if self.transposed:
            s, p, e = self.stride, self.pad, self.extent
            # every row adding to [o0, o1), and enough rows that the window's own output (which
            # starts at a * s - p and ends at (b - 1) * s - p + e) covers [o0, o1) even where the
            # stride leaves rows no input reaches (stride > extent: they hold only the bias)
            a = min(-(-(o0 + p - e + 1) // s), (o0 + p) // s)
            b = max((o1 - 1 + p) // s + 1, -(-(o1 + p - e) // s) + 1)
            return a, b
        if self.linear is not None:
            # rows floor(src) and floor(src) + 1 of each output row; a coordinate within 1e-4 of an
            # integer may floor either way in ATen's float32, so both rows around it count
            lo = math.floor(self.source(o0) - 1e-4)
            hi = math.floor(self.source(o1 - 1) + 1e-4) + 2
            return max(lo, 0), min(hi, self.size_in)
        return o0 * self.stride - self.pad, (o1 - 1) * self.stride - self.pad + self.extent

    def source(self, o: int) -> float:
        """A linear interpolation's source coordinate of output row ``o`` (ATen's formula)."""
        if self.linear:
            return self.scale * o
        return max(self.scale * (o + 0.5) - 0.5, 0.0)

    def crop(self, o0: int, o1: int) -> int:
        """Where output row ``o0`` lies in the output of a transposed convolution run without
        padding on the window of ``[o0, o1)``."""
        return o0 - (self.window(o0, o1)[0] * self.stride - self.pad)


def spatial(op: IRFwOperation) -> int:
    """The number of spatial dims of a conv/pool/upsampling (``max_pool2d`` -> 2)."""
    if op.name.startswith("conv"):
        return op.inputs[1].ndim - 2
    return next((n for n in (1, 2, 3) if f"{n}d" in op.name), 2)


def _arg(op: IRFwOperation, name: str, default=None):
    names = [a.name for a in op.target._schema.arguments]
    i = names.index(name) if name in names else -1
    if 0 <= i < len(op.args):
        return op.args[i]
    return op.kwargs.get(name, default)


def _per_dim(v, n: int) -> List[int]:
    if v is None:
        return []
    if isinstance(v, int):
        return [v] * n
    v = list(v)
    return v * n if len(v) == 1 else v


def _refuse(op: IRFwOperation, why: str, fix: str) -> ValueError:
    return ValueError(f"spatial split of op {op.name!r} ({op.where()}): {why}. {fix}")


def _conv_padding(op: IRFwOperation, nsp: int) -> List[int]:
    pad = _arg(op, "padding", 0)
    if not isinstance(pad, str):
        return _per_dim(pad, nsp)
    if pad == "valid":
        return [0] * nsp
    w = op.inputs[1].shape[2:]
    dil = _per_dim(_arg(op, "dilation", 1), nsp)
    total = [d * (k - 1) for d, k in zip(dil, w)]
    if any(t % 2 for t in total):
        raise _refuse(op, "padding='same' pads unevenly for this kernel", "Give explicit padding, or keep the op whole")
    return [t // 2 for t in total]


def stencil(op: IRFwOperation, d: int) -> Stencil:
    """The geometry of input 0's spatial dim ``d`` (``>= 2``) of a convolution, pooling or upsampling.

    Raises:
        ValueError: an argument cube does not split exactly (``ceil_mode`` adding a row,
            ``count_include_pad=False`` with padding, an adaptive pool or upsampling by a
            non-integer factor).
    """
    x, out = op.inputs[0], op.outputs[0]
    size_in, size_out = x.shape[d], out.shape[d]
    name = op.name
    if name in PADS:   # output row o is input row o - before (before < 0: rows cut from the front)
        return Stencil(size_in, size_out, 1, 1, _padding(op, d)[0])
    nsp = spatial(op)
    j = d - (x.ndim - nsp)
    if name.startswith("conv_transpose"):
        return _transposed(op, d, j, nsp, size_in, size_out)
    if name.startswith("upsample_linear") or name.startswith("upsample_bilinear") or \
            name.startswith("upsample_trilinear"):
        return _linear(op, j, size_in, size_out)
    if name.startswith("conv"):
        k = op.inputs[1].shape[2 + j]
        dil = _per_dim(_arg(op, "dilation", 1), nsp)[j]
        return Stencil(size_in, size_out, dil * (k - 1) + 1, _per_dim(_arg(op, "stride", 1), nsp)[j],
                       _conv_padding(op, nsp)[j])
    if name.startswith("adaptive"):
        if size_in % size_out:
            raise _refuse(op, f"its output size {size_out} does not divide the input size {size_in} along dim {d}, "
                              f"so its bins overlap unevenly",
                          "Choose sizes whose ratio is an integer, or keep it whole")
        k = size_in // size_out
        return Stencil(size_in, size_out, k, k, 0)
    if name.startswith("upsample_nearest"):
        if size_out % size_in:
            raise _refuse(op, f"it upsamples dim {d} by {size_out}/{size_in}, not an integer factor",
                          "Upsample by an integer factor, or keep it whole")
        return Stencil(size_in, size_out, upsample=size_out // size_in)
    if "pool" in name:
        k = _per_dim(_arg(op, "kernel_size"), nsp)[j]
        stride = _per_dim(_arg(op, "stride", None), nsp) or _per_dim(_arg(op, "kernel_size"), nsp)
        pad = _per_dim(_arg(op, "padding", 0), nsp)[j]
        dil = _per_dim(_arg(op, "dilation", 1), nsp)[j] if name.startswith("max") else 1
        st = Stencil(size_in, size_out, dil * (k - 1) + 1, stride[j], pad)
        if (size_in + 2 * pad - st.extent) // st.stride + 1 != size_out:
            raise _refuse(op, f"ceil_mode=True adds a partial window along dim {d}",
                          "Use ceil_mode=False (or sizes where it adds none), or keep it whole")
        if name.startswith("avg") and pad and not _arg(op, "count_include_pad", True):
            raise _refuse(op, "count_include_pad=False divides border windows by their real size",
                          "Use count_include_pad=True, padding=0, or keep it whole")
        return st
    raise _refuse(op, "cube knows no window geometry for it", "Keep it whole along its spatial dims")


PADS = ("pad", "constant_pad_nd")   # a constant padding: a stencil of one row, shifted (``rules.pad``)


def _padding(op: IRFwOperation, d: int) -> Tuple[int, int]:
    """The rows a pad adds before and after dim ``d`` of its input (its list names the last dim first)."""
    sizes, k = list(_arg(op, "pad")), op.inputs[0].ndim - 1 - d
    return (sizes[2 * k], sizes[2 * k + 1]) if 2 * k + 1 < len(sizes) else (0, 0)


def _transposed(op: IRFwOperation, d: int, j: int, nsp: int, size_in: int, size_out: int) -> Stencil:
    k = op.inputs[1].shape[2 + j]
    dil = _per_dim(_arg(op, "dilation", 1), nsp)[j]
    stride = _per_dim(_arg(op, "stride", 1), nsp)[j]
    pad = _per_dim(_arg(op, "padding", 0), nsp)[j]
    st = Stencil(size_in, size_out, dil * (k - 1) + 1, stride, pad, transposed=True)
    if (size_in - 1) * stride - 2 * pad + st.extent > size_out:
        raise CubeInternalError(f"{op.name} ({op.where()}): output size {size_out} along dim {d} is less than "
                                f"the transposed geometry gives")
    return st


def _linear(op: IRFwOperation, j: int, size_in: int, size_out: int) -> Stencil:
    """ATen's scale (``area_pixel_compute_scale``): ``(in - 1) / (out - 1)`` with
    ``align_corners``, else ``1 / scale_factor`` when one is given, else ``in / out``."""
    align = bool(_arg(op, "align_corners", False))
    if align:
        scale = (size_in - 1) / (size_out - 1) if size_out > 1 else 0.0
    else:
        given = _arg(op, "scale_factors") if "scale_factors" in _names(op) else \
            [_arg(op, n) for n in ("scales_d", "scales_h", "scales_w") if n in _names(op)]
        factor = given[j] if given and j < len(given) else None
        scale = 1.0 / factor if factor is not None and factor > 0 else size_in / size_out
    return Stencil(size_in, size_out, linear=align, scale=scale)


def linear_align(op: IRFwOperation) -> bool:
    """A linear interpolation's ``align_corners``."""
    return bool(_arg(op, "align_corners", False))


def _names(op: IRFwOperation) -> List[str]:
    return [a.name for a in op.target._schema.arguments]


def windows(op: IRFwOperation, d: int, num: int) -> Tuple[Window, ...]:
    """The input window each of ``num`` even blocks of the output reads along dim ``d``."""
    st = stencil(op, d)
    b = st.size_out // num
    return tuple(st.window(i * b, (i + 1) * b) for i in range(num))


def check(op: IRFwOperation, d: int, num: int) -> None:
    """Checks that ``num`` even blocks along input 0's dim ``d`` compute exactly.

    Raises:
        ValueError: the sizes are not divisible by ``num``, the stride does not divide a
            block, the kernel is larger than a block, or a halo reaches past a neighbour's block.
    """
    st = stencil(op, d)
    if st.size_in % num or st.size_out % num:
        fix = f"Choose a number of pieces dividing both (gcd {_gcd(st.size_in, st.size_out)})"
        if st.transposed:
            fix += f", or an output_padding (or padding) making the output size a multiple of {num}"
        raise _refuse(op, f"dim {d} has input size {st.size_in} and output size {st.size_out}, which {num} pieces "
                          f"do not both divide (uneven split)", fix)
    block = st.size_in // num
    if st.transposed or st.linear is not None:   # no kernel or stride limit: only the halo's reach
        _check_reach(op, d, num, st, f"Split into at most {_most_reaching(op, d)} pieces along this dim")
        return
    if not st.upsample and block % st.stride:
        raise _refuse(op, f"the stride {st.stride} does not divide the piece size {block} along dim {d}",
                      "Split into fewer pieces, or choose sizes where the stride divides each piece")
    wins = windows(op, d, num)
    halo = max(max(i * block - a, b - (i + 1) * block) for i, (a, b) in enumerate(wins))
    if st.extent > block:
        raise _refuse(op, f"its kernel spans {st.extent} rows along dim {d} (a halo of up to {halo}), more than "
                          f"a piece's {block} rows (a split finer than the kernel allows)",
                      f"Split into at most {_most(st.size_in, st.size_out, st.extent)} pieces along this dim")
    _check_reach(op, d, num, st, "Split into fewer pieces along this dim")


def _check_reach(op: IRFwOperation, d: int, num: int, st: Stencil, fix: str) -> None:
    """Refuses a split whose windows reach past a neighbour's block (the exchange sends only to
    the next block each side)."""
    block = st.size_in // num
    for i, (a, b) in enumerate(windows(op, d, num)):
        lo, hi = i * block, (i + 1) * block
        # rows outside the tensor are padding, made locally: only rows of the tensor count
        if max(a, 0) < lo - block or min(b, st.size_in) > hi + block:
            raise _refuse(op, f"piece {i} reads {max(lo - max(a, 0), min(b, st.size_in) - hi)} rows of its "
                              f"neighbours along dim {d}, more than a piece of {block} rows (a split finer "
                              f"than the halo allows)", fix)


def _most_reaching(op: IRFwOperation, d: int) -> int:
    """The most even pieces along dim ``d`` whose windows reach no further than a neighbour."""
    st = stencil(op, d)
    best = 1
    for n in range(2, st.size_in + 1):
        if st.size_in % n or st.size_out % n:
            continue
        block = st.size_in // n
        if all(max(a, 0) >= i * block - block and min(b, st.size_in) <= (i + 2) * block
               for i, (a, b) in enumerate(windows(op, d, n))):
            best = n
    return best


def _most(size_in: int, size_out: int, extent: int) -> int:
    """The most pieces whose blocks are at least ``extent`` rows and divide both sizes."""
    return max((n for n in range(1, size_in // extent + 1) if size_in % n == 0 and size_out % n == 0), default=1)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def needs_exchange(op: IRFwOperation, d: int, num: int) -> bool:
    """Whether a block reads rows outside itself (else it runs on its own block)."""
    block = op.inputs[0].shape[d] // num
    return any(w != (i * block, (i + 1) * block) for i, w in enumerate(windows(op, d, num)))


def fill(op: IRFwOperation) -> float:
    """The value the op's padding adds at the global borders."""
    if op.name in PADS:
        value = _arg(op, "value", 0)
        return 0.0 if value is None else float(value)
    return float("-inf") if op.name.startswith("max") else 0.0


def conv_groups(op: IRFwOperation, in_shape: Sequence[int]) -> Optional[int]:
    """The ``groups`` of a grouped convolution's piece whose input 0 has ``in_shape`` (None: not a
    grouped convolution): a depthwise conv split along its channels (``cube.trace.rules.conv``) keeps
    one group per local channel; one split along another dim keeps its groups."""
    groups = _arg(op, "groups", 1) if op.name.startswith("conv") else 1
    if groups <= 1:
        return None
    c = len(in_shape) - op.inputs[1].ndim + 1   # input 0's channel dim (after any batch dims)
    return groups * in_shape[c] // op.inputs[0].shape[c]


def local_args(op: IRFwOperation, split: Sequence[int], exchanged: Sequence[int], out_shape: Sequence[int],
               in_shape: Sequence[int]) -> Tuple[Any, list, dict]:
    """``(target, args, kwargs)`` of a piece that runs on windows along the ``exchanged`` dims.

    Args:
        split: the spatial dims of input 0 that are split.
        exchanged: those of them whose piece reads a window (no padding there: the window has it).
        out_shape: the piece's output shape (an adaptive pool's or upsampling's output size).
        in_shape: the piece's input 0 shape, before its window (a depthwise conv's local channels).
    """
    target, args, kwargs = op.target, list(op.args), dict(op.kwargs)
    names = [a.name for a in target._schema.arguments]
    if op.name in PADS:   # the window holds the rows along an exchanged dim: nothing to pad there
        sizes, n = list(_arg(op, "pad")), op.inputs[0].ndim
        for d in exchanged:
            k = n - 1 - d
            sizes[2 * k:2 * k + 2] = [0, 0]
        args[1] = sizes
        return target, args, kwargs
    nsp = spatial(op)
    first = op.inputs[0].ndim - nsp   # input 0's first spatial dim

    def put(name: str, value) -> None:
        i = names.index(name)
        if i < len(args):
            args[i] = value
        else:
            kwargs[name] = value

    if "padding" in names and exchanged:
        pad = _conv_padding(op, nsp) if op.name.startswith("conv") else _per_dim(_arg(op, "padding", 0), nsp)
        if isinstance(_arg(op, "padding", 0), str):   # padding='same': the overload taking ints
            import torch
            target = getattr(torch.ops.aten, op.target._schema.name.split("::")[-1]).default
            names = [a.name for a in target._schema.arguments]
        put("padding", [0 if d + first in exchanged else p for d, p in enumerate(pad)])
    if "output_padding" in names and exchanged:   # a transposed convolution: the piece crops its block
        put("output_padding", [0 if d + first in exchanged else p
                               for d, p in enumerate(_per_dim(_arg(op, "output_padding", 0), nsp))])
    if "output_size" in names and _arg(op, "output_size") is not None and split:
        put("output_size", list(out_shape[first:]))
    groups = conv_groups(op, in_shape)
    if groups is not None:
        put("groups", groups)
    return target, args, kwargs


def split_dims(op: IRFwOperation, factor: str) -> List[int]:
    """The dims of input 0 whose annotated factor is ``factor``."""
    return [d for d, dim in enumerate(op.anno.inputs[0]) if dim.head is not None and dim.head.name == factor]


def inside_factor(op: IRFwOperation, factor: str) -> Optional[bool]:
    """Whether ``factor`` of the op's annotation is marked ``~`` (None: the op has no such factor)."""
    try:
        return op.anno.ident(factor).inside
    except (KeyError, AttributeError):
        return None
