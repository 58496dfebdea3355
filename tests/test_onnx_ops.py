"""Every ONNX operator handler of ``cube.onnx`` against onnxruntime, one single-node model at a time,
including the attributes and versions the importer claims (opset changes of axes from attribute
to input, auto_pad, uneven pads, negative steps and indices, ...)."""
import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx", reason="the ONNX tests need `pip install onnx onnxruntime`")
ort = pytest.importorskip("onnxruntime", reason="the ONNX tests need onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import cube.onnx  # noqa: E402
from cube.onnx.ops import OPS  # noqa: E402

RNG = np.random.default_rng(0)


def f(*shape, lo=-2.0, hi=2.0):
    return RNG.uniform(lo, hi, size=shape).astype(np.float32)


def i64(*values):
    return np.array(values, dtype=np.int64)


# (id, op, inputs: [(name, array, static)], attributes, outputs, opset)
# static inputs become initializers (what exporters make of shapes and axes), the others graph inputs
CASES = [
    *[(op, op, [("x", f(2, 3, 4, lo=0.1), False)], {}, 1, 17)
      for op in ("Relu", "Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Neg", "Abs", "Reciprocal", "Erf", "Floor",
                 "Ceil", "Round", "Sign", "Sin", "Cos", "Softplus", "Softsign", "Identity", "HardSwish")],
    ("Mish", "Mish", [("x", f(2, 3, 4), False)], {}, 1, 18),
    *[(op, op, [("x", f(2, 3, 4), False)], {}, 1, 17) for op in ("IsNaN",)],
    ("Not", "Not", [("x", RNG.uniform(size=(3, 4)) > 0.5, False)], {}, 1, 17),
    *[(op, op, [("a", f(2, 3, 4), False), ("b", f(3, 1), False)], {}, 1, 17)
      for op in ("Add", "Sub", "Mul", "Div", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")],
    ("Pow", "Pow", [("a", f(2, 3, lo=0.5), False), ("b", f(2, 3), False)], {}, 1, 17),
    *[(op, op, [("a", RNG.uniform(size=(3, 4)) > 0.5, False), ("b", RNG.uniform(size=(4,)) > 0.5, False)], {}, 1,
       17) for op in ("And", "Or", "Xor")],
    ("Div-int", "Div", [("a", i64(7, -7, 9, -9), False), ("b", i64(2, 2, -4, 4), False)], {}, 1, 17),
    ("Mod", "Mod", [("a", i64(7, -7, 9, -9), False), ("b", i64(3, 3, -4, 4), False)], {}, 1, 17),
    ("Mod-fmod", "Mod", [("a", f(5), False), ("b", f(5, lo=0.5), False)], {"fmod": 1}, 1, 17),
    *[(op, op, [("a", f(2, 3), False), ("b", f(3), False), ("c", f(2, 1), False)], {}, 1, 17)
      for op in ("Max", "Min", "Sum", "Mean")],
    ("Where", "Where", [("c", RNG.uniform(size=(2, 3)) > 0.5, False), ("x", f(2, 3), False), ("y", f(3), False)],
     {}, 1, 17),
    ("IsInf", "IsInf", [("x", np.array([1.0, np.inf, -np.inf, 0.0], np.float32), False)],
     {"detect_negative": 0}, 1, 17),
    ("Clip", "Clip", [("x", f(3, 4), False), ("lo", np.array(-0.5, np.float32), True),
                      ("hi", np.array(0.7, np.float32), True)], {}, 1, 17),
    ("Clip-none", "Clip", [("x", f(3, 4), False)], {}, 1, 17),
    ("LeakyRelu", "LeakyRelu", [("x", f(3, 4), False)], {"alpha": 0.2}, 1, 17),
    ("Elu", "Elu", [("x", f(3, 4), False)], {"alpha": 0.7}, 1, 17),
    ("Celu", "Celu", [("x", f(3, 4), False)], {"alpha": 1.3}, 1, 17),
    ("Selu", "Selu", [("x", f(3, 4), False)], {}, 1, 17),
    ("HardSigmoid", "HardSigmoid", [("x", f(3, 4, lo=-5, hi=5), False)], {"alpha": 0.3, "beta": 0.4}, 1, 17),
    ("PRelu", "PRelu", [("x", f(2, 3, 4), False), ("s", f(3, 1), True)], {}, 1, 17),
    ("Gelu", "Gelu", [("x", f(3, 4), False)], {}, 1, 20),
    ("Gelu-tanh", "Gelu", [("x", f(3, 4), False)], {"approximate": "tanh"}, 1, 20),
    ("Softmax", "Softmax", [("x", f(2, 3, 4), False)], {"axis": 1}, 1, 17),
    ("LogSoftmax", "LogSoftmax", [("x", f(2, 3, 4), False)], {}, 1, 17),
    ("Cast", "Cast", [("x", f(2, 3, lo=-5, hi=5), False)], {"to": TensorProto.INT64}, 1, 17),
    ("CastLike", "CastLike", [("x", i64(1, 2, 3), False), ("like", f(1), False)], {}, 1, 17),
    ("MatMul", "MatMul", [("a", f(2, 3, 4), False), ("b", f(4, 5), True)], {}, 1, 17),
    ("Gemm-linear", "Gemm", [("a", f(3, 4), False), ("b", f(5, 4), True), ("c", f(5), True)], {"transB": 1}, 1, 17),
    ("Gemm-general", "Gemm", [("a", f(4, 3), False), ("b", f(4, 5), True), ("c", f(1, 5), True)],
     {"transA": 1, "alpha": 0.5, "beta": 2.0}, 1, 17),
    ("Einsum", "Einsum", [("a", f(2, 3, 4), False), ("b", f(2, 4, 5), False)], {"equation": "bij,bjk->bik"}, 1, 17),
    ("LayerNorm", "LayerNormalization", [("x", f(2, 3, 4), False), ("s", f(4), True), ("b", f(4), True)],
     {"epsilon": 1e-3}, 1, 17),
    ("LayerNorm-axis1", "LayerNormalization", [("x", f(2, 3, 4), False), ("s", f(3, 4), True)], {"axis": 1}, 1,
     17),
    ("BatchNorm", "BatchNormalization", [("x", f(2, 3, 4, 4), False), ("s", f(3), True), ("b", f(3), True),
                                         ("m", f(3), True), ("v", f(3, lo=0.5), True)], {"epsilon": 1e-3}, 1, 15),
    ("InstanceNorm", "InstanceNormalization", [("x", f(2, 3, 5), False), ("s", f(3), True), ("b", f(3), True)],
     {}, 1, 17),
    ("ReduceMean-attr", "ReduceMean", [("x", f(2, 3, 4), False)], {"axes": [1], "keepdims": 0}, 1, 17),
    ("ReduceMean-input", "ReduceMean", [("x", f(2, 3, 4), False), ("axes", i64(-1), True)], {}, 1, 18),
    ("ReduceSum", "ReduceSum", [("x", f(2, 3, 4), False), ("axes", i64(0, 2), True)], {}, 1, 13),
    ("ReduceMax-all", "ReduceMax", [("x", f(2, 3, 4), False)], {"keepdims": 0}, 1, 17),
    ("ReduceMin", "ReduceMin", [("x", f(2, 3, 4), False), ("axes", i64(1), True)], {}, 1, 18),
    ("ReduceProd", "ReduceProd", [("x", f(2, 3, 4, lo=0.5), False)], {"axes": [0, 2]}, 1, 17),
    ("ArgMax", "ArgMax", [("x", f(3, 4), False)], {"axis": 1, "keepdims": 0}, 1, 17),
    ("ArgMin", "ArgMin", [("x", f(3, 4), False)], {}, 1, 17),
    ("CumSum", "CumSum", [("x", f(3, 4), False), ("axis", i64(1), True)], {}, 1, 17),
    ("CumSum-excl-rev", "CumSum", [("x", f(3, 4), False), ("axis", i64(0), True)], {"exclusive": 1, "reverse": 1},
     1, 17),
    ("TopK", "TopK", [("x", f(3, 6), False), ("k", i64(2), True)], {"axis": 1}, 2, 17),
    ("Conv2d", "Conv", [("x", f(1, 2, 7, 7), False), ("w", f(4, 2, 3, 3), True), ("b", f(4), True)],
     {"pads": [1, 1, 1, 1], "strides": [2, 2]}, 1, 17),
    ("Conv-same-upper", "Conv", [("x", f(1, 2, 6, 6), False), ("w", f(3, 2, 4, 4), True)],
     {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 1, 17),
    ("Conv-uneven-pads", "Conv", [("x", f(1, 2, 6, 6), False), ("w", f(3, 2, 3, 3), True)],
     {"pads": [0, 1, 2, 0]}, 1, 17),
    ("Conv-groups-dilation", "Conv", [("x", f(1, 4, 9, 9), False), ("w", f(4, 2, 3, 3), True)],
     {"group": 2, "dilations": [2, 2], "pads": [2, 2, 2, 2]}, 1, 17),
    ("Conv1d", "Conv", [("x", f(2, 3, 10), False), ("w", f(5, 3, 3), True)], {"pads": [1, 1]}, 1, 17),
    ("Conv3d", "Conv", [("x", f(1, 2, 5, 5, 5), False), ("w", f(2, 2, 3, 3, 3), True)], {}, 1, 17),
    ("ConvTranspose", "ConvTranspose", [("x", f(1, 3, 4, 4), False), ("w", f(3, 2, 3, 3), True), ("b", f(2), True)],
     {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}, 1, 17),
    ("MaxPool", "MaxPool", [("x", f(1, 2, 7, 7), False)], {"kernel_shape": [3, 3], "strides": [2, 2],
                                                           "pads": [1, 1, 1, 1]}, 1, 17),
    ("MaxPool-ceil", "MaxPool", [("x", f(1, 2, 6, 6), False)], {"kernel_shape": [3, 3], "strides": [2, 2],
                                                                "ceil_mode": 1}, 1, 17),
    ("MaxPool-uneven", "MaxPool", [("x", f(1, 2, 6, 6), False)], {"kernel_shape": [2, 2], "pads": [0, 0, 1, 1]}, 1,
     17),
    ("AveragePool", "AveragePool", [("x", f(1, 2, 6, 6), False)], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1,
     17),
    ("AveragePool-pad-incl", "AveragePool", [("x", f(1, 2, 5, 5), False)],
     {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1}, 1, 17),
    ("AveragePool-pad-excl", "AveragePool", [("x", f(1, 2, 5, 5), False)],
     {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 1, 17),
    ("GlobalAveragePool", "GlobalAveragePool", [("x", f(2, 3, 4, 5), False)], {}, 1, 17),
    ("GlobalMaxPool", "GlobalMaxPool", [("x", f(2, 3, 4, 5), False)], {}, 1, 17),
    ("Resize-nearest", "Resize", [("x", f(1, 2, 3, 4), False), ("roi", np.zeros(0, np.float32), True),
                                  ("scales", np.array([1, 1, 2, 2], np.float32), True)],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, 1, 17),
    ("Resize-linear", "Resize", [("x", f(1, 2, 3, 4), False), ("roi", np.zeros(0, np.float32), True),
                                 ("scales", np.array([1, 1, 2, 2], np.float32), True)], {"mode": "linear"}, 1, 17),
    ("Resize-align-sizes", "Resize", [("x", f(1, 2, 3, 4), False), ("roi", np.zeros(0, np.float32), True),
                                      ("scales", np.zeros(0, np.float32), True), ("sizes", i64(1, 2, 5, 7), True)],
     {"mode": "linear", "coordinate_transformation_mode": "align_corners"}, 1, 17),
    ("Pad-constant", "Pad", [("x", f(2, 3, 4), False), ("p", i64(0, 1, 2, 0, 0, 1), True),
                             ("v", np.array(0.5, np.float32), True)], {}, 1, 17),
    ("Pad-reflect", "Pad", [("x", f(1, 2, 4, 5), False), ("p", i64(0, 0, 1, 2, 0, 0, 2, 1), True)],
     {"mode": "reflect"}, 1, 17),
    ("Pad-edge-axes", "Pad", [("x", f(2, 3, 4), False), ("p", i64(1, 2), True), ("v", np.array(0.0, np.float32), True),
                              ("axes", i64(-1), True)], {"mode": "edge"}, 1, 18),
    ("Reshape", "Reshape", [("x", f(2, 3, 4), False), ("s", i64(0, -1, 2), True)], {}, 1, 17),
    ("Flatten", "Flatten", [("x", f(2, 3, 4, 5), False)], {"axis": 2}, 1, 17),
    ("Transpose", "Transpose", [("x", f(2, 3, 4), False)], {"perm": [1, 2, 0]}, 1, 17),
    ("Transpose-default", "Transpose", [("x", f(2, 3, 4), False)], {}, 1, 17),
    ("Squeeze", "Squeeze", [("x", f(2, 1, 4, 1), False), ("a", i64(-1, 1), True)], {}, 1, 17),
    ("Squeeze-all", "Squeeze", [("x", f(2, 1, 4, 1), False)], {}, 1, 17),
    ("Unsqueeze", "Unsqueeze", [("x", f(2, 3), False), ("a", i64(0, -1), True)], {}, 1, 17),
    ("Concat", "Concat", [("a", f(2, 3), False), ("b", f(2, 2), False)], {"axis": -1}, 1, 17),
    ("Split-sizes", "Split", [("x", f(2, 7), False), ("s", i64(3, 4), True)], {"axis": 1}, 2, 17),
    ("Split-num-outputs", "Split", [("x", f(7, 2), False)], {"num_outputs": 3}, 3, 18),
    ("Slice", "Slice", [("x", f(5, 6), False), ("s", i64(1, -5), True), ("e", i64(4, 100), True),
                        ("a", i64(0, 1), True), ("st", i64(2, 1), True)], {}, 1, 17),
    ("Slice-negative-step", "Slice", [("x", f(5, 6), False), ("s", i64(-1), True), ("e", i64(-100), True),
                                      ("a", i64(1), True), ("st", i64(-2), True)], {}, 1, 17),
    ("Expand", "Expand", [("x", f(3, 1), False), ("s", i64(2, 1, 4), True)], {}, 1, 17),
    ("Tile", "Tile", [("x", f(2, 3), False), ("r", i64(2, 1), True)], {}, 1, 17),
    ("Gather-axis1-negative", "Gather", [("x", f(3, 5), False), ("i", i64(-1, 0, 2), True)], {"axis": 1}, 1, 17),
    ("Gather-scalar", "Gather", [("x", f(3, 5), False), ("i", np.array(1, np.int64), True)], {}, 1, 17),
    ("Gather-embedding", "Gather", [("w", f(10, 4), True), ("ids", RNG.integers(0, 10, (2, 3)), False)], {}, 1, 17),
    ("GatherElements", "GatherElements", [("x", f(3, 4), False), ("i", RNG.integers(-4, 4, (3, 2)), True)],
     {"axis": 1}, 1, 17),
    ("GatherND", "GatherND", [("x", f(3, 4, 5), False), ("i", np.array([[0, 1], [2, -1]], np.int64), True)], {}, 1,
     17),
    ("GatherND-dynamic", "GatherND", [("x", f(3, 4), False), ("i", RNG.integers(0, 3, (2, 1)), False)], {}, 1, 17),
    ("Trilu-upper", "Trilu", [("x", f(4, 5), False), ("k", np.array(1, np.int64), True)], {}, 1, 17),
    ("Trilu-lower", "Trilu", [("x", f(4, 5), False)], {"upper": 0}, 1, 17),
    ("Dropout-inference", "Dropout", [("x", f(3, 4), False)], {}, 1, 17),
    ("SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLoss",
     [("s", f(4, 5), False), ("y", np.array([1, -100, 4, 0], np.int64), False)], {"ignore_index": -100}, 1, 17),
    ("NegativeLogLikelihoodLoss", "NegativeLogLikelihoodLoss",
     [("s", f(4, 5), False), ("y", np.array([1, 2, 4, 0], np.int64), False)], {"reduction": "sum"}, 1, 17),
]

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int64): TensorProto.INT64,
        np.dtype(np.bool_): TensorProto.BOOL}


def _model(op, inputs, attrs, nout, opset):
    graph_inputs = [helper.make_tensor_value_info(n, ELEM[a.dtype], list(a.shape)) for n, a, s in inputs if not s]
    inits = [numpy_helper.from_array(a, n) for n, a, s in inputs if s]
    outs = [f"y{k}" for k in range(nout)]
    node = helper.make_node(op, [n for n, _, _ in inputs], outs, name=f"{op.lower()}_0", **attrs)
    out_infos = [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs]
    model = helper.make_model(helper.make_graph([node], "g", graph_inputs, out_infos, initializer=inits),
                              opset_imports=[helper.make_opsetid("", opset)])
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    for out in model.graph.output:   # operators defined as functions (Mish) may leave the type unknown
        if out.type.tensor_type.elem_type == TensorProto.UNDEFINED:
            out.type.tensor_type.elem_type = ELEM[inputs[0][1].dtype]
    return model


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_operator_equals_onnxruntime(case):
    _, op, inputs, attrs, nout, opset = case
    model = _model(op, inputs, attrs, nout, opset)
    feeds = {n: a for n, a, s in inputs if not s}
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    module = cube.onnx.load(model).eval()
    with torch.no_grad():
        got = module(*[torch.from_numpy(np.array(a)) for a in feeds.values()])
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        g = g.numpy()
        assert g.shape == r.shape and g.dtype == r.dtype, (g.shape, r.shape, g.dtype, r.dtype)
        if r.dtype.kind == "f":
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(g, r)


def test_every_operator_is_exercised():
    """The table above covers every operator the importer claims (those folded at load or while
    tracing, and sequences, are covered by the model tests)."""
    covered = {c[1] for c in CASES} | {"Shape", "Size", "Constant", "ConstantOfShape", "Range",
                                       "SplitToSequence", "SequenceAt"}   # test_onnx.py: Hugging Face GPT-2
    assert set(OPS) <= covered, sorted(set(OPS) - covered)
