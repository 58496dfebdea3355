"""PASContext: context parallel (the sequence split over devices), with data and tensor parallel.

Every activation is split along its token dim over ``cp`` devices: norms, MLPs and projections
work on their block of tokens, and attention runs as ring attention (``cube.runtime.ring``: key
and value blocks passed around the ``cp`` ranks, load-balanced under a causal mask), so no rank
holds a whole sequence's activations; ``flex_attention`` gathers one layer's keys and values
inside its call (``cube.runtime.flex``). A recurrence along the sequence (a state-space mixer, a
delta rule, a causal conv) runs split by heads or channels between two all-to-all exchanges, as
Megatron-LM's context parallel for state-space layers does (``cube.ir.heads``; tensor parallel
splits each rank's heads further). ``tp > 1`` also splits heads and linears Megatron-style inside
each context-parallel rank; the
remaining ``ngpus // (cp * tp)`` devices are data parallel. The devices form a ``("dp", "cp",
"tp")`` mesh, tensor parallel innermost.
"""
from typing import Optional

from cube.ir import IRGraph
from cube.ir.experts import fuse_local
from cube.mesh import DeviceMesh
from cube.toolkit import apply_recompute, context_parallel, data_parallel, place_all, tensor_parallel


def PASContext(graph: IRGraph, resource, cp: Optional[int] = None, tp: int = 1, recompute=False) -> IRGraph:
    """Splits ``graph`` along the sequence over ``cp`` devices (module docstring).

    Args:
        cp: context-parallel degree (default: every device not used by ``tp``).
        tp: tensor-parallel degree.
        recompute: blocks to recompute (``cube.toolkit.apply_recompute``).

    Raises:
        ValueError: ``cp * tp`` does not divide the device count.
    """
    cp = cp or resource.ngpus // tp
    if cp < 1 or tp < 1 or resource.ngpus % (cp * tp):
        raise ValueError(f"PASContext: {resource.ngpus} devices do not split into context parallel cp={cp} x "
                         f"tensor parallel tp={tp} groups; pass cp= and tp= whose product divides the device "
                         f"count (the data parallel degree is devices / (cp * tp))")
    mesh = DeviceMesh(("dp", resource.ngpus // (cp * tp)), ("cp", cp), ("tp", tp))
    fuse_local(graph, mesh["dp"].size * cp)   # MoE layers: one op each, run on each rank's tokens (cube.ir.experts)
    place_all(graph, mesh, dp=data_parallel(graph, mesh["dp"]),
              cp=context_parallel(graph, mesh["cp"], tp=mesh["tp"]), tp=tensor_parallel(graph, mesh["tp"]))
    apply_recompute(graph, recompute)
    return graph
