"""PASMegatronTP: tensor parallelism found from the graph's structure.

A linear whose input is whole is split by output features (column) when the
split can travel, through activations, head reshapes and attention, to an op
that sums it away: the row-split linear after it (MLP pairs, attention output
projection) or a reduction. Attention is then split by heads. Everything else
(norms, embeddings, the LM head and loss) runs whole on every device. No
module names are used, so it plans the shipped GPT, HF GPT-2 and HF Llama alike.
"""
from cube.ir import IRGraph
from cube.ir.blocks import recompute_blocks
from cube.ir.follow import megatron_flow, place


def PASMegatronTP(graph: IRGraph, resource) -> IRGraph:
    devices = list(range(resource.ngpus))
    flow = megatron_flow(graph, resource.ngpus)
    for node in graph.nodes():
        place(graph, node, flow.split_of(node), devices)
    recompute_blocks(graph)   # CUBE_RECOMPUTE
    return graph
