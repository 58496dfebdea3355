"""Tracing a stack of identical blocks once: export a short stack, repeat its middle block.

``torch.export`` costs about 1.5 ms per graph node on a CPU core, so a 640-block
GPT (23k nodes) takes over half a minute to trace, nearly all of it re-tracing
the same block. When the model holds a ``ModuleList``/``Sequential`` of at
least ``MIN_BLOCKS`` blocks that look alike (same class, same parameter and
buffer shapes, same settings), cube exports the model with that list cut to
three blocks (the first, the second and the last) and builds the full graph by
repeating the second block's nodes, renamed for blocks 1 .. n-2, between them.

A block's nodes may read the nodes of earlier blocks (its input, or a skip
connection) and anything made before the stack (a mask, positions). The
repetition assumes that block ``b`` reads block ``b - d`` wherever the template
block reads the block ``d`` before it. That is checked, not trusted: the same
cut is exported with four blocks, and the three-block program repeated to four
blocks must equal it node for node (targets, arguments, shapes, module paths,
parameters). A block whose code depends on its position (``if i % 2``), or a
forward that uses the list's length, fails that check and the whole model is
exported as before. A stack with hooks, lifted constants, sub-graphs or buffer
updates inside it is never cut.

``CUBE_TRACE_REPEAT=0`` turns this off.
"""
from __future__ import annotations

import copy
import logging
import re
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.fx
import torch.nn as nn

from cube import config

log = logging.getLogger("cube")

MIN_BLOCKS = 8   # shorter stacks export fast enough whole
_PRIMITIVE = (int, float, bool, str, type(None), torch.dtype, torch.device)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks")


class _NoRepeat(Exception):
    """The short program cannot be repeated into the full one; the message says why."""


def enabled() -> bool:
    """Whether long stacks are exported once and repeated (``CUBE_TRACE_REPEAT``, see ``cube.config``)."""
    return config.trace_repeat()


# ------------------------------------------------------------------ finding the stack

def find_stack(model: nn.Module) -> Optional[Tuple[str, nn.Module]]:
    """The longest ``ModuleList``/``Sequential`` (not the model itself) of at least ``MIN_BLOCKS``
    blocks that look alike, as (path, module); None if there is none."""
    best = None
    for path, mod in model.named_modules():
        if not path or not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < MIN_BLOCKS:
            continue
        if best is None or len(mod) > len(best[1]):
            if _alike(list(mod)):
                best = (path, mod)
    return best


def _alike(blocks: List[nn.Module]) -> bool:
    """Whether the blocks trace alike: per submodule the same class, parameter and buffer shapes
    and plain settings, except settings that hold each block's index (as ``layer_idx`` does)."""
    described = [_describe(b) for b in blocks]
    if any(d is None for d in described):
        return False
    structure = [(tuple(k for k, _ in d)) for d in described]
    if any(s != structure[0] for s in structure):
        return False
    for j in range(len(structure[0])):
        values = [d[j][1] for d in described]
        if any(v != values[0] for v in values) and values != list(range(len(blocks))):
            return False
    return True


def _describe(block: nn.Module) -> Optional[List[tuple]]:
    """(key, value) per thing tracing may depend on besides the code; None for a block with hooks
    or an unregistered tensor attribute."""
    out = []
    for name, m in block.named_modules():
        if any(getattr(m, h, None) for h in _HOOKS):
            return None
        out.append(((name, type(m).__qualname__), None))
        for n, t in list(m._parameters.items()) + list(m._buffers.items()):
            if t is not None:
                out.append(((name, n, tuple(t.shape), t.dtype, t.requires_grad), None))
        for k, v in sorted(vars(m).items()):
            if k.startswith("_") or k == "training":
                continue
            if isinstance(v, torch.Tensor):
                return None   # an unregistered tensor: its value could matter
            if isinstance(v, _PRIMITIVE) or (isinstance(v, tuple) and all(isinstance(x, _PRIMITIVE) for x in v)):
                out.append(((name, k), v))
            else:
                out.append(((name, k), id(v)))   # other objects (a config) only when shared
    return out


# ------------------------------------------------------------------ exporting a short stack

