"""fx (ATen training IR) -> cube IR."""
from __future__ import annotations

import operator
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

from cube.ir.graph import IRGraph
from cube.ir.operator import IRDataOperation, IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.trace.rules import REGISTRY, Registry

# ops that only check metadata or do nothing at run time: not IR ops
_DROPPED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
            "sym_constrain_range_for_size", "_assert_async", "_functional_assert_async"}

_IDENTITY = {"alias"}

_FILE_LINE = re.compile(r'File "(.+)", line (\d+), in (\S+)\n\s*(.*)')


def op_name(target: Any) -> str:
    """The name a policy selects on: ``aten.linear.default`` -> ``linear``."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


_TORCH_DIR = os.path.dirname(torch.__file__)


def _source(node: torch.fx.Node) -> Optional[Tuple[str, int, str]]:
    """The innermost line of the user's model (not torch's) that made ``node``."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    found = [f for f in _FILE_LINE.findall(trace) if not f[0].startswith(_TORCH_DIR)]
    if not found:
        return None
    file, line, _, code = found[-1]
    return os.path.basename(file), int(line), code.strip()


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # non-strict export names paths as attribute chains; normalise "L['self'].a[0]" to "a.0"
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    path = path.replace("._modules.", ".").lstrip(".")
    return path


def _tensor_of(val: Any, hint: str) -> IRTensor:
    if not isinstance(val, torch.Tensor):
        raise TypeError(f"value {hint!r} is a {type(val).__name__}, not a tensor")
    return IRTensor(tuple(int(s) for s in val.shape), val.dtype, bool(val.requires_grad),
                    TensorKind.ACTIVATION, hint)


class _Builder:
    def __init__(self, ep, model: torch.nn.Module, batch_structure: str, registry: Registry):
        self.ep = ep
        self.model = model
        self.registry = registry
        self.env: Dict[torch.fx.Node, Any] = {}
        self.ops: List = []
        self.attrs: List[IRTensor] = []
        self.batch_structure = batch_structure
        self.consts: Dict[str, torch.Tensor] = {}

    # -------------------------------------------------------------- placeholders
    def placeholders(self) -> IRDataOperation:
        specs = {s.arg.name: s for s in self.ep.graph_signature.input_specs}
        by_id: Dict[int, IRTensor] = {}
        data: List[IRTensor] = []
        for node in self.ep.graph.nodes:
            if node.op != "placeholder":
                continue
            spec = specs[node.name]
            kind = spec.kind.name
            val = node.meta.get("val")
            if kind == "USER_INPUT":
                t = _tensor_of(val, node.name)
                t.kind, t.requires_grad = TensorKind.DATA, False
                data.append(t)
            elif kind in ("PARAMETER", "BUFFER"):
                obj = (self.model.get_parameter(spec.target) if kind == "PARAMETER"
                       else self.model.get_buffer(spec.target))
                t = by_id.get(id(obj))
                if t is None:
                    t = IRTensor(tuple(obj.shape), obj.dtype, bool(obj.requires_grad),
                                 TensorKind.PARAM if kind == "PARAMETER" else TensorKind.BUFFER,
                                 spec.target, (spec.target,))
                    by_id[id(obj)] = t
                    self.attrs.append(t)
                elif spec.target not in t.names:  # tied weights: one tensor, several names
                    t.names = t.names + (spec.target,)
            elif kind == "CONSTANT_TENSOR":
                value = self.ep.constants[spec.target]
                t = IRTensor(tuple(value.shape), value.dtype, False, TensorKind.CONST,
                             spec.target, (spec.target,))
                self.consts[spec.target] = value.detach().clone()
                self.attrs.append(t)
            else:
                raise TypeError(f"cube cannot handle exported input {node.name!r} of kind {kind}")
            self.env[node] = t
        return IRDataOperation(outputs=data, structure=self.batch_structure)

    # ----------------------------------------------------------------- call ops
    def _map(self, a):
        if isinstance(a, torch.fx.Node):
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self._map(x) for x in a)
        if isinstance(a, dict):
            return {k: self._map(v) for k, v in a.items()}
        return a

    def run(self, graph: torch.fx.Graph, grad_enabled: bool = True, args: Optional[list] = None):
        """Builds IR ops for ``graph``; ``args`` bind a subgraph's placeholders."""
        result = None
        it = iter(args or [])
        for node in graph.nodes:
            if node.op == "placeholder":
                if args is not None:
                    self.env[node] = next(it)
            elif node.op == "get_attr":
                self.env[node] = getattr(self.ep.graph_module, node.target)
            elif node.op == "call_function":
                self.call(node, grad_enabled)
            elif node.op == "output":
                result = self._map(node.args[0])
            else:
                raise TypeError(f"unexpected fx node {node.format_node()}")
        return result

    def call(self, node: torch.fx.Node, grad_enabled: bool) -> None:
        target = node.target
        if target is operator.getitem:
            self.env[node] = self.env[node.args[0]][node.args[1]]
            return
        name = op_name(target)
        if name in _DROPPED:
            self.env[node] = None
            return
        if name in _IDENTITY:  # a view of its input that changes nothing: not an IR op
            self.env[node] = self._map(node.args[0])
            return
        if name == "wrap_with_set_grad_enabled":
            enabled, sub, *operands = node.args
            sub_module = self.env[sub]
            self.env[node] = self.run(sub_module.graph, bool(enabled), [self._map(a) for a in operands])
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise TypeError(f"cube cannot handle the traced call {node.format_node()} "
                            f"(from {_source(node)}); only ATen and registered ops are supported")
        args, kwargs = self._map(node.args), self._map(node.kwargs)
        inputs = [a for a in _flatten((args, kwargs)) if isinstance(a, IRTensor)]
        val = node.meta.get("val")
        if isinstance(val, (list, tuple)):
            outputs = [_tensor_of(v, f"{node.name}_{i}") for i, v in enumerate(val)]
            value = tuple(outputs)
        elif val is None:
            outputs, value = [], None
        else:
            outputs = [_tensor_of(val, node.name)]
            value = outputs[0]
        # fake values do not track autograd: an output needs a gradient when a float input does
        needs = grad_enabled and any(t.requires_grad for t in inputs)
        for o in outputs:
            o.requires_grad = bool(needs and (o.dtype.is_floating_point or o.dtype.is_complex))
        op = IRFwOperation(name=name, inputs=inputs, outputs=outputs, target=target,
                           args=args, kwargs=kwargs, module_path=_module_path(node),
                           source=_source(node), grad_enabled=grad_enabled)
        self.registry.annotate(op)
        self.ops.append(op)
        self.env[node] = value


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


