"""Repeated blocks of a model (transformer layers) and activation recompute over them.

A block is the set of forward ops whose module path starts with one child of
a repeated container: ``layers.0`` in ``layers.0.attn.q_proj``, ``h.3`` in
``transformer.h.3.mlp``, ``blocks.1`` in a ViT. A policy recomputes them with

    for block in blocks(graph):
        graph.recompute(block)

or, leaving ops that cannot run twice out (see :func:`rerun_hazard`),
``recompute_blocks(graph, "all")``. The shipped policies call
``recompute_blocks(graph)``, which follows ``CUBE_RECOMPUTE``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Union

from cube import config
from cube.ir.ops import op_info
from cube.ir.operator import IRFwOperation

if TYPE_CHECKING:
    from cube.ir.graph import IRGraph



def block_of(module_path: str) -> Optional[str]:
    """The block an op of ``module_path`` belongs to: the path up to its first numeric part.

    ``"model.layers.3.mlp.c_fc"`` -> ``"model.layers.3"``; ``"ln_f"`` -> None.
    """
    parts = module_path.split(".") if module_path else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return None


def blocks(graph: "IRGraph") -> List[List[IRFwOperation]]:
    """The forward ops (pieces included) of each repeated block, blocks in program order.

    A container counts when at least two of its children call ops, so a lone
    ``Sequential`` wrapper is not taken for a stack of layers.

    Returns:
        One list of ops per block, each in program order; ``[]`` if the model has none.
    """
    found: Dict[str, List[IRFwOperation]] = {}
    for op in graph.ops:
        if isinstance(op, IRFwOperation):
            b = block_of(op.module_path)
            if b is not None:
                found.setdefault(b, []).append(op)
    children: Dict[str, int] = {}
    for b in found:
        container = b.rpartition(".")[0]
        children[container] = children.get(container, 0) + 1
    return [ops for b, ops in found.items() if children[b.rpartition(".")[0]] >= 2]


def rerun_hazard(op: IRFwOperation) -> str:
    """Why ``op`` must not run twice (forward, then again in backward), or ``""`` if it may.

    An op that writes into a tensor in place (``add_`` on a counter buffer) or
    updates running statistics (batch norm in training mode) would apply its
    update twice.
    """
    schema = getattr(op.target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return "it writes into a tensor in place"
    flag = op_info(op.name).running_stats   # its schema does not say it writes them
    if flag is not None and schema is not None:
        names = [a.name for a in schema.arguments]
        i = names.index(flag)
        value = op.args[i] if i < len(op.args) else op.kwargs.get(flag, False)
        if value:
            return "it updates running statistics in training mode"
    return ""


def recompute_blocks(graph: "IRGraph", which: Union[None, str, Sequence[int]] = None,
                     source: Optional[str] = None) -> List[List[IRFwOperation]]:
    """Marks blocks as recompute groups, one group per block.

    Ops that must not run twice (:func:`rerun_hazard`) are left out of their
    block's group: they run once, and the block is recomputed around them.

    Args:
        graph: the graph, before or after partitioning (pieces of a block's ops
            join its group; call it before ``graph.staging`` or after, alike).
        which: ``"all"``, block indices (``blocks(graph)`` order, e.g. layer
            numbers), or None: what ``CUBE_RECOMPUTE`` says (unset: nothing).
        source: how the caller names the request in errors (e.g. a policy's ``recompute=`` option).

    Returns:
        The groups marked.

    Raises:
        ValueError: blocks were asked for but the model has none, or an index is
            out of range.
    """
    if which is None:
        which = config.recompute()
        source = f"CUBE_RECOMPUTE={config.recompute_text()}"
        fix = "unset CUBE_RECOMPUTE"
    else:
        source = source or f"recompute_blocks(graph, {which!r})"
        fix = "do not ask for recompute"
    if which is None:
        return []
    found = blocks(graph)
    if not found:
        raise ValueError(f"{source}: {graph.name} has no repeated blocks (ops under children of a ModuleList or "
                         f"Sequential such as layers.0, h.3); {fix}, or mark ops with "
                         f"graph.recompute(ops) in a policy")
    if which == "all":
        chosen = found
    else:
        bad = [i for i in which if not 0 <= i < len(found)]
        if bad:
            raise ValueError(f"{source}: block indices {bad} are out of range; {graph.name} has {len(found)} "
                             f"blocks (0..{len(found) - 1})")
        chosen = [found[i] for i in sorted(set(which))]
    groups = []
    for ops in chosen:
        safe = [op for op in ops if not rerun_hazard(op)]
        if safe:
            graph.recompute(safe)
            groups.append(safe)
    return groups
