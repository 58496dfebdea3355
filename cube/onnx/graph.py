"""Reading an ONNX model into an ``OnnxModule``, and writing trained weights back into it.

Checks come first and all at once: a file that is not an ONNX model names the
file; every node cube cannot import (an unknown operator, another domain, an
operator version outside opsets 13-21, an attribute or value the handler does
not implement, a subgraph) is listed in one error with its node name and opset.
"""
from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Callable, Collection, Dict, List, Optional, Tuple, Union

import numpy as np
import torch

from cube.onnx.module import Node, OnnxModule, Program
from cube.onnx.ops import DTYPES, OPS, STATIC_ONLY

log = logging.getLogger("cube")

OPSETS = range(13, 22)           # the opsets every handler is written for
FLOATS = {1, 10, 11, 16}         # float32, float16, float64, bfloat16
_EXTERNAL_LIMIT = 1 << 31        # protobuf's 2 GiB: beyond it the weights go to an external data file


def require_onnx():
    try:
        import onnx
    except ImportError as e:
        raise ImportError("cube.onnx needs the `onnx` package: pip install 'cube-compiler[onnx]' "
                          "(or pip install onnx; onnxruntime too to run the saved files)") from e
    return onnx


def read(src) -> Tuple[object, str]:
    """The ``ModelProto`` of a path, bytes or ``ModelProto``, checked, with a label for messages."""
    onnx = require_onnx()
    if isinstance(src, onnx.ModelProto):
        model, label = copy.deepcopy(src), "<ModelProto>"
    elif isinstance(src, (bytes, bytearray)):
        label = "<bytes>"
        try:
            model = onnx.load_from_string(bytes(src))
        except Exception as e:
            raise ValueError(f"cube.onnx.load: the bytes given are not an ONNX model ({type(e).__name__}: {e})") \
                from e
    elif isinstance(src, (str, Path)):
        path = Path(src)
        label = str(path)
        if not path.is_file():
            raise FileNotFoundError(f"cube.onnx.load: no ONNX file at {path}")
        try:
            model = onnx.load(str(path))
        except Exception as e:
            raise ValueError(f"cube.onnx.load: {path} is not a readable ONNX model ({type(e).__name__}: {e})") \
                from e
    else:
        raise TypeError(f"cube.onnx.load takes a path, bytes or an onnx.ModelProto, not {type(src).__name__}")
    try:
        onnx.checker.check_model(model)
    except Exception as e:
        raise ValueError(f"cube.onnx.load: {label} is not a valid ONNX model: {e}") from e
    if model.functions:
        from onnx import inliner
        model = inliner.inline_local_functions(model)
    return model, label


