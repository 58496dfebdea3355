"""ONNX operators as torch functions: the importer's one table (``OPS``).

Each handler computes one ONNX node with torch operators that ``torch.export``
traces into the ATen ops cube already partitions (``Gemm`` becomes ``linear``,
``Gather`` of a weight ``embedding``, ``Conv`` ``conv2d``, ...), so an imported
model is planned like a native one.

A handler is ``fn(node, *inputs)``: ``node`` gives the attributes
(``node.attr(name, default)``) and whether the module is training; the inputs
are torch tensors, except those listed in ``static``: values cube needs while
tracing (shapes, axes, pads, repeat counts), handed over as numpy arrays.
``attrs`` lists each attribute the handler reads, with the values it accepts
(None: any); a node with another attribute or value is refused at load, so
nothing is silently ignored. A handler covers every version of its operator
from opset 13 to 21 (``cube.onnx.graph.check`` refuses other versions).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from cube.errors import CubeInternalError


@dataclass(frozen=True)
class Handler:
    fn: Callable
    static: Tuple[int, ...] = ()
    attrs: Dict[str, Optional[frozenset]] = field(default_factory=dict)
    note: str = ""


OPS: Dict[str, Handler] = {}

# ONNX TensorProto element types -> torch dtypes (the ones a model trains or indexes with)
DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16, 6: torch.int32, 7: torch.int64,
          9: torch.bool, 10: torch.float16, 11: torch.float64, 16: torch.bfloat16}


def op(*names: str, static: Sequence[int] = (), attrs: Optional[dict] = None, note: str = ""):
    """Registers ``fn`` as the handler of the ONNX operators ``names``."""
    allowed = {k: (None if v is None else frozenset(v)) for k, v in (attrs or {}).items()}

    def deco(fn):
        for name in names:
            OPS[name] = Handler(fn, tuple(static), allowed, note)
        return fn
    return deco


def _ints(a) -> list:
    return [int(v) for v in np.asarray(a).reshape(-1)]


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


# ---- elementwise ---------------------------------------------------------------------------------

def _unary(names_fns):
    for name, fn in names_fns.items():
        op(name)(lambda node, x, _fn=fn: _fn(x))


_unary({"Identity": lambda x: x, "Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh,
        "Exp": torch.exp, "Log": torch.log, "Sqrt": torch.sqrt, "Neg": torch.neg, "Abs": torch.abs,
        "Reciprocal": torch.reciprocal, "Erf": torch.erf, "Floor": torch.floor, "Ceil": torch.ceil,
        "Round": torch.round, "Sign": torch.sign, "Sin": torch.sin, "Cos": torch.cos, "Softplus": F.softplus,
        "Softsign": F.softsign, "Not": torch.logical_not, "IsNaN": torch.isnan, "Mish": F.mish,
        "HardSwish": F.hardswish})

_BINARY = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Pow": torch.pow, "Equal": torch.eq,
           "Less": torch.lt, "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge,
           "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor}
for _name, _fn in _BINARY.items():
    op(_name)(lambda node, a, b, _fn=_fn: _fn(a, b))


@op("Div")
def _div(node, a, b):
    if a.dtype.is_floating_point:
        return torch.div(a, b)
    return torch.div(a, b, rounding_mode="trunc")   # ONNX integer division truncates


@op("Mod", attrs={"fmod": None})
def _mod(node, a, b):
    return torch.fmod(a, b) if node.attr("fmod", 0) else torch.remainder(a, b)


def _variadic(fn):
    def run(node, *xs):
        out = xs[0]
        for x in xs[1:]:
            out = fn(out, x)
        return out
    return run


op("Max")(_variadic(torch.maximum))
op("Min")(_variadic(torch.minimum))
op("Sum")(_variadic(torch.add))


@op("Mean")
def _mean(node, *xs):
    return _variadic(torch.add)(node, *xs) / len(xs)


@op("Where")
def _where(node, cond, x, y):
    return torch.where(cond, x, y)


@op("IsInf", attrs={"detect_negative": None, "detect_positive": None})
def _isinf(node, x):
    pos, neg = node.attr("detect_positive", 1), node.attr("detect_negative", 1)
    if pos and neg:
        return torch.isinf(x)
    return torch.isposinf(x) if pos else (torch.isneginf(x) if neg else torch.zeros_like(x, dtype=torch.bool))


@op("Clip")
def _clip(node, x, lo=None, hi=None):
    return x if lo is None and hi is None else torch.clamp(x, lo, hi)


@op("LeakyRelu", attrs={"alpha": None})
def _leaky(node, x):
    return F.leaky_relu(x, node.attr("alpha", 0.01))


@op("Elu", attrs={"alpha": None})
def _elu(node, x):
    return F.elu(x, node.attr("alpha", 1.0))


@op("Celu", attrs={"alpha": None})
def _celu(node, x):
    return F.celu(x, node.attr("alpha", 1.0))


@op("Selu", attrs={"alpha": None, "gamma": None})
def _selu(node, x):
    alpha, gamma = node.attr("alpha", 1.67326319217681884765625), node.attr("gamma", 1.05070102214813232421875)
    return gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))


@op("HardSigmoid", attrs={"alpha": None, "beta": None})
def _hardsigmoid(node, x):
    return torch.clamp(node.attr("alpha", 0.2) * x + node.attr("beta", 0.5), 0.0, 1.0)


@op("PRelu")
def _prelu(node, x, slope):
    return torch.where(x < 0, x * slope, x)


@op("Gelu", attrs={"approximate": {"none", "tanh"}})
def _gelu(node, x):
    return F.gelu(x, approximate=node.attr("approximate", "none"))


@op("Softmax", attrs={"axis": None})
def _softmax(node, x):
    return F.softmax(x, dim=node.attr("axis", -1))


@op("LogSoftmax", attrs={"axis": None})
def _log_softmax(node, x):
    return F.log_softmax(x, dim=node.attr("axis", -1))


@op("Cast", attrs={"to": None, "saturate": None, "round_mode": None})
def _cast(node, x):
    return x.to(node.dtype(node.attr("to")))


@op("CastLike", attrs={"saturate": None, "round_mode": None})
def _cast_like(node, x, like):
    return x.to(like.dtype)


@op("Dropout", static=(1, 2), attrs={"seed": None},
    note="identity, as ONNX runs it without `training_mode`; a mask output is all true")
def _dropout(node, x, ratio=None, training_mode=None):
    if training_mode is not None and bool(np.asarray(training_mode)) and (ratio is None or float(ratio) > 0):
        raise node.error("Dropout with training_mode=true draws random numbers: not reproducible across "
                         "ranks; export the model in eval mode (dropout is then the identity)")
    return (x, torch.ones_like(x, dtype=torch.bool)) if node.noutputs > 1 else x


# ---- linear algebra and normalization -----------------------------------------------------------

@op("MatMul")
def _matmul(node, a, b):
    return torch.matmul(a, b)


@op("Gemm", attrs={"alpha": None, "beta": None, "transA": None, "transB": None})
def _gemm(node, a, b, c=None):
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    if node.attr("transA", 0):
        a = a.t()
    if node.attr("transB", 0) and alpha == 1.0:   # torch's own layout: one linear, as nn.Linear traces
        bias = c if c is not None and beta == 1.0 and c.dim() == 1 and c.shape[0] == b.shape[0] else None
        y = F.linear(a, b, bias)
        return y if c is None or bias is not None else y + beta * c
    y = torch.matmul(a, b.t() if node.attr("transB", 0) else b)
    if alpha != 1.0:
        y = alpha * y
    return y if c is None else y + (c if beta == 1.0 else beta * c)


@op("Einsum", attrs={"equation": None})
def _einsum(node, *xs):
    return torch.einsum(node.attr("equation"), *xs)


@op("LayerNormalization", attrs={"axis": None, "epsilon": None, "stash_type": {1}})
def _layer_norm(node, x, scale, bias=None):
    axis = _axis(node.attr("axis", -1), x.dim())
    shape = tuple(x.shape[axis:])
    eps = node.attr("epsilon", 1e-5)
    if tuple(scale.shape) == shape and (bias is None or tuple(bias.shape) == shape):
        y = F.layer_norm(x, shape, scale, bias, eps)
    else:   # a scale broadcast to the normalized shape
        y = F.layer_norm(x, shape, None, None, eps) * scale
        y = y if bias is None else y + bias
    if node.noutputs == 1:
        return y
    dims = tuple(range(axis, x.dim()))
    mean = x.mean(dims, keepdim=True)
    inv = torch.rsqrt(x.var(dims, unbiased=False, keepdim=True) + eps)
    return (y, mean, inv)[:node.noutputs]


@op("BatchNormalization", attrs={"epsilon": None, "momentum": None, "training_mode": {0}, "spatial": {1}},
    note="running statistics are buffers: batch statistics and momentum updates while the module trains, "
         "the running ones in eval mode (ONNX's inference semantics)")
def _batch_norm(node, x, scale, bias, mean, var):
    momentum = 1.0 - node.attr("momentum", 0.9)   # ONNX keeps `momentum` of the old value, torch of the new
    return F.batch_norm(x, mean, var, scale, bias, training=node.training, momentum=momentum,
                        eps=node.attr("epsilon", 1e-5))


@op("InstanceNormalization", attrs={"epsilon": None})
def _instance_norm(node, x, scale, bias):
    return F.instance_norm(x, weight=scale, bias=bias, eps=node.attr("epsilon", 1e-5))


def _prod(x, dim, keepdim):
    """``torch.prod`` over several dims (torch's takes one)."""
    for a in sorted(dim, reverse=True):
        x = torch.prod(x, dim=a, keepdim=keepdim)
    return x


_REDUCE = {"ReduceMean": torch.mean, "ReduceSum": torch.sum, "ReduceMax": torch.amax, "ReduceMin": torch.amin,
           "ReduceProd": _prod}


def _reduce(node, x, axes=None):
    axes = _ints(axes) if axes is not None else node.attr("axes", None)   # an input from opset 13/18 on
    if not axes:
        if node.attr("noop_with_empty_axes", 0):
            return x
        axes = list(range(x.dim()))
    dims = tuple(sorted(_axis(a, x.dim()) for a in axes))
    return _REDUCE[node.op_type](x, dim=dims, keepdim=bool(node.attr("keepdims", 1)))


for _name in _REDUCE:
    op(_name, static=(1,), attrs={"axes": None, "keepdims": None, "noop_with_empty_axes": None})(_reduce)


@op("ArgMax", "ArgMin", attrs={"axis": None, "keepdims": None, "select_last_index": {0}})
def _arg(node, x):
    fn = torch.argmax if node.op_type == "ArgMax" else torch.argmin
    return fn(x, dim=node.attr("axis", 0), keepdim=bool(node.attr("keepdims", 1)))


@op("CumSum", static=(1,), attrs={"exclusive": None, "reverse": None})
def _cumsum(node, x, axis):
    dim = _axis(int(np.asarray(axis).reshape(-1)[0]), x.dim())
    if node.attr("reverse", 0):
        x = torch.flip(x, (dim,))
    y = torch.cumsum(x, dim)
    if node.attr("exclusive", 0):
        y = y - x
    return torch.flip(y, (dim,)) if node.attr("reverse", 0) else y


@op("TopK", static=(1,), attrs={"axis": None, "largest": None, "sorted": None})
def _topk(node, x, k):
    values, indices = torch.topk(x, int(np.asarray(k).reshape(-1)[0]), dim=node.attr("axis", -1),
                                 largest=bool(node.attr("largest", 1)), sorted=bool(node.attr("sorted", 1)))
    return values, indices


@op("SoftmaxCrossEntropyLoss", attrs={"ignore_index": None, "reduction": {"mean", "sum", "none"}})
def _softmax_ce(node, scores, labels, weights=None):
    logp = F.log_softmax(scores, dim=1)
    loss = F.nll_loss(logp, labels, weight=weights, ignore_index=node.attr("ignore_index", -100),
                      reduction=node.attr("reduction", "mean"))
    return (loss, logp) if node.noutputs > 1 else loss


@op("NegativeLogLikelihoodLoss", attrs={"ignore_index": None, "reduction": {"mean", "sum", "none"}})
def _nll(node, logp, labels, weights=None):
    return F.nll_loss(logp, labels, weight=weights, ignore_index=node.attr("ignore_index", -100),
                      reduction=node.attr("reduction", "mean"))


# ---- convolution and pooling -------------------------------------------------------------------

def _geometry(node, x, kernel: Sequence[int]):
    """(strides, dilations, begin pads, end pads) of a conv or pool node, ``auto_pad`` resolved."""
    n = len(kernel)
    strides = node.attr("strides", [1] * n)
    dilations = node.attr("dilations", [1] * n)
    pads = node.attr("pads", [0] * (2 * n))
    mode = node.attr("auto_pad", "NOTSET")
    if mode in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for size, k, s, d in zip(x.shape[2:], kernel, strides, dilations):
            total = max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, big = total // 2, total - total // 2
            begin.append(small if mode == "SAME_UPPER" else big)
            end.append(big if mode == "SAME_UPPER" else small)
        return strides, dilations, begin, end
    if mode == "VALID":
        return strides, dilations, [0] * n, [0] * n
    return strides, dilations, list(pads[:n]), list(pads[n:])


def _pad_first(x, begin, end, value=0.0):
    """``x`` padded explicitly (the pads torch's operator cannot take: uneven, or wider than it allows)."""
    flat = []
    for b, e in zip(reversed(begin), reversed(end)):
        flat += [b, e]
    return F.pad(x, flat, value=value)


_CONV_ATTRS = {"auto_pad": {"NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"}, "dilations": None, "group": None,
               "kernel_shape": None, "pads": None, "strides": None}

_POOL_ATTRS = {**{k: v for k, v in _CONV_ATTRS.items() if k != "group"}, "ceil_mode": None}


@op("Conv", attrs=_CONV_ATTRS)
def _conv(node, x, w, b=None):
    kernel = list(w.shape[2:])
    strides, dilations, begin, end = _geometry(node, x, kernel)
    conv = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
    if begin != end:
        x, begin = _pad_first(x, begin, end), [0] * len(kernel)
    return conv(x, w, b, stride=strides, padding=begin, dilation=dilations, groups=node.attr("group", 1))


@op("ConvTranspose", attrs={**_CONV_ATTRS, "output_padding": None})
def _conv_transpose(node, x, w, b=None):
    kernel = list(w.shape[2:])
    n = len(kernel)
    if node.attr("auto_pad", "NOTSET") != "NOTSET":
        raise node.error("ConvTranspose with auto_pad: export with explicit pads")
    pads = node.attr("pads", [0] * (2 * n))
    if list(pads[:n]) != list(pads[n:]):
        raise node.error(f"ConvTranspose with uneven pads {list(pads)}")
    conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[n - 1]
    return conv(x, w, b, stride=node.attr("strides", [1] * n), padding=list(pads[:n]),
                output_padding=node.attr("output_padding", [0] * n), groups=node.attr("group", 1),
                dilation=node.attr("dilations", [1] * n))


@op("MaxPool", attrs={**_POOL_ATTRS, "storage_order": {0}},
    note="the Indices output is not supported")
def _max_pool(node, x):
    if node.noutputs > 1:
        raise node.error("MaxPool's Indices output is not supported")
    kernel = node.attr("kernel_shape")
    strides, dilations, begin, end = _geometry(node, x, kernel)
    if begin != end or any(2 * p > k for p, k in zip(begin, kernel)):
        x, begin = _pad_first(x, begin, end, value=float("-inf")), [0] * len(kernel)
    pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[len(kernel) - 1]
    return pool(x, kernel, strides, begin, dilations, ceil_mode=bool(node.attr("ceil_mode", 0)))


@op("AveragePool", attrs={**_POOL_ATTRS, "count_include_pad": None})
def _avg_pool(node, x):
    kernel = node.attr("kernel_shape")
    strides, dilations, begin, end = _geometry(node, x, kernel)
    if any(d != 1 for d in dilations):
        raise node.error(f"AveragePool with dilations {list(dilations)}")
    include = bool(node.attr("count_include_pad", 0))
    if begin != end or any(2 * p > k for p, k in zip(begin, kernel)):
        if not include:
            raise node.error(f"AveragePool with uneven pads {begin + end} and count_include_pad=0")
        x, begin = _pad_first(x, begin, end), [0] * len(kernel)
    pool = (F.avg_pool1d, F.avg_pool2d, F.avg_pool3d)[len(kernel) - 1]
    return pool(x, kernel, strides, begin, ceil_mode=bool(node.attr("ceil_mode", 0)), count_include_pad=include)


@op("GlobalAveragePool")
def _global_avg(node, x):
    return x.mean(tuple(range(2, x.dim())), keepdim=True)


@op("GlobalMaxPool")
def _global_max(node, x):
    return x.amax(tuple(range(2, x.dim())), keepdim=True)


_RESIZE_ATTRS = {"mode": {"nearest", "linear"}, "coordinate_transformation_mode": None, "nearest_mode": None,
                 "cubic_coeff_a": None, "exclude_outside": {0}, "extrapolation_value": None, "antialias": {0},
                 "axes": None, "keep_aspect_ratio_policy": {"stretch"}}


@op("Resize", static=(1, 2, 3), attrs=_RESIZE_ATTRS,
    note="nearest (asymmetric, floor) and linear (half_pixel, pytorch_half_pixel, align_corners) over the "
         "spatial dims")
def _resize(node, x, roi=None, scales=None, sizes=None):
    mode = node.attr("mode", "nearest")
    coord = node.attr("coordinate_transformation_mode", "half_pixel")
    if node.attr("axes", None) is not None:
        raise node.error("Resize with axes")
    if sizes is not None and np.asarray(sizes).size:
        size = _ints(sizes)
        if size[:2] != list(x.shape[:2]):
            raise node.error("Resize of the batch or channel dims")
        kw = {"size": size[2:]}
    else:
        scale = [float(s) for s in np.asarray(scales).reshape(-1)]
        if scale[:2] != [1.0, 1.0]:
            raise node.error("Resize of the batch or channel dims")
        kw = {"scale_factor": scale[2:]}
    if mode == "nearest":
        if coord != "asymmetric" or node.attr("nearest_mode", "round_prefer_floor") != "floor":
            raise node.error(f"Resize nearest with coordinate_transformation_mode={coord!r}, nearest_mode="
                             f"{node.attr('nearest_mode', 'round_prefer_floor')!r} (supported: asymmetric, floor)")
        return F.interpolate(x, mode="nearest", **kw)
    if coord not in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        raise node.error(f"Resize linear with coordinate_transformation_mode={coord!r}")
    if coord == "pytorch_half_pixel" and any(s == 1 for s in (kw.get("size") or [2])):
        raise node.error("Resize pytorch_half_pixel to a size of 1")
    linear = {3: "linear", 4: "bilinear", 5: "trilinear"}[x.dim()]
    return F.interpolate(x, mode=linear, align_corners=coord == "align_corners", **kw)


@op("Pad", static=(1, 2, 3), attrs={"mode": {"constant", "reflect", "edge", "wrap"}})
def _pad(node, x, pads, value=None, axes=None):
    pads = _ints(pads)
    axes = [_axis(a, x.dim()) for a in _ints(axes)] if axes is not None else list(range(x.dim()))
    n = len(axes)
    begin, end = [0] * x.dim(), [0] * x.dim()
    for i, a in enumerate(axes):
        begin[a], end[a] = pads[i], pads[n + i]
    first = next((i for i in range(x.dim()) if begin[i] or end[i]), x.dim())
    flat = []
    for i in range(x.dim() - 1, first - 1, -1):
        flat += [begin[i], end[i]]
    mode = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}[
        node.attr("mode", "constant")]
    if mode == "constant":
        fill = 0.0 if value is None or np.asarray(value).size == 0 else np.asarray(value).reshape(-1)[0].item()
        return F.pad(x, flat, value=fill)
    return F.pad(x, flat, mode=mode)


