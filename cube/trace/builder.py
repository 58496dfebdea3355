"""fx (ATen training IR) -> cube IR."""
from __future__ import annotations

import json
import operator
import os
import re
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.fx

from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph
from cube.ir.ops import ALIASES, op_info
from cube.ir.operator import IRDataOperation, IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.trace import inplace
from cube import config
from cube.trace import flex
from cube.trace.casts import MARK, retarget
from cube.trace.fused import split_fused
from cube.trace.heads import unmerge_heads
from cube.trace.merged import unmerge
from cube.trace.rows import unflatten_loss, unflatten_rows
from cube.trace.rules import REGISTRY, Registry

# ops that only check metadata or do nothing at run time: not IR ops
_DROPPED = {"_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range",
            "sym_constrain_range_for_size", "_assert_async", "_functional_assert_async"}

_IDENTITY = {"alias"}

# ops the builder writes as what they compute (the method of ``_Builder`` doing it)
_REWRITES = {"type_as": "_type_as", "new_zeros": "_new_like", "new_ones": "_new_like", "new_empty": "_new_like",
             "new_full": "_new_like", "cat": "_cat", "concat": "_cat", "expand_as": "_shape_of",
             "reshape_as": "_shape_of", "squeeze": "_squeeze", "pad": "_shifted", "constant_pad_nd": "_shifted"}
# x.expand_as(y), x.reshape_as(y) -> the op to y's shape (``_shape_of``)
_SHAPE_OF = {"expand_as": torch.ops.aten.expand.default, "reshape_as": torch.ops.aten.reshape.default}

# x.new_X(...) -> torch.X(...) with x's dtype and device
_NEW = {"new_zeros": ("zeros", "default"), "new_ones": ("ones", "default"), "new_empty": ("empty", "memory_format"),
        "new_full": ("full", "default")}

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


def _persistent(model: torch.nn.Module, target: str) -> bool:
    """Whether buffer ``target`` is in ``model.state_dict()``: not registered with ``persistent=False``."""
    owner, _, leaf = target.rpartition(".")
    return leaf not in model.get_submodule(owner)._non_persistent_buffers_set


_SYM = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _hint(v: Any):
    """The value a symbolic size stands for in this trace (a dynamic batch dim's size), or None
    when it has none: a value read from a tensor's data (``.item()``, ``.tolist()``)."""
    if not isinstance(v, _SYM):
        return v
    node = v.node
    has = getattr(node, "has_hint", None)
    if has is not None and not has():
        return None
    hint = getattr(node, "hint", None)
    return None if hint is None else type(hint)(hint)


def _tensor_of(val: Any, hint: str) -> IRTensor:
    if not isinstance(val, torch.Tensor):
        raise CubeInternalError(f"value {hint!r} is a {type(val).__name__}, not a tensor")
    shape = tuple(_hint(s) for s in val.shape)
    if any(s is None for s in shape):
        raise CubeInternalError(f"value {hint!r} has a data-dependent shape {tuple(val.shape)}")
    return IRTensor(tuple(int(s) for s in shape), val.dtype, bool(val.requires_grad), TensorKind.ACTIVATION, hint)


def _whole_slice(node: torch.fx.Node) -> bool:
    """``x[a:b]`` that keeps every element of the dim (``x[:, 0] = v`` slices dim 0 whole): an alias.
    Whether export traces it can depend on the size (not for a dim of size 1), so it is never an op."""
    src, val = node.args[0].meta.get("val"), node.meta.get("val")
    step = node.args[4] if len(node.args) > 4 else node.kwargs.get("step", 1)
    return isinstance(src, torch.Tensor) and isinstance(val, torch.Tensor) and _hint(step) == 1 and \
        tuple(_hint(s) for s in src.shape) == tuple(_hint(s) for s in val.shape)


def _legacy_empty(val: Any) -> bool:
    """A 1-D tensor of size 0, which ``torch.cat`` skips (a key/value cache before its first update)."""
    return isinstance(val, torch.Tensor) and val.ndim == 1 and _hint(val.shape[0]) == 0


