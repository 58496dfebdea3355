"""Which matrix products of a ``precision="fp8"`` plan run in float8, and which ranks scale together.

``precision="fp8"`` is the ``"bf16"`` recipe (bf16 weights, float32 main parameters; see
``cube.passes.precision``) with the linear layers' matrix products in float8, as torchao's float8
training converts ``nn.Linear`` modules (``cube.runtime.float8``). cube's traced program has no
modules, so the choice is made on the ops: an ``aten.linear`` whose weight is a trainable
parameter with both dims divisible by 16 (torchtitan's filter; the others stay bf16). Other
matrix products (attention's, a product with an activation) stay bf16, as torchao leaves them.

Scales are per tensor. One process scales a linear's whole input, weight and output gradient; a
plan that splits them must take the maximum over the pieces. ``mark_amax_ranks`` gives each float8
piece the ranks running pieces of the same op on the same rows of the input's dim 0: tensor
parallel pieces (a split weight, an input split along features, the gradient of a split output),
a sequence split. The pieces of a split of dim 0, the batch, are scaled alone, as data-parallel
ranks and micro-batches are under torchao (each batch piece its own scales).
"""
from __future__ import annotations

import math
from typing import Dict, List, Set

from cube.ir.graph import IRGraph
from cube.ir.layout import box_shape
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor, TensorKind
from cube.runtime.float8 import ALIGN


def is_float8(precision) -> bool:
    """Whether ``precision`` runs linear layers in float8."""
    return precision == "fp8"


def float8_linear(op: IRFwOperation) -> bool:
    """Whether the (logical) op is a linear layer the fp8 recipe converts: ``aten.linear`` on a
    trainable floating weight of shape ``(out, in)``, both divisible by 16."""
    if op.name != "linear" or len(op.args) < 2:
        return False
    w = op.args[1]
    if not isinstance(w, IRTensor):
        return False
    w = w.logical
    return (w.kind is TensorKind.PARAM and w.requires_grad and w.dtype.is_floating_point and w.ndim == 2
            and all(d % ALIGN == 0 for d in w.shape))


def float8_ops(graph: IRGraph) -> Set[int]:
    """Ids of the logical ops (``op.root``) that run in float8; empty unless the graph's precision is fp8."""
    if not is_float8(getattr(graph, "precision", None)):
        return set()
    return {id(op.root) for op in graph.select(ntype=IRFwOperation) if float8_linear(op.root)}


def mark_amax_ranks(graph: IRGraph, plans: Dict, cuda: bool = False) -> None:
    """Sets ``call.amax_ranks`` of every float8 piece in ``plans`` (rank -> ``RankPlan``): the ranks
    holding pieces of the same op on the same rows of the input's dim 0, when they hold different
    pieces (left empty where they are replicas, whose amaxes are equal).

    Raises:
        ValueError: ``cuda`` and a piece's weight has a dim, or its input a number of rows (all
            dims but the last), not divisible by 16 (CUDA's float8 products refuse them).
    """
    chosen = float8_ops(graph)
    if not chosen:
        return
    rows: Dict[tuple, List[int]] = {}
    found = []
    for r, plan in plans.items():
        for call in plan.calls:
            op = call.op
            if op is None or id(op.root) not in chosen or call.layout is None:
                continue
            x_box = call.layout.inputs[0]   # a 1-d input has no batch rows: all its pieces scale together
            x_rows = x_box[0] if len(x_box) > 1 else None
            boxes = (tuple(call.layout.inputs[:2]), tuple(call.layout.outputs))
            rows.setdefault((id(op.root), x_rows), []).append((r, boxes))
            found.append((call, (id(op.root), x_rows)))
            if cuda:
                w, x = box_shape(call.layout.inputs[1]), box_shape(x_box)
                rows_n = math.prod(x[:-1])
                if any(d % ALIGN for d in w) or rows_n % ALIGN:
                    raise ValueError(f"precision='fp8': op 'linear' ({op.root.where()}) has a weight piece of shape "
                                     f"{tuple(w)} and an input piece of {rows_n} rows on rank {r}; CUDA's float8 "
                                     f"products need every one divisible by 16 (the weight gradient's product "
                                     f"runs over the rows). Split this linear into fewer pieces, give it a batch "
                                     f"x sequence divisible by 16, or use precision='bf16'")
    for call, key in found:
        if len({boxes for _, boxes in rows[key]}) > 1:   # replicas alone hold equal amaxes: no sum
            call.amax_ranks = tuple(sorted({r for r, _ in rows[key]}))
