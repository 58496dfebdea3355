"""``OnnxModule``: an ONNX graph run node by node with torch operators, as an ordinary ``nn.Module``.

Values are of two kinds while the graph runs:

- *static*: known from the shapes of the inputs alone (``Shape``, ``Constant``,
  integer initializers and whatever is computed only from them: the shape
  arithmetic exporters emit). cube traces with static shapes, so these are
  computed with numpy (ONNX's reference implementation) the first time a
  signature of input shapes is seen, cached, and reach torch only as constants.
- *dynamic*: everything that depends on the data or the weights, computed by
  the torch handlers of ``cube.onnx.ops``, which ``torch.export`` traces.

Float initializers become parameters, named after the initializers (each dot
a submodule, as ``named_parameters`` of the exporting model had them); the
ones that are constants (see ``cube.onnx.graph.roles``) become buffers.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from cube.errors import CubeInternalError
from cube.onnx.ops import DTYPES, Handler


@dataclass
class Node:
    """One ONNX node with its attributes read once."""
    index: int
    op_type: str
    name: str
    inputs: Tuple[str, ...]    # "" where an optional input is left out
    outputs: Tuple[str, ...]
    attrs: dict
    handler: Handler
    proto: object              # the NodeProto, for the reference evaluator
    where: str                 # "node 'name' (Op, opset N) in file"

    def error(self, message: str) -> ValueError:
        return ValueError(f"cube.onnx: {self.where}: {message}")


class Call:
    """What a handler sees of its node in one run: attributes, output count, training flag and which
    inputs were static or parameters."""
    __slots__ = ("node", "training", "values", "params")

    def __init__(self, node: Node, training: bool, values: Sequence[object], params: Sequence[bool]):
        self.node, self.training, self.values, self.params = node, training, values, params

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def noutputs(self) -> int:
        return len(self.node.outputs)

    def attr(self, name: str, default=None):
        return self.node.attrs.get(name, default)

    def is_static(self, i: int) -> bool:
        return i < len(self.values) and isinstance(self.values[i], np.ndarray)

    def is_param(self, i: int) -> bool:
        return i < len(self.params) and self.params[i]

    def nonnegative(self, i: int) -> bool:
        """Whether input ``i`` is static with no negative entry (an index needing no wrap-around)."""
        return self.is_static(i) and bool((self.values[i] >= 0).all())

    def dtype(self, code: int) -> torch.dtype:
        if code not in DTYPES:
            raise self.node.error(f"element type {code} has no torch equivalent cube supports")
        return DTYPES[code]

    def error(self, message: str) -> ValueError:
        return self.node.error(message)


class Program:
    """The graph, shared by every copy of a module (``deepcopy`` keeps one): nodes, initializer
    roles, and per signature of input shapes the static values, computed once."""

    def __init__(self, proto, nodes: List[Node], inputs: Sequence[str], outputs: Sequence[str],
                 constants: Dict[str, np.ndarray], tensors: Dict[str, str], opset: int, source: str):
        self.proto = proto          # the model, the data of parameter and buffer initializers dropped
        self.nodes = nodes
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.constants = constants  # static initializers: name -> numpy
        self.tensors = tensors      # parameter and buffer initializers: ONNX name -> module path
        self.opset = opset
        self.source = source
        self.static: Dict[tuple, Tuple[Dict[str, np.ndarray], frozenset]] = {}
        self._evaluators: Dict[int, object] = {}
        self._lock = threading.Lock()
        last: Dict[str, int] = {}
        for node in nodes:
            for name in node.inputs:
                if name:
                    last[name] = node.index
        self.free_after: Dict[int, List[str]] = {}
        for name, i in last.items():
            if name not in self.outputs and name not in tensors:
                self.free_after.setdefault(i, []).append(name)

    def __deepcopy__(self, memo):
        return self

    def evaluate(self, node: Node, values: Sequence[Optional[np.ndarray]]) -> List[np.ndarray]:
        """The node on static inputs, by ONNX's reference implementation."""
        from onnx.reference import ReferenceEvaluator
        with self._lock:
            ev = self._evaluators.get(node.index)
            if ev is None:
                ev = self._evaluators[node.index] = ReferenceEvaluator(node.proto, opsets={"": self.opset})
        feeds = {name: v for name, v in zip(node.inputs, values) if name}
        try:
            return [np.asarray(v) for v in ev.run(None, feeds)]
        except Exception as e:   # the reference implementation's own message, with the node's place
            raise node.error(f"computing it on values known while tracing failed: {type(e).__name__}: {e}") from e


class _Scope(torch.nn.Module):
    """A level of the dotted initializer names (``blocks`` in ``blocks.0.linear1.weight``)."""