def _export_cut(model: nn.Module, path: str, stack: nn.Module, keep: List[int], export: Callable):
    """Exports ``model`` with the list at ``path`` holding only blocks ``keep`` (renumbered 0..)."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    short = copy.copy(stack)
    short._modules = OrderedDict((str(i), stack[k]) for i, k in enumerate(keep))
    parent._modules[attr] = short
    try:
        return export()
    finally:
        parent._modules[attr] = stack


def export_repeated(model: nn.Module, export: Callable[[], Any]) -> Optional[Any]:
    """The program of ``model`` built from a three-block export (see the module's docstring), or
    None when the model has no stack to cut or the cut does not repeat (then export it whole).

    ``export``: exports ``model`` as it is at the time of the call.
    """
    if not enabled():
        return None
    found = find_stack(model)
    if found is None:
        return None
    path, stack = found
    n = len(stack)
    try:
        three = _export_cut(model, path, stack, [0, 1, n - 1], export)
        four = _export_cut(model, path, stack, [0, 1, 2, n - 1], export)
        _check_same(_repeat(three, path, 4), four)
        program = _repeat(three, path, n)
    except Exception as e:   # _NoRepeat, or the cut model did not export: the whole export decides
        log.info("cube: trace: %s (%d blocks) not repeated (%s); exporting the whole model", path, n, e)
        return None
    log.info("cube: trace: exported 3 of the %d blocks of %s and repeated the middle one", n, path)
    return program


# ------------------------------------------------------------------ repeating

_INDEX = re.compile(r"^(\d+)(\.|$)")


def _block_of_path(path: str, prefix: str) -> Optional[int]:
    if not path.startswith(prefix):
        return None
    m = _INDEX.match(path[len(prefix):])
    return int(m.group(1)) if m else None


def _node_block(node: torch.fx.Node, prefix: str) -> Optional[int]:
    """The block of the stack a call node was made in (None outside the stack)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        b = _block_of_path(path, prefix)
        if b is not None:
            return b
    return None


def _rename_path(path: str, prefix: str, old: int, new: int) -> str:
    if _block_of_path(path, prefix) == old:
        return f"{prefix}{new}{path[len(prefix) + len(str(old)):]}"
    return path


class _Program(SimpleNamespace):
    """What ``cube.trace.build_graph`` reads of an ``ExportedProgram``: ``graph``,
    ``graph_signature`` (``input_specs``, ``output_specs``), ``constants``, ``graph_module``
    and ``call_spec``."""


def _repeat(ep, path: str, n: int) -> _Program:
    """``ep`` (a three-block export of the stack at ``path``) repeated to ``n`` blocks."""
    prefix = path + "."
    nodes = list(ep.graph.nodes)
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
    if any(s.kind.name != "USER_OUTPUT" for s in ep.graph_signature.output_specs):
        raise _NoRepeat("the forward updates buffers")

    # template block of every node: placeholders by their target, calls by their module path
    block: Dict[torch.fx.Node, Union[int, str, None]] = {}   # template block, "post" after the last, None outside
    segments: List[List[torch.fx.Node]] = [[], [], []]
    pre, post = [], []
    current = None
    for node in nodes:
        if node.op == "placeholder":
            s = specs[node.name]
            block[node] = _block_of_path(s.target or "", prefix) if s.kind.name in ("PARAMETER", "BUFFER") else None
            continue
        if node.op == "output":
            continue
        b = _node_block(node, prefix)
        if b is not None:
            if current is not None and b < current:
                raise _NoRepeat(f"blocks run out of order at {node.name}")
            current = b
        if node.op != "call_function":
            if current is not None or b is not None:
                raise _NoRepeat(f"{node.op} node {node.name} inside the stack")
        if current is None:
            pre.append(node)
            block[node] = None
        elif current == 2 and b is None:
            post.append(node)      # after the last block: reads it as the block before the end
            block[node] = "post"
        else:
            segments[current].append(node)
            block[node] = current
    if any(not seg for seg in segments):
        raise _NoRepeat("a block made no nodes")
    if [n_.target for n_ in segments[0]] != [n_.target for n_ in segments[1]]:
        raise _NoRepeat("the first two blocks differ")
    for node in nodes:
        if node.op == "placeholder" and block[node] is None and specs[node.name].kind.name != "USER_INPUT":
            if any(block.get(u) in (0, 1, 2) for u in node.users):
                raise _NoRepeat(f"the stack reads the lifted constant {specs[node.name].target}")
    pos = {node: i for seg in segments for i, node in enumerate(seg)}

    graph = torch.fx.Graph()
    shared: Dict[torch.fx.Node, torch.fx.Node] = {}       # placeholders and nodes outside the stack
    params: Dict[Tuple[int, str], torch.fx.Node] = {}     # (real block, template placeholder name)
    copies: Dict[int, List[torch.fx.Node]] = {}           # real block -> its nodes by position
    input_specs = []

    def template_of(real: int) -> int:
        return 0 if real == 0 else 2 if real == n - 1 else 1

    def placeholder(node, real: Optional[int]):
        s = specs[node.name]
        target = s.target if real is None else _rename_path(s.target, prefix, block[node], real)
        name = node.name if real is None else ("p_" if s.kind.name == "PARAMETER" else "b_") + target.replace(".", "_")
        new = graph.placeholder(name)
        new.meta = copy.copy(node.meta)
        input_specs.append(SimpleNamespace(kind=s.kind, arg=SimpleNamespace(name=new.name), target=target,
                                           persistent=getattr(s, "persistent", None)))
        return new

    # placeholders: each group (kind, template block) of the stack is written out for its real blocks
    done = set()
    for node in nodes:
        if node.op != "placeholder":
            continue
        t = block[node]
        if t is None:
            shared[node] = placeholder(node, None)
            continue
        kind = specs[node.name].kind.name
        if (kind, t) in done:
            continue
        done.add((kind, t))
        group = [p for p in nodes if p.op == "placeholder" and block[p] == t and specs[p.name].kind.name == kind]
        reals = [0] if t == 0 else [n - 1] if t == 2 else range(1, n - 1)
        for real in reals:
            for p in group:
                params[(real, p.name)] = placeholder(p, real)

    def lookup(a: torch.fx.Node, template: int, real: int) -> torch.fx.Node:
        t = block.get(a)
        if t is None:
            return shared[a]
        if t == "post":
            raise _NoRepeat(f"{a.name} is read before it is made")
        other = real - (template - t)   # block b reads block b - d where the template reads d back
        if other < 0 or (other == n - 1) != (t == 2):
            raise _NoRepeat(f"{a.name} of block {t} is read from block {template} across the cut")
        if a.op == "placeholder":
            if (other, a.name) not in params:
                raise _NoRepeat(f"block {template} reads the parameter {specs[a.name].target} of another block")
            return params[(other, a.name)]
        made = copies.get(other)
        if made is None or pos[a] >= len(made):
            raise _NoRepeat(f"{a.name} is read before its block is made")
        return made[pos[a]]

    def emit(node: torch.fx.Node, template: int, real: int, out: List[torch.fx.Node]) -> None:
        new = graph.node_copy(node, lambda a: lookup(a, template, real))
        if template != real:
            stack = node.meta.get("nn_module_stack") or {}
            new.meta["nn_module_stack"] = {_rename_path(k, "L__self__" + prefix, template, real):
                                           (_rename_path(p, prefix, template, real), cls)
                                           for k, (p, cls) in stack.items()}
        out.append(new)

    for node in pre:
        shared[node] = graph.node_copy(node, lambda a: lookup(a, 0, 0))
    for real in range(n):
        t = template_of(real)
        copies[real] = []
        for node in segments[t]:
            emit(node, t, real, copies[real])
    for node in post:
        made: List[torch.fx.Node] = []
        emit(node, 2, n - 1, made)
        shared[node] = made[0]
        block[node] = None
    out = next(node for node in nodes if node.op == "output")
    graph.node_copy(out, lambda a: lookup(a, 2, n - 1))
    return _Program(graph=graph, constants=ep.constants, graph_module=ep.graph_module,
                    call_spec=getattr(ep, "call_spec", None),
                    graph_signature=SimpleNamespace(input_specs=input_specs,
                                                    output_specs=list(ep.graph_signature.output_specs)))


# ------------------------------------------------------------------ the check

def _check_same(made: _Program, real) -> None:
    """Raises ``_NoRepeat`` unless ``made`` and ``real`` are the same program up to node names."""
    a, b = list(made.graph.nodes), list(real.graph.nodes)
    if len(a) != len(b):
        raise _NoRepeat(f"repeating gives {len(a)} nodes where a four-block export has {len(b)}")
    index_a = {n: i for i, n in enumerate(a)}
    index_b = {n: i for i, n in enumerate(b)}
    specs_a = {s.arg.name: s for s in made.graph_signature.input_specs}
    specs_b = {s.arg.name: s for s in real.graph_signature.input_specs}

    def norm(x, index):
        if isinstance(x, torch.fx.Node):
            return ("node", index[x])
        if isinstance(x, (list, tuple)):
            return tuple(norm(y, index) for y in x)
        if isinstance(x, dict):
            return tuple((k, norm(v, index)) for k, v in x.items())
        return x

    def shape(val):
        if isinstance(val, torch.Tensor):
            return tuple(val.shape), val.dtype
        if isinstance(val, (list, tuple)):
            return tuple(shape(v) for v in val)
        return None

    def paths(node):
        return tuple(p for p, _ in (node.meta.get("nn_module_stack") or {}).values())

    for x, y in zip(a, b):
        same = (x.op == y.op and x.target == y.target and norm(x.args, index_a) == norm(y.args, index_b)
                and norm(x.kwargs, index_a) == norm(y.kwargs, index_b)
                and shape(x.meta.get("val")) == shape(y.meta.get("val")) and paths(x) == paths(y))
        if same and x.op == "placeholder":
            sx, sy = specs_a[x.name], specs_b[y.name]
            same = sx.kind == sy.kind and sx.target == sy.target
        if not same:
            raise _NoRepeat(f"block 2 differs from block 1 at {y.format_node()}")