def build_graph(ep, model: torch.nn.Module, batch_structure: str,
                registry: Registry = REGISTRY) -> Tuple[IRGraph, Dict[str, torch.Tensor]]:
    """Turns an exported program into an ``IRGraph``.

    Returns:
        The graph and the values of lifted constant tensors (by name).

    Raises:
        TypeError: the forward does not return one scalar tensor.
    """
    b = _Builder(ep, model, batch_structure, registry)
    data_op = b.placeholders()
    out = b.run(ep.graph)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    user = [s for s in ep.graph_signature.output_specs if s.kind.name == "USER_OUTPUT"]
    if len(user) != 1 or len(outs) < 1 or not isinstance(outs[0], IRTensor):
        raise TypeError(f"{type(model).__qualname__}.forward must return one scalar loss tensor; "
                        f"it returned {len(user)} outputs. Return the loss only (e.g. the mean "
                        f"cross entropy) and keep other values out of the forward's result.")
    spec = getattr(getattr(ep, "call_spec", None), "out_spec", None)
    if spec is not None and not spec.is_leaf():   # e.g. {"loss": ...}: the step calls loss.backward()
        raise TypeError(f"{type(model).__qualname__}.forward must return a scalar loss tensor, not a "
                        f"{getattr(spec.type, '__name__', spec.type)} holding it; return the tensor itself "
                        f"(e.g. `return loss`), since the training step calls loss.backward() on it.")
    loss = outs[0]
    if loss.ndim != 0 or not loss.dtype.is_floating_point:
        raise TypeError(f"{type(model).__qualname__}.forward must return a scalar floating-point "
                        f"loss; it returned a tensor of shape {list(loss.shape)} and dtype {loss.dtype}. "
                        f"Reduce it (e.g. loss.mean()) inside forward.")
    graph = IRGraph([data_op] + b.ops, b.attrs, loss, name=type(model).__name__)
    return graph, b.consts