class OnnxModule(torch.nn.Module):
    """An imported ONNX graph: ``forward(*inputs)`` takes the graph's inputs in order and returns its
    output (a tuple when it has several). Made by ``cube.onnx.load``."""

    def __init__(self, program: Program, values: Dict[str, Tuple[torch.Tensor, bool]]):
        super().__init__()
        self._program = program
        self._trainable = frozenset(n for n, (_, trainable) in values.items() if trainable)
        for onnx_name, path in program.tensors.items():
            tensor, trainable = values[onnx_name]
            *scopes, leaf = path.split(".")
            owner = self
            for s in scopes:
                if s not in owner._modules:
                    owner.add_module(s, _Scope())
                owner = owner._modules[s]
            if trainable:
                owner.register_parameter(leaf, torch.nn.Parameter(tensor))
            else:
                owner.register_buffer(leaf, tensor)

    @property
    def program(self) -> Program:
        """The imported graph (shared by every copy of the module)."""
        return self._program

    @property
    def onnx_inputs(self) -> Tuple[str, ...]:
        return self._program.inputs

    @property
    def onnx_outputs(self) -> Tuple[str, ...]:
        return self._program.outputs

    def extra_repr(self) -> str:
        p = self._program
        return f"source={p.source!r}, opset={p.opset}, nodes={len(p.nodes)}, inputs={list(p.inputs)}"

    def forward(self, *args):
        prog = self._program
        if len(args) != len(prog.inputs) or not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError(f"cube.onnx: the model from {prog.source} takes {len(prog.inputs)} tensors "
                            f"({', '.join(prog.inputs)}), got {len(args)} arguments "
                            f"({', '.join(type(a).__name__ for a in args)})")
        key = tuple((tuple(a.shape), a.dtype) for a in args)
        cached = prog.static.get(key)
        env: Dict[str, object] = dict(zip(prog.inputs, args))
        params = self._trainable
        for onnx_name, path in prog.tensors.items():
            env[onnx_name] = self.get_parameter(path) if onnx_name in params else self.get_buffer(path)
        statics: Dict[str, np.ndarray]
        if cached is not None:
            statics, skip = cached
            env.update(statics)
        else:
            statics, skip = dict(prog.constants), set()
            env.update(statics)
        device = args[0].device if args else torch.device("cpu")
        for node in prog.nodes:
            if node.index in skip:
                continue
            values = [env[n] if n else None for n in node.inputs]
            if cached is None and self._static(node, values):
                outs = self._fold(node, values)
                for name, v in zip(node.outputs, outs):
                    if name:
                        env[name] = statics[name] = v
                skip.add(node.index)
            else:
                outs = self._run(node, values, params, device)
                for name, v in zip(node.outputs, outs):
                    if name:
                        env[name] = v
            for name in prog.free_after.get(node.index, ()):
                if name not in statics:
                    env.pop(name, None)
        if cached is None:
            prog.static[key] = (statics, frozenset(skip))
        outs = [self._as_tensor(env[name], device) for name in prog.outputs]
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def _static(node: Node, values) -> bool:
        if node.op_type in ("Shape", "Size"):
            return True
        return all(v is None or isinstance(v, np.ndarray) for v in values)

    def _fold(self, node: Node, values) -> List[np.ndarray]:
        if node.op_type in ("Shape", "Size"):
            shape = np.array(tuple(values[0].shape), dtype=np.int64)
            if node.op_type == "Size":
                return [np.array(int(np.prod(shape)), dtype=np.int64)]
            rank = len(shape)
            start, end = node.attrs.get("start", 0), node.attrs.get("end", rank)
            start, end = (start + rank if start < 0 else start), (end + rank if end < 0 else end)
            return [shape[max(0, min(start, rank)):max(0, min(end, rank))]]
        own = _NUMPY.get(node.op_type)
        if own is not None:
            return own(node, *values)
        return self._program.evaluate(node, values)

    def _run(self, node: Node, values, params, device) -> tuple:
        h = node.handler
        dev = next((v.device for v in values if isinstance(v, torch.Tensor)), device)
        call = Call(node, self.training, values, [n in params for n in node.inputs])
        args = []
        for i, v in enumerate(values):
            if isinstance(v, list):   # a sequence (SplitToSequence): its tensors as they are
                args.append(v)
            elif i in h.static:
                if isinstance(v, torch.Tensor):
                    raise node.error(f"input {i} ({node.inputs[i]!r}) is computed from the data, but cube "
                                     f"needs it while tracing (a shape, axes or sizes): the graph has data-"
                                     f"dependent shapes, which cube does not support")
                args.append(v)
            else:
                args.append(self._as_tensor(v, dev))
        try:
            out = h.fn(call, *args)
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"in ONNX {node.where}")
            raise
        outs = out if isinstance(out, tuple) else (out,)
        if len(outs) < len([o for o in node.outputs if o]):
            raise CubeInternalError(f"cube.onnx handler of {node.op_type} returned {len(outs)} outputs for "
                                    f"{node.where} with outputs {node.outputs}")
        return outs

    @staticmethod
    def _as_tensor(v, device):
        if v is None or isinstance(v, torch.Tensor):
            return v
        return torch.from_numpy(np.array(v, copy=True)).to(device)


def _gather_elements(node: Node, data: np.ndarray, indices: np.ndarray) -> List[np.ndarray]:
    """GatherElements on values known while tracing. ONNX's reference implementation needs the
    indices shaped like the data; the operator reads only the data's leading part (indices of shape
    (1, 16) into data of (2, 512), as Hugging Face's BERT exports)."""
    axis = node.attrs.get("axis", 0) % data.ndim
    region = tuple(slice(0, s) if d != axis else slice(None) for d, s in enumerate(indices.shape))
    part = data[region]
    idx = np.where(indices < 0, indices + data.shape[axis], indices)
    return [np.take_along_axis(part, idx, axis=axis)]


_NUMPY = {"GatherElements": _gather_elements}   # static values computed here, not by the reference
