"""PASMegatronTP: tensor parallelism found from the graph's structure.

A linear whose input is whole is split by output features (column) when the
split can travel, through activations, head reshapes and attention, to an op
that sums it away: the row-split linear after it (MLP pairs, attention output
projection) or a reduction. Attention is then split by heads. Everything else
(norms, embeddings, the LM head and loss) runs whole on every device. No
module names are used, so it plans the shipped GPT, HF GPT-2 and HF Llama alike.
A linear whose split stops at an op without a usable rule (a KV-cache ``cat``),
and a model with no pair at all (a convolutional one), are reported by compile
(``cube.ir.lost``) and refused under ``strict=True``.
"""
from cube.ir import IRGraph
from cube.mesh import DeviceMesh
from cube.toolkit import Recompute, apply_recompute, place_all, tensor_parallel


def PASMegatronTP(graph: IRGraph, resource, recompute: Recompute = None) -> IRGraph:
    """Tensor parallel over every device (module docstring).

    Args:
        recompute: blocks to recompute (``cube.toolkit.apply_recompute``; default ``CUBE_RECOMPUTE``).
    """
    mesh = DeviceMesh(("tp", resource.ngpus))
    place_all(graph, mesh, tp=tensor_parallel(graph, mesh["tp"]))
    apply_recompute(graph, recompute)
    return graph
