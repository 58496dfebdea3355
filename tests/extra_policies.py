"""Test policies that place ops in two device groups, so values cross between them.

The split is by op count, not balanced; staging and schedules are a later feature.
"""
from cube.ir import IRDataOperation


def PASTwoStages(graph, resource):
    """The first half of the ops on device 0, the rest on device 1 (the batch on both)."""
    ops = graph.nodes()
    fw = [op for op in ops if not isinstance(op, IRDataOperation)]
    cut = len(fw) // 2
    for op in ops:
        if isinstance(op, IRDataOperation):
            for dev, piece in enumerate(graph.replicate(op, times=resource.ngpus)):
                graph.assign(piece, dev)
        else:
            graph.assign(op, 0 if fw.index(op) < cut else 1)
    return graph


def PASTwoStagesData(graph, resource):
    """Two stages, each data parallel over half the devices."""
    from cube.ir.follow import batch_flow, place
    half = resource.ngpus // 2
    ops = graph.nodes()
    fw = [op for op in ops if not isinstance(op, IRDataOperation)]
    cut = len(fw) // 2
    flow = batch_flow(graph, half)
    for op in ops:
        if isinstance(op, IRDataOperation):
            for dev, piece in enumerate(graph.replicate(op, times=2)):
                place(graph, piece, (0, 0), [dev * half + i for i in range(half)])
        else:
            stage = 0 if fw.index(op) < cut else 1
            place(graph, op, flow.split_of(op), [stage * half + i for i in range(half)])
    return graph


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


def _pipeline(graph, resource, schedule, nstages, nmicros=4, tensor=False):
    """``nstages`` stages of about equal op count (graph.staging), each data parallel (or
    Megatron tensor parallel) over ``ngpus // nstages`` devices, then ``schedule``."""
    from cube import schedule as sched
    from cube.ir import IRFwOperation
    from cube.ir.follow import batch_flow, megatron_flow, place
    dp = resource.ngpus // nstages
    fw = graph.select(ntype=IRFwOperation)
    stages = graph.staging([fw[k * len(fw) // nstages] for k in range(nstages)])
    flow = megatron_flow(graph, dp) if tensor else batch_flow(graph, dp)
    for node in graph.select(ntype=IRDataOperation):
        for k, piece in enumerate(graph.replicate(node, times=nstages)):
            place(graph, piece, None if tensor else (0, 0), [k * dp + i for i in range(dp)])
    for k, stage in enumerate(stages):
        for op in stage:
            place(graph, op, flow.split_of(op), [k * dp + i for i in range(dp)])
    getattr(sched, schedule)(graph, nmicros, nstages)
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