def data_dependent(node: torch.fx.Node) -> ValueError:
    """The error for a value computed from a tensor's data that the graph then depends on."""
    return ValueError(
        f"op {op_name(node.target)!r} at {_where(node)} makes a Python number from a tensor's values (a "
        f"data-dependent shape or count, e.g. .item(), .tolist(), or tokens per expert under MoE routing). "
        f"cube compiles a static graph: every shape must follow from the batch's shape. Fix: compute with "
        f"fixed shapes (pad to a capacity, a dense dispatch over all experts, torch.where instead of "
        f"boolean indexing), or wrap the code in a function registered with cube.register_op.")


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
        # in-place writes made functional (cube.trace.inplace): which values are views of
        # which, and how many times each memory owner was written
        self.views: Dict[torch.fx.Node, inplace.View] = {}
        self.versions: Dict[torch.fx.Node, int] = {}
        self.grad_enabled = True
        # block masks of flex_attention built in forward: evaluated while tracing (cube.trace.flex)
        try:
            self.masks = flex.masks(ep)
        except flex.FlexRefused as e:
            raise ValueError(f"flex_attention: {e}") from None

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
                persistent = kind == "PARAMETER" or _persistent(self.model, spec.target)
                if t is None:
                    t = IRTensor(tuple(obj.shape), obj.dtype, bool(obj.requires_grad),
                                 TensorKind.PARAM if kind == "PARAMETER" else TensorKind.BUFFER,
                                 spec.target, (spec.target,), persistent=persistent)
                    by_id[id(obj)] = t
                    self.attrs.append(t)
                elif spec.target not in t.names:  # tied weights: one tensor, several names
                    t.names = t.names + (spec.target,)
                    t.persistent = t.persistent or persistent   # saved under the name state_dict() has
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
            return self._value(a)
        if isinstance(a, _SYM):
            return _hint(a)
        if isinstance(a, (list, tuple)):
            return type(a)(self._map(x) for x in a)
        if isinstance(a, dict):
            return {k: self._map(v) for k, v in a.items()}
        return a

    def run(self, graph: torch.fx.Graph, grad_enabled: bool = True, args: Optional[list] = None):
        """Builds IR ops for ``graph``; ``args`` (fx nodes of the enclosing graph, or
        values) bind a subgraph's placeholders."""
        result = None
        it = iter(args or [])
        outer = self.grad_enabled
        self.grad_enabled = grad_enabled
        for node in graph.nodes:
            if node.op == "placeholder":
                if args is not None:
                    a = next(it)
                    self.env[node] = self._map(a)
                    if isinstance(a, torch.fx.Node):   # a write inside the subgraph reaches the caller's value
                        self._alias(node, a)
            elif node.op == "get_attr":
                self.env[node] = getattr(self.ep.graph_module, node.target)
            elif node in self.masks.folded:
                self._folded(node)
            elif node in self.masks.skipped:   # made again by the block-mask op (``_flex``)
                self.env.setdefault(node, None)
            elif node.op == "call_function":
                self.call(node, grad_enabled)
            elif node.op == "output":
                result = self._map(node.args[0])
            else:
                raise TypeError(f"unexpected fx node {node.format_node()}")
        self.grad_enabled = outer
        return result

    # ------------------------------------------------------- in-place writes
    def _value(self, node: torch.fx.Node):
        """The current value of ``node``; a view of a tensor written after the view was made
        is made again from the written tensor."""
        view = self.views.get(node)
        if view is not None and view.version != self.versions.get(view.root, 0):
            if view.index is not None:
                self.env[node] = self._value(view.parent)[view.index]
            elif view.node is None:
                self.env[node] = self._value(view.parent)
            else:
                made = view.node
                old = self.env[node]
                like = list(old) if isinstance(old, (list, tuple)) else [old]
                args, kwargs = self._map(made.args), self._map(made.kwargs)
                outs = self._op(made, made.target, args, kwargs, [_like(t, made.name) for t in like]).outputs
                self.env[node] = tuple(outs) if isinstance(old, (list, tuple)) else outs[0]
            view.version = self.versions.get(view.root, 0)
        return self.env[node]

    def _alias(self, node: torch.fx.Node, parent: torch.fx.Node, made: Optional[torch.fx.Node] = None,
               index: Optional[int] = None) -> None:
        root = self.views[parent].root if parent in self.views else parent
        self.views[node] = inplace.View(parent, root, made, index, self.versions.get(root, 0))

    def _functional(self, node: torch.fx.Node, args, kwargs) -> bool:
        """Builds an in-place op as its functional op and writes the result back into the
        tensor that owns the memory; False (kept in place) for a write into model state."""
        target = node.target
        pos = inplace.written(target)
        nodes = [node.args[i] if i < len(node.args) else node.kwargs.get(target._schema.arguments[i].name)
                 for i in pos]
        roots = [self.views[n].root if n in self.views else n for n in nodes if isinstance(n, torch.fx.Node)]
        state = (TensorKind.PARAM, TensorKind.BUFFER, TensorKind.CONST)
        if all(isinstance(self.env.get(r), IRTensor) and self.env[r].kind in state for r in roots):
            return False   # the model's state changes in place, as in the model
        if pos != [0] or len(roots) != 1 or not node.args or node.args[0] not in nodes:
            raise TypeError(f"{op_name(target)} at {_where(node)} writes into {len(pos)} tensors, not only "
                            f"into its first argument; cube cannot make it functional. Fix: compute a new "
                            f"tensor instead of writing into an existing one, or register the code as one "
                            f"op with cube.register_op.")
        x = node.args[0]
        fn = inplace.functional(target)
        new = _tensor_of(node.meta.get("val"), node.name)
        if op_name(target) == "copy_":   # aten.copy has no derivative: the value is src, cast and broadcast
            new = self._copied(node, args[0], args[1], new)
        elif fn is not None:
            self._op(node, fn, args, kwargs, [new])
        else:   # no out-of-place form: write into a copy that nothing else reads
            copy = self._op(node, torch.ops.aten.clone.default, [args[0]], {},
                            [_like(args[0], node.name + "_copy")]).outputs[0]
            self._op(node, target, [copy, *args[1:]], kwargs, [new])
        self._write_back(node, x, new)
        self.env[node] = new
        self._alias(node, x)   # an in-place op returns the tensor it wrote
        return True

    def _copied(self, node: torch.fx.Node, dst: IRTensor, src: IRTensor, new: IRTensor) -> IRTensor:
        """What ``dst.copy_(src)`` leaves in ``dst``: ``src`` in ``dst``'s dtype and shape."""
        value = src
        if src.dtype != dst.dtype:
            cast = IRTensor(tuple(src.shape), dst.dtype, False, TensorKind.ACTIVATION, node.name + "_cast")
            value = self._op(node, torch.ops.aten._to_copy.default, [value], {"dtype": dst.dtype}, [cast]).outputs[0]
        if tuple(value.shape) != tuple(dst.shape):
            value = self._op(node, torch.ops.aten.expand.default, [value, list(dst.shape)], {},
                             [_like(dst, node.name + "_expand")]).outputs[0]
        if value is src:
            value = self._op(node, torch.ops.aten.clone.default, [src], {}, [new]).outputs[0]
        return value

    def _write_back(self, node: torch.fx.Node, x: torch.fx.Node, new: IRTensor) -> None:
        """Writes the new value of ``x`` back through the views it is made of, to its root."""
        child, value = x, new
        while child in self.views:
            view = self.views[child]
            if view.node is None:   # an alias: the same elements
                child = view.parent
                continue
            made = view.node
            parent = self.views[made].parent if view.index is not None else view.parent
            base = self._value(parent)
            val = made.meta.get("val")
            shapes = [tuple(v.shape) for v in (val if isinstance(val, (list, tuple)) else [val])]
            how = inplace.scatter(made, view.index, tuple(base.shape), shapes)
            if how is None:
                raise TypeError(f"{op_name(node.target)} at {_where(node)} writes into a view made by "
                                f"{op_name(made.target)} ({_where(made)}); cube makes in-place writes "
                                f"functional and cannot write back through that view. Fix: build the "
                                f"tensor without writing into such a view (e.g. torch.cat or torch.where).")
            target, template = how
            if target != "same":
                args = [base if a == "base" else value if a == "src" else a for a in template]
                value = self._op(node, target, args, {}, [_like(base, node.name + "_write")]).outputs[0]
            child = parent
        self.env[child] = value
        self.versions[child] = self.versions.get(child, 0) + 1
        if x in self.views:   # x itself holds the written value, not a view made again
            self.env[x] = new
            self.views[x].version = self.versions[child]

    def _op(self, node: torch.fx.Node, target, args, kwargs, outputs: List[IRTensor]) -> IRFwOperation:
        """Appends an op (made by fx ``node``) with the given output tensors."""
        inputs = [a for a in _flatten((args, kwargs)) if isinstance(a, IRTensor)]
        # fake values do not track autograd: an output needs a gradient when a float input does,
        # unless torch never tracks the op's outputs (a gradient cube expects would never come)
        needs = self.grad_enabled and not op_info(op_name(target)).grad_free and any(t.requires_grad for t in inputs)
        for o in outputs:
            o.requires_grad = bool(needs and (o.dtype.is_floating_point or o.dtype.is_complex))
        op = IRFwOperation(name=op_name(target), inputs=inputs, outputs=outputs, target=target,
                           args=args, kwargs=kwargs, module_path=_module_path(node),
                           source=_source(node), grad_enabled=self.grad_enabled)
        self.registry.annotate(op)
        self.ops.append(op)
        return op

    def _folded(self, node: torch.fx.Node) -> None:
        """A node of a block mask built in forward (``flex.fold_masks``): its value; a tensor another op
        reads becomes a constant of the graph."""
        value = self.masks.folded[node]
        if isinstance(value, torch.Tensor) and any(u not in self.masks.folded for u in node.users):
            name = f"_flex_mask_{node.name}"
            t = IRTensor(tuple(value.shape), value.dtype, False, TensorKind.CONST, name, (name,))
            self.consts[name] = value.detach().clone()
            self.attrs.append(t)
            value = t
        self.env[node] = value

    def _flex(self, node: torch.fx.Node) -> None:
        """``flex_attention`` as one op (``cube.trace.flex``)."""
        try:
            xs, spec = flex.split(node, self.ep.graph_module)
        except flex.FlexRefused as e:
            raise ValueError(f"flex_attention at {_where(node)}: {e}") from None
        block = list(node.args[4])
        made = self.masks.made.get(tuple(x for x in block[2:-3] if isinstance(x, torch.fx.Node)))
        if made is not None and self.env.get(block[2]) is None:   # the block mask, made from the mask's buffers
            bufs, mask_spec = made
            kv = [x for x in block[2:6] if isinstance(x, torch.fx.Node)]
            outs = [_tensor_of(x.meta.get("val"), x.name) for x in kv]
            self._op(node, flex.block_mask_op(), [self._map(list(bufs)), json.dumps(mask_spec)], {}, outs)
            self.env.update(zip(kv, outs))
        val = node.meta.get("val")
        outputs = [_tensor_of(val[0], f"{node.name}_out"), _tensor_of(val[1], f"{node.name}_lse")]
        self._op(node, flex.op(), [self._map(list(xs)), json.dumps(spec)], {}, outputs)
        self.env[node] = tuple(outputs) + (None,) * (len(val) - 2)

    # ---------------------------------------------------- ops written as what they compute
    def _type_as(self, node: torch.fx.Node, args, kwargs, val):
        """``x.type_as(y)`` reads only y's dtype: a cast of x, or x itself."""
        x, other = args[0], args[1]
        low = node.meta.get(MARK)   # a cast to the low precision (``cube.trace.casts``)
        if low is not None:
            self.env[node] = self._op(node, torch.ops.aten._to_copy.default, [x], {"dtype": low},
                                      [_tensor_of(val, node.name)]).outputs[0]
        elif x.dtype == other.dtype:
            self.env[node] = x
            self._alias(node, node.args[0])
        else:
            self.env[node] = self._op(node, torch.ops.aten._to_copy.default, [x], {"dtype": other.dtype},
                                      [_tensor_of(val, node.name)]).outputs[0]
        return True, args

    def _new_like(self, node: torch.fx.Node, args, kwargs, val):
        """``x.new_zeros(size)`` and friends read only x's dtype and device: a creation, so a split x
        is not gathered for them."""
        if not isinstance(args[0], IRTensor):
            return False, args
        name = op_name(node.target)
        names = [a.name for a in node.target._schema.arguments]
        given = dict(zip(names, args), **kwargs)
        made = {"dtype": given.get("dtype") or args[0].dtype, "layout": given.get("layout"),
                "device": given.get("device") or node.args[0].meta.get("val").device,
                "pin_memory": given.get("pin_memory")}
        fn = getattr(getattr(torch.ops.aten, _NEW[name][0]), _NEW[name][1])
        pos = [given["size"]] + ([given["fill_value"]] if name == "new_full" else [])
        self.env[node] = self._op(node, fn, pos, {k: v for k, v in made.items() if v is not None},
                                  [_tensor_of(val, node.name)]).outputs[0]
        return True, args

    def _shape_of(self, node: torch.fx.Node, args, kwargs, val):
        """``x.expand_as(y)`` and ``x.reshape_as(y)`` read only y's shape: an ``expand`` (a ``reshape``) of x
        to it (a split y is not gathered for them, ``torch.arange(s).expand_as(positions)`` carries no batch
        of its own, LeViT's batch norm over rows reshapes back); a view of x where the trace's is."""
        if not isinstance(args[0], IRTensor) or not isinstance(args[1], IRTensor):
            return False, args
        self.env[node] = self._op(node, _SHAPE_OF[op_name(node.target)], [args[0], list(args[1].shape)], {},
                                  [_tensor_of(val, node.name)]).outputs[0]
        if inplace.is_view(node):
            self._alias(node, node.args[0], node)
        return True, args

    def _squeeze(self, node: torch.fx.Node, args, kwargs, val):
        """``x.squeeze()`` drops every dim of size 1, so on a piece of one sample (a micro-batch, a
        rank's block of the batch) it would drop the batch dim too (MBart's ``shift_tokens_right``):
        it becomes ``squeeze`` of the dims of size 1 in the trace, the same op on the traced shape (a
        symbolic dim, as the batch, is not one of them: torch's trace assumes it is not 1)."""
        if node.target is not torch.ops.aten.squeeze.default or not isinstance(args[0], IRTensor):
            return False, args
        traced = node.args[0].meta.get("val")   # a dim the trace holds as a symbol (the batch) is no 1
        if not isinstance(traced, torch.Tensor):
            return False, args
        dims = [d for d, s in enumerate(traced.shape) if isinstance(s, int) and s == 1]
        self.env[node] = self._op(node, torch.ops.aten.squeeze.dims, [args[0], dims], {},
                                  [_tensor_of(val, node.name)]).outputs[0]
        self._alias(node, node.args[0], node)
        return True, args

    def _shifted(self, node: torch.fx.Node, args, kwargs, val):
        """A constant pad of a slice along the padded dim, ``pad(x[:, 1:], (0, 0, 0, 1))`` (a token reads the
        one after it: MobileBERT's trigram input, Funnel's shifts), is one pad of ``x``, negative where the
        slice cut: ``pad(x, (0, 0, -1, 1))``, the same values. A slice of its own is a value shorter than
        ``x`` along that dim, whole under a split of it; the pad is a halo exchange (``rules.pad``)."""
        src = node.args[0]
        sizes = args[1] if len(args) > 1 else None
        mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
        if not (isinstance(src, torch.fx.Node) and src.target is torch.ops.aten.slice.Tensor and mode == "constant"
                and isinstance(sizes, (list, tuple)) and all(isinstance(v, int) for v in sizes)):
            return False, args
        base = src.args[0]
        shape = base.meta["val"].shape if isinstance(base, torch.fx.Node) and "val" in base.meta else None
        dim, start, end, step = (list(src.args[1:]) + [0, None, None, 1][len(src.args) - 1:])[:4]
        if shape is None or step != 1 or not all(isinstance(v, int) or v is None for v in (dim, start, end)):
            return False, args
        dim = dim % len(shape)
        size = shape[dim]
        if not isinstance(size, int):   # a symbolic dim (the batch): its size is no constant of the trace
            return False, args
        start, end = slice(start, end).indices(size)[:2]
        if start >= end:
            return False, args
        k = 2 * (len(shape) - 1 - dim)   # the pad list names the last dim first
        pads = list(sizes) + [0] * max(0, k + 2 - len(sizes))
        pads[k], pads[k + 1] = pads[k] - start, pads[k + 1] - (size - end)
        fn = torch.ops.aten.pad.default if op_name(node.target) == "pad" else torch.ops.aten.constant_pad_nd.default
        rest = list(args[2:])
        self.env[node] = self._op(node, fn, [self._map(base), pads] + rest, kwargs,
                                  [_tensor_of(val, node.name)]).outputs[0]
        return True, args

    def _cat(self, node: torch.fx.Node, args, kwargs, val):
        """``torch.cat`` skips 1-D empty tensors: a cache's first update (Hugging Face's DynamicCache,
        use_cache on, as models ship) concatenates onto one. They are dropped; with one tensor left,
        the cat is that tensor (a new value, not a view: a write into it must not reach the input)."""
        empty = [isinstance(a, torch.fx.Node) and _legacy_empty(a.meta.get("val")) for a in node.args[0]]
        if not any(empty):
            return False, args
        keep = [a for a, e in zip(node.args[0], empty) if not e]
        if not keep or not all(isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == val.dtype
                                for a in keep):
            return False, args
        if len(keep) == 1:
            self.env[node] = self._map(keep[0])
            return True, args
        return False, (self._map(keep),) + tuple(args[1:])

    def call(self, node: torch.fx.Node, grad_enabled: bool) -> None:
        target = node.target
        self.grad_enabled = grad_enabled
        if target is operator.getitem:
            src = node.args[0]
            self.env[node] = self._map(src)[node.args[1]]
            view = self.views.get(src)
            if view is not None and view.node is src:   # an item of a multi-output view
                self._alias(node, src, src, node.args[1])
            return
        target = _canonical(target)
        name = op_name(target)
        if name in _DROPPED:
            self.env[node] = None
            return
        if name in _IDENTITY or (name == "slice" and _whole_slice(node)):
            # a view of its input that changes nothing (an alias, x[:, :]): not an IR op
            self.env[node] = self._map(node.args[0])
            self._alias(node, node.args[0])
            return
        val = node.meta.get("val")
        if isinstance(val, _SYM) or (not isinstance(target, torch._ops.OpOverload)
                                     and isinstance(val, (int, float, bool)) and not isinstance(val, torch.Tensor)):
            # a size computed while tracing with a dynamic batch dim (sym_size, arithmetic on it):
            # the value it has in this trace; a number read from a tensor's data has none
            value = _hint(val)
            if value is None:
                raise data_dependent(node)
            self.env[node] = value
            return
        if name == "wrap_with_set_grad_enabled":
            enabled, sub, *operands = node.args
            sub_module = self.env[sub]
            self.env[node] = self.run(sub_module.graph, bool(enabled), list(operands))
            self.grad_enabled = grad_enabled
            return
        if name == "wrap_with_autocast" and len(node.args) >= 5 and not node.args[2]:
            # an autocast region torch turned off while tracing (CPU autocast to float32, which torch
            # does not have, warns and runs the region as written): its ops as they are
            sub, operands = node.args[4], list(node.args[5:])
            self.env[node] = self.run(self.env[sub].graph, grad_enabled, operands)
            self.grad_enabled = grad_enabled
            return
        if flex.is_flex(target):
            return self._flex(node)
        if not isinstance(target, torch._ops.OpOverload):
            raise TypeError(f"cube cannot handle the traced call {node.format_node()} "
                            f"(from {_source(node)}); only ATen and registered ops are supported")
        args, kwargs = self._map(node.args), self._map(node.kwargs)
        if name == "detach_" and isinstance(args[0], IRTensor) and not args[0].requires_grad:
            self.env[node] = args[0]   # changes nothing of a tensor that needs no gradient (a cache's empty start)
            self._alias(node, node.args[0])
            return
        if inplace.written(target) and self._functional(node, args, kwargs):
            return
        if name in _REWRITES:
            done, args = getattr(self, _REWRITES[name])(node, args, kwargs, val)
            if done:
                return
        if isinstance(val, (list, tuple)):
            outputs = [_tensor_of(v, f"{node.name}_{i}") for i, v in enumerate(val)]
            value = tuple(outputs)
        elif val is None:
            outputs, value = [], None
        else:
            outputs = [_tensor_of(val, node.name)]
            value = outputs[0]
        if node.meta.get(MARK) is not None:   # a cast to the low precision (``cube.trace.casts``)
            moved = retarget(target, args, kwargs, node.meta[MARK])
            target, (args, kwargs) = (target, moved) if moved is not None else \
                (torch.ops.aten._to_copy.default, ((args[0],), {"dtype": node.meta[MARK]}))
        self._op(node, target, args, kwargs, outputs)
        self.env[node] = value
        if inplace.is_view(node):
            self._alias(node, node.args[0], node)