# ---- shapes, indexing and data movement ----------------------------------------------------------

@op("Reshape", static=(1,), attrs={"allowzero": None})
def _reshape(node, x, shape):
    shape = _ints(shape)
    if not node.attr("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return torch.reshape(x, shape)


@op("Flatten", attrs={"axis": None})
def _flatten(node, x):
    axis = _axis(node.attr("axis", 1), x.dim())
    return torch.reshape(x, (math.prod(x.shape[:axis]), -1))


@op("Transpose", attrs={"perm": None})
def _transpose(node, x):
    perm = node.attr("perm", None)
    return x.permute(list(perm) if perm is not None else list(range(x.dim() - 1, -1, -1)))


@op("Squeeze", static=(1,))
def _squeeze(node, x, axes=None):
    if axes is None:
        return torch.squeeze(x)
    dims = sorted((_axis(a, x.dim()) for a in _ints(axes)), reverse=True)
    for d in dims:
        x = torch.squeeze(x, d)
    return x


@op("Unsqueeze", static=(1,))
def _unsqueeze(node, x, axes):
    rank = x.dim() + len(_ints(axes))
    for d in sorted(_axis(a, rank) for a in _ints(axes)):
        x = torch.unsqueeze(x, d)
    return x


@op("Concat", attrs={"axis": None})
def _concat(node, *xs):
    return torch.cat(xs, dim=node.attr("axis"))


@op("Split", static=(1,), attrs={"axis": None, "num_outputs": None})
def _split(node, x, split=None):
    dim = _axis(node.attr("axis", 0), x.dim())
    if split is not None and np.asarray(split).size:
        sizes = _ints(split)
    else:
        parts = node.attr("num_outputs", node.noutputs)
        chunk = math.ceil(x.shape[dim] / parts)
        sizes = [chunk] * (parts - 1) + [x.shape[dim] - chunk * (parts - 1)]
    return tuple(torch.split(x, sizes, dim))


@op("Slice", static=(1, 2, 3, 4))
def _slice(node, x, starts, ends, axes=None, steps=None):
    starts, ends = _ints(starts), _ints(ends)
    axes = _ints(axes) if axes is not None else list(range(len(starts)))
    steps = _ints(steps) if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.dim()
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _axis(axis, x.dim())
        size = x.shape[axis]
        start, end = (start + size if start < 0 else start), (end + size if end < 0 else end)
        if step > 0:
            index[axis] = slice(min(max(start, 0), size), min(max(end, 0), size), step)
        else:   # torch slices have positive steps only: gather the indices, in order
            start, end = min(max(start, 0), size - 1), min(max(end, -1), size - 1)
            x = torch.index_select(x, axis, torch.arange(start, end, step, device=x.device))
    return x[tuple(index)]


@op("Expand", static=(1,))
def _expand(node, x, shape):
    return x.expand(torch.broadcast_shapes(tuple(x.shape), tuple(_ints(shape))))


@op("Tile", static=(1,))
def _tile(node, x, repeats):
    return x.repeat(_ints(repeats))


@op("Gather", attrs={"axis": None}, note="a weight indexed by token ids (axis 0) is an `embedding`")
def _gather(node, data, indices):
    axis = _axis(node.attr("axis", 0), data.dim())
    if axis == 0 and data.dim() == 2 and node.is_param(0) and not node.is_static(1) and indices.dim() >= 1:
        return F.embedding(indices, data)   # a negative id is torch's index error, never a wrong row
    if indices.dim() == 0 and node.is_static(1):
        return data.select(axis, int(indices))
    size = data.shape[axis]
    flat = indices.reshape(-1)
    flat = flat if node.nonnegative(1) else torch.where(flat < 0, flat + size, flat)
    out = torch.index_select(data, axis, flat)
    return out.reshape(tuple(data.shape[:axis]) + tuple(indices.shape) + tuple(data.shape[axis + 1:]))


@op("GatherND", attrs={"batch_dims": {0}})
def _gather_nd(node, data, indices):
    k = indices.shape[-1]
    index = tuple(indices[..., j] for j in range(k))   # each index tensor picks along one leading dim
    return data[index]


@op("SplitToSequence", static=(1,), attrs={"axis": None, "keepdims": None},
    note="a Python list of tensors, read by SequenceAt")
def _split_to_sequence(node, x, split=None):
    dim = _axis(node.attr("axis", 0), x.dim())
    if split is None:
        parts = list(torch.split(x, 1, dim))
        return ([p.squeeze(dim) for p in parts] if not node.attr("keepdims", 1) else parts),
    sizes = _ints(split)
    return list(torch.split(x, sizes[0] if np.asarray(split).ndim == 0 else sizes, dim)),


@op("SequenceAt", static=(1,))
def _sequence_at(node, seq, position):
    return seq[int(np.asarray(position).reshape(-1)[0])]


@op("GatherElements", attrs={"axis": None})
def _gather_elements(node, data, indices):
    axis = _axis(node.attr("axis", 0), data.dim())
    indices = indices if node.nonnegative(1) else torch.where(indices < 0, indices + data.shape[axis], indices)
    return torch.gather(data, axis, indices)


@op("Trilu", static=(1,), attrs={"upper": None})
def _trilu(node, x, k=None):
    k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    return torch.triu(x, k) if node.attr("upper", 1) else torch.tril(x, k)


def _static_only(node, *inputs):
    raise CubeInternalError(f"{node.op_type} reached a torch handler: its value is known while tracing and "
                            f"cube.onnx.module computes it with numpy")


# Known while tracing (shapes are static): the module computes these with numpy, never with torch.
op("Shape", attrs={"start": None, "end": None}, note="known while tracing (static shapes)")(_static_only)
op("Size", note="known while tracing (static shapes)")(_static_only)
op("Constant", attrs={"value": None, "value_float": None, "value_floats": None, "value_int": None,
                      "value_ints": None}, note="folded while loading")(_static_only)
op("ConstantOfShape", static=(0,), attrs={"value": None}, note="folded while tracing")(_static_only)
op("Range", static=(0, 1, 2), note="folded while tracing")(_static_only)


# Operators whose every input is static: the module computes them with numpy (ONNX's reference
# implementation) while tracing, never as a torch operator.
STATIC_ONLY = frozenset({"Shape", "Size", "Constant", "ConstantOfShape", "Range"})
