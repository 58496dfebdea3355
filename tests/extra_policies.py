"""Test policies: values crossing device groups, pipelines with data or tensor parallel
stages, and a value that changes its split dim. Stages are cut by op count, not balanced."""
from cube.ir import IRDataOperation


def PASTwoStages(graph, resource):
    """The first half of the ops on the first half of the devices, the rest on the others;
    each half data parallel (one device each on two)."""
    return _pipeline(graph, resource, None, 2)


def PASSwap(graph, resource):
    """The MLP's linears split by batch, the loss's square split by features: the value between
    them changes its split dim (all-to-all); the loss sum is a partial sum (all-reduce)."""
    from cube.ir.follow import place
    devices = list(range(resource.ngpus))
    for op in graph.nodes():
        if isinstance(op, IRDataOperation) or op.name == "linear":
            place(graph, op, (0, 0), devices)
        elif op.name in ("mul", "sum"):
            place(graph, op, (0, 1), devices)
        else:
            place(graph, op, None, devices)
    return graph


def _pipeline(graph, resource, schedule, nstages, nmicros=4, tensor=False, nvirtual=1):
    """``nstages * nvirtual`` stages of about equal op count (graph.staging), stage ``k`` on
    pipeline rank ``k % nstages``, each data parallel (or Megatron tensor parallel) over
    ``ngpus // nstages`` devices, then ``schedule`` (None: one batch per step, values still
    sent between the stages)."""
    from cube import schedule as sched
    from cube.ir import IRFwOperation
    from cube.ir.follow import batch_flow, place
    from cube.ir.megatron import megatron_flow
    dp = resource.ngpus // nstages
    fw = graph.select(ntype=IRFwOperation)
    n = nstages * nvirtual
    stages = graph.staging([fw[k * len(fw) // n] for k in range(n)])
    flow = megatron_flow(graph, dp) if tensor else batch_flow(graph, dp)
    for node in graph.select(ntype=IRDataOperation):
        for k, piece in enumerate(graph.replicate(node, times=nstages) if nstages > 1 else [node]):
            place(graph, piece, None if tensor else (0, 0), [k * dp + i for i in range(dp)])
    for k, stage in enumerate(stages):
        for op in stage:
            place(graph, op, flow.split_of(op), [k % nstages * dp + i for i in range(dp)])
    if schedule is not None:
        getattr(sched, schedule)(graph, nmicros, *((nstages, nvirtual) if nvirtual > 1 else (nstages,)))
    return graph


def PAS1F1B(graph, resource):
    """1F1B over every device, one stage each."""
    return _pipeline(graph, resource, "sched_1f1b", resource.ngpus)


def PASGPipe(graph, resource):
    """GPipe over every device, one stage each."""
    return _pipeline(graph, resource, "sched_gpipe", resource.ngpus)


def PAS1F1BData(graph, resource):
    """1F1B over two stages, each data parallel over half the devices."""
    return _pipeline(graph, resource, "sched_1f1b", 2)


def PAS1F1BTensor(graph, resource):
    """1F1B over two stages, each Megatron tensor parallel over half the devices."""
    return _pipeline(graph, resource, "sched_1f1b", 2, tensor=True)


def PAS1F1BInterleaved(graph, resource):
    """Interleaved 1F1B, two stages per device cut by op count: the cuts fall inside transformer
    blocks, so a device's stages also hand each other values (the residual stream) directly, and
    a block recomputed (CUBE_RECOMPUTE) may have ops in two stages of a device."""
    from cube.ir.blocks import recompute_blocks
    _pipeline(graph, resource, "sched_1f1b_interleaved", resource.ngpus, nvirtual=2)
    recompute_blocks(graph)
    return graph


def PAS1F1BInterleavedData(graph, resource):
    """Interleaved 1F1B over two pipeline ranks of two stages each, every stage data parallel
    over half the devices."""
    return _pipeline(graph, resource, "sched_1f1b_interleaved", 2, nvirtual=2)