def _canonical(target: Any) -> Any:
    """The op an ATen alias names (``aten.multiply.Tensor`` -> ``aten.mul.Tensor``, ``cube.ir.ops.ALIASES``),
    the same overload and arguments; any other target as it is."""
    schema = getattr(target, "_schema", None)
    name = schema.name.split("::")[-1] if schema is not None and schema.name.startswith("aten::") else None
    if name not in ALIASES:
        return target
    op = getattr(getattr(torch.ops.aten, ALIASES[name]), target._overloadname, None)
    same = op is not None and [a.name for a in op._schema.arguments] == [a.name for a in schema.arguments]
    return op if same else target


def _like(t: IRTensor, hint: str) -> IRTensor:
    return IRTensor(tuple(t.shape), t.dtype, False, TensorKind.ACTIVATION, hint)


def _where(node: torch.fx.Node) -> str:
    path, src = _module_path(node), _source(node)
    where = f"module {path!r}" if path else "the top-level module"
    return where + (f", {src[0]}:{src[1]}: {src[2]}" if src else "")


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
    """Turns an exported program into an ``IRGraph``, leading dims merged around row-wise ops
    (``cube.trace.rows``) and batched matmuls (``cube.trace.heads``) given back, and fused
    projections cut into one matmul per block (``cube.trace.fused``).

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
    name = type(model).__name__
    graph = IRGraph([data_op] + _live(b.ops, outs), b.attrs, loss, name=name)
    graph = unmerge_heads(unflatten_loss(unflatten_rows(graph, registry), registry), registry)
    # again: the experts' copies of token rows that unmerge_heads gave back as (E, N, ...) (cube.trace.major)
    graph = unflatten_rows(graph, registry)
    if config.fused_cut():
        graph = split_fused(graph, registry, b.consts)
    graph = unmerge(graph, registry)
    ops = _live([op for op in graph.ops if op is not data_op], outs)   # again: what the passes left unread
    read = {id(t) for op in ops for t in op.inputs}
    attrs = [t for t in graph.attrs if t.kind is not TensorKind.CONST or id(t) in read]
    used = {n for t in attrs for n in t.names}
    return IRGraph([data_op] + ops, attrs, loss, name=name), {k: v for k, v in b.consts.items() if k in used}


def _live(ops: List[IRFwOperation], outs: list) -> List[IRFwOperation]:
    """``ops`` without those whose values nothing reads (dead code a model's forward leaves: the
    empty tensor a key/value cache starts from, a mask built and not used), keeping ops with effects."""
    needed = {id(t) for t in _flatten(outs) if isinstance(t, IRTensor)}
    keep = []
    for op in reversed(ops):
        if inplace.effect(op) or any(id(t) in needed for t in op.outputs):
            keep.append(op)
            needed.update(id(t) for t in op.inputs)
    return keep[::-1]
