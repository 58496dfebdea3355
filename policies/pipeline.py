"""PAS1F1B / PASGPipe: pipeline parallel, one stage per device, stages balanced by op cost.

The forward ops are cut into ``ngpus`` stages of about equal estimated cost
(multiply-adds of matmul-like ops, elements written by the others); each
stage runs on its own device and a step takes ``CUBE_MICROS`` micro-batches
(default 4) through the schedule. The batch tensors reach every stage.
"""
from cube import config, schedule
from cube.ir import IRDataOperation, IRFwOperation, IRGraph

_MATMUL = ("linear", "addmm", "matmul", "mm", "bmm", "scaled_dot_product_attention", "conv1d", "conv2d")


def cost(op: IRFwOperation) -> int:
    """A rough forward cost: multiply-adds for matmul-like ops, else elements written."""
    out = sum(t.numel() for t in op.outputs)
    if op.name in _MATMUL and op.inputs:
        return out * max(op.inputs[0].shape[-1] if op.inputs[0].ndim else 1, 1)
    return out


def balanced_starts(graph: IRGraph, nstages: int) -> list:
    """The first op of each of ``nstages`` stages of about equal cost (prefix sums)."""
    fw = graph.select(ntype=IRFwOperation)
    if nstages > len(fw):
        raise ValueError(f"{nstages} stages for {len(fw)} ops: use at most {len(fw)} devices for the pipeline")
    costs = [cost(op) for op in fw]
    total = sum(costs) or 1
    starts, acc = [0], 0
    for i, c in enumerate(costs):
        if len(starts) < nstages and acc >= total * len(starts) / nstages and i > starts[-1]:
            starts.append(i)
        acc += c
    while len(starts) < nstages:   # few expensive ops: cut the tail evenly
        starts.append(starts[-1] + 1)
    return [fw[i] for i in starts]


def _pipeline(graph: IRGraph, resource, make) -> IRGraph:
    n = resource.ngpus
    stages = graph.staging(balanced_starts(graph, n))
    for node in graph.select(ntype=IRDataOperation):
        for dev, piece in enumerate(graph.replicate(node, times=n) if n > 1 else [node]):
            graph.assign(piece, dev)
    for dev, stage in enumerate(stages):
        graph.assign(stage, dev)
    make(graph, config.micro_batches(), n)
    return graph


def PAS1F1B(graph: IRGraph, resource) -> IRGraph:
    return _pipeline(graph, resource, schedule.sched_1f1b)


def PASGPipe(graph: IRGraph, resource) -> IRGraph:
    return _pipeline(graph, resource, schedule.sched_gpipe)