def opset_of(model, label: str) -> Tuple[object, int]:
    """The model at an opset cube reads: older models are converted to opset 13 first."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise ValueError(f"cube.onnx.load: {label} imports no default-domain opset")
    if opset < OPSETS.start:
        from onnx import version_converter
        try:
            model = version_converter.convert_version(model, OPSETS.start)
        except Exception as e:
            raise ValueError(f"cube.onnx.load: {label} has opset {opset}, which cube reads from opset "
                             f"{OPSETS.start}, and converting it failed ({type(e).__name__}: {e}); re-export "
                             f"with opset_version between {OPSETS.start} and {OPSETS.stop - 1}") from e
        log.info("cube.onnx: %s converted from opset %d to %d", label, opset, OPSETS.start)
        opset = OPSETS.start
    return model, opset


def _signature(schema) -> tuple:
    return (tuple(i.name for i in schema.inputs), tuple(o.name for o in schema.outputs),
            tuple(sorted(schema.attributes)))


def known_versions(op_type: str) -> Dict[int, object]:
    """The versions of ``op_type`` that opsets 13-21 use (since_version -> schema): what its handler
    is written for."""
    from onnx import defs
    known = {}
    for v in OPSETS:
        try:
            schema = defs.get_schema(op_type, v, "")
        except Exception:   # not defined yet at that opset
            continue
        known[schema.since_version] = schema
    return known


def version_problem(op_type: str, opset: int) -> Optional[str]:
    """Why ``op_type`` at ``opset`` is outside what its handler was written for, or None.

    A version between opsets 13 and 21 is known. After 21 a version is accepted when its inputs,
    outputs and attributes are those of opset 21 (new element types only)."""
    from onnx import defs
    try:
        schema = defs.get_schema(op_type, opset, "")
    except Exception:
        return f"no operator {op_type} at opset {opset}"
    known = known_versions(op_type)
    if schema.since_version in known:
        return None
    if opset < OPSETS.start:
        return f"its version {schema.since_version} is older than the ones cube reads (opsets 13-21)"
    newest = known[max(known)] if known else None
    if newest is not None and _signature(schema) == _signature(newest):
        return None
    return (f"its version {schema.since_version} changed inputs or attributes after opset {OPSETS.stop - 1}; "
            f"export with opset_version {OPSETS.stop - 1} or lower")


def unsupported(model, opset: int, label: str) -> List[str]:
    """One line per node cube cannot import."""
    onnx = require_onnx()
    problems = []
    for i, n in enumerate(model.graph.node):
        where = f"{n.op_type} (node {n.name or f'#{i}'!r}, opset {opset}"
        if n.domain not in ("", "ai.onnx"):
            problems.append(f"{where}, domain {n.domain!r}): operators of other domains are not supported")
            continue
        h = OPS.get(n.op_type)
        if h is None:
            problems.append(f"{where}): not supported")
            continue
        why = version_problem(n.op_type, opset)
        if why:
            problems.append(f"{where}): {why}")
            continue
        for a in n.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                problems.append(f"{where}): subgraphs (control flow) are not supported")
            elif a.name not in h.attrs:
                problems.append(f"{where}): attribute {a.name!r} is not supported")
            elif h.attrs[a.name] is not None and _attr(a) not in h.attrs[a.name]:
                problems.append(f"{where}): {a.name}={_attr(a)!r} is not supported "
                                f"(supported: {sorted(h.attrs[a.name], key=str)})")
    return problems


def _attr(a):
    from onnx import helper, numpy_helper
    v = helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list):
        return [x.decode() if isinstance(x, bytes) else x for x in v]
    if hasattr(v, "dims") and hasattr(v, "data_type"):   # a TensorProto
        return numpy_helper.to_array(v)
    return v


def tensor_of(init) -> torch.Tensor:
    """A float initializer as a torch tensor of its own dtype."""
    from onnx import numpy_helper
    if init.data_type == 16:   # bfloat16: numpy has none; its raw bits as int16
        if init.raw_data:
            bits = np.frombuffer(init.raw_data, dtype=np.int16).copy()
        else:
            bits = np.asarray(init.int32_data, dtype=np.int32).astype(np.uint16).view(np.int16)
        return torch.from_numpy(bits.reshape(tuple(init.dims))).view(torch.bfloat16)
    return torch.from_numpy(np.array(numpy_helper.to_array(init), copy=True))


_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"


def _weight_like(t: torch.Tensor) -> bool:
    """Finite values of ordinary size: not a mask (``-inf``, or the dtype's lowest value)."""
    return bool(torch.isfinite(t).all()) and bool((t.abs() < 1e30).all())


def module_paths(names) -> Dict[str, str]:
    """ONNX initializer name -> module path: each dot a submodule level, other characters that
    cannot name a module attribute replaced by ``_``, clashes numbered."""
    paths, taken, leaves, scopes = {}, set(), set(), set()
    for name in names:
        parts = [re.sub(r"[^0-9A-Za-z_]", "_", p) or "_" for p in name.split(".")]
        path = ".".join(parts)
        prefixes = {".".join(parts[:k]) for k in range(1, len(parts))}
        if path in taken or path in scopes or prefixes & leaves:   # fall back to one flat name
            path = "_".join(parts)
            while path in taken or path in scopes:
                path += "_"
            prefixes = set()
        taken.add(path)
        leaves.add(path)
        scopes |= prefixes
        paths[name] = path
    return paths


def roles(model, trainable) -> Tuple[Dict[str, bool], Dict[str, np.ndarray]]:
    """Which initializers are parameters (True), buffers (False) and static constants (numpy).

    Float initializers are parameters where torch's exporter marked them so; unmarked ones
    (constants the exporter folded, files from elsewhere) when they have more than one element
    and no mask-like values (infinite, or beyond 1e30). Never the ones an operator needs while
    tracing (shapes, scales: static constants) or running statistics (buffers). ``trainable``
    (names, or ``fn(name, tensor) -> bool``) overrides the choice between parameter and buffer.
    """
    from onnx import numpy_helper
    static_uses, stats = set(), set()
    for n in model.graph.node:
        h = OPS.get(n.op_type)
        for i, name in enumerate(n.input):
            if n.op_type in STATIC_ONLY or (h is not None and i in h.static):
                static_uses.add(name)
            if n.op_type == "BatchNormalization" and i in (3, 4):
                stats.add(name)
    kinds = {}   # what torch's exporter says an initializer was: PARAMETER, BUFFER, CONSTANT_TENSOR
    for v in list(model.graph.value_info) + list(model.graph.input) + list(model.graph.initializer):
        for m in getattr(v, "metadata_props", ()):
            if m.key == _KIND:
                kinds[v.name] = m.value
    tensors, constants = {}, {}
    for init in model.graph.initializer:
        if init.data_type not in FLOATS or init.name in static_uses:
            constants[init.name] = numpy_helper.to_array(init)
            continue
        t = tensor_of(init)
        if trainable is None:
            kind = kinds.get(init.name)
            train = init.name not in stats and (
                kind == "PARAMETER" if kind else (t.dim() >= 1 and t.numel() > 1 and _weight_like(t)))
        elif callable(trainable):
            train = bool(trainable(init.name, t))
        else:
            train = init.name in trainable
        tensors[init.name] = (t, train)
    return tensors, constants


def load(src, trainable: Union[None, Collection[str], Callable] = None) -> OnnxModule:
    """See ``cube.onnx.load``."""
    model, label = read(src)
    model, opset = opset_of(model, label)
    problems = unsupported(model, opset, label)
    if problems:
        raise ValueError(f"cube.onnx.load: {label} uses {len(problems)} node(s) cube cannot import:\n  - "
                         + "\n  - ".join(problems)
                         + "\n`python -m cube.onnx ops` lists the operators cube imports.")
    values, constants = roles(model, trainable)
    paths = module_paths(values)
    nodes = []
    for i, n in enumerate(model.graph.node):
        attrs = {a.name: _attr(a) for a in n.attribute}
        where = f"node {n.name or f'#{i}'!r} ({n.op_type}, opset {opset}) in {label}"
        node = Node(i, n.op_type, n.name, tuple(n.input), tuple(n.output), attrs, OPS[n.op_type], n, where)
        if n.op_type == "Constant":   # folded now: never a node at run time
            constants[n.output[0]] = _constant(node)
            continue
        nodes.append(node)
    inits = {i.name for i in model.graph.initializer}
    inputs = [v.name for v in model.graph.input if v.name not in inits]
    outputs = [v.name for v in model.graph.output]
    stripped = copy.deepcopy(model)   # the graph kept for save(): the data of trained tensors dropped
    for init in stripped.graph.initializer:
        if init.name in values:
            for f in ("raw_data", "float_data", "double_data", "int32_data"):
                init.ClearField(f)
    program = Program(stripped, nodes, inputs, outputs, constants, paths, opset, label)
    log.info("cube.onnx: %s: %d nodes, %d parameters, %d buffers, opset %d", label, len(nodes),
             sum(t for _, t in values.values()), sum(not t for _, t in values.values()), opset)
    return OnnxModule(program, values)


def _constant(node: Node) -> np.ndarray:
    a = node.attrs
    if "value" in a:
        return np.asarray(a["value"])
    if "value_float" in a:
        return np.array(a["value_float"], dtype=np.float32)
    if "value_floats" in a:
        return np.array(a["value_floats"], dtype=np.float32)
    if "value_int" in a:
        return np.array(a["value_int"], dtype=np.int64)
    if "value_ints" in a:
        return np.array(a["value_ints"], dtype=np.int64)
    raise node.error("a Constant with none of value, value_float(s), value_int(s)")


def save(module: OnnxModule, path, state_dict: Optional[dict] = None, strip_prefix: str = "") -> Path:
    """See ``cube.onnx.save``."""
    onnx = require_onnx()
    from onnx import numpy_helper
    if not isinstance(module, OnnxModule):
        raise TypeError(f"cube.onnx.save takes the module cube.onnx.load made, not {type(module).__name__}")
    program = module.program
    if state_dict is None:
        state_dict = module.state_dict()
    elif strip_prefix:
        state_dict = {k[len(strip_prefix):]: v for k, v in state_dict.items() if k.startswith(strip_prefix)}
    missing = [p for p in program.tensors.values() if p not in state_dict]
    if missing:
        raise ValueError(f"cube.onnx.save: the state dict lacks {len(missing)} tensor(s) of the model, e.g. "
                         f"{missing[:3]}; it has {list(state_dict)[:3]}... (pass strip_prefix= to drop a "
                         f"wrapper's prefix)")
    model = copy.deepcopy(program.proto)
    size = 0
    for init in model.graph.initializer:
        if init.name not in program.tensors:
            continue
        t = state_dict[program.tensors[init.name]].detach().to("cpu")
        want = DTYPES[init.data_type]
        if tuple(t.shape) != tuple(init.dims):
            raise ValueError(f"cube.onnx.save: {program.tensors[init.name]} has shape {tuple(t.shape)}, the "
                             f"initializer {init.name!r} {tuple(init.dims)}")
        t = t.to(want).contiguous()
        if want == torch.bfloat16:
            init.raw_data = t.view(torch.int16).numpy().tobytes()
        else:
            init.CopyFrom(numpy_helper.from_array(t.numpy(), init.name))
        size += t.numel() * t.element_size()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    external = size >= _EXTERNAL_LIMIT - (64 << 20)
    onnx.save_model(model, str(out), save_as_external_data=external,
                    location=out.name + ".data" if external else None)
    return out
