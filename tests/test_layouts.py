"""Any layout to any layout: values whose producer and consumer are split, ordered, grouped or
replicated differently train exactly like the plain model (in-process world, against eager)."""
import functools
import os
from unittest import mock

import pytest
import torch

from cube.ir import IRDataOperation, IRFwOperation
from cube.ir.follow import batch_flow, place
from cube.passes.exchange import exchange, subtract
from cube.policies.pipedream import PASPipeDream
from tests.inprocess import assert_exact, parity
from tests.models import build


def _gpt(batch: int = 12):
    """The 2-block GPT with a batch every replica count up to 4 divides."""
    model, _ = build("gpt_nobias")
    ids = torch.randint(0, 128, (batch, 16), generator=torch.Generator().manual_seed(0))
    return model, (ids, torch.roll(ids, -1, dims=1))


# PipeDream's stage_to_num_ranks, both directions and k -> m
STAGES = [
    ({0: 1, 1: 2}, "1f1b", 2, "sgd"),
    ({0: 1, 1: 2}, "gpipe", 3, "adamw"),
    # SGD: exact to 1e-8; AdamW turns the round-off of the gradient sum near zero into 2e-5 (tests.parity.rel)
    ({0: 2, 1: 1}, "1f1b", 4, "sgd"),
    ({0: 2, 1: 1}, "gpipe", 2, "sgd"),
    ({0: 1, 1: 3}, "1f1b", 3, "sgd"),
    ({0: 1, 1: 3}, "gpipe", 2, "adamw"),
    ({0: 3, 1: 2}, "1f1b", 2, "adamw"),
    ({0: 3, 1: 2}, "gpipe", 4, "sgd"),
]


@pytest.mark.parametrize("ranks,sched,nmicros,opt", STAGES,
                         ids=[f"{'-'.join(map(str, r.values()))}-{s}-m{m}-{o}" for r, s, m, o in STAGES])
def test_per_stage_replication_is_exact(ranks, sched, nmicros, opt):
    model, sample = _gpt()
    policy = functools.partial(PASPipeDream, stage_to_num_ranks=ranks, schedule_name=sched)
    with mock.patch.dict(os.environ, {"CUBE_MICROS": str(nmicros)}):
        errors = parity(model, sample, policy, sum(ranks.values()), steps=2, nmicros=nmicros, opt=opt)
    assert_exact(errors)


def _by_op(choose):
    """A policy placing the data op split over all devices and each forward op ``i`` (of ``n``)
    as ``choose(i, n, op, flow_of)`` says: ``(split or None, devices)``."""
    def policy(graph, resource):
        devices = list(range(resource.ngpus))
        place(graph, graph.select(ntype=IRDataOperation)[0], (0, 0), devices)
        fw = graph.select(ntype=IRFwOperation)
        flows = {num: batch_flow(graph, num) for num in range(2, resource.ngpus + 1)}   # before any split
        for i, op in enumerate(fw):
            split, devs = choose(i, len(fw), op, flows.get)
            place(graph, op, split if len(devs) > 1 else None, devs)
        return graph
    return policy


def test_other_device_order_is_exact():
    """Every other op data parallel over the devices in reverse order: each value changes owners."""
    def choose(i, n, op, flow_of):
        devs = [0, 1, 2] if i % 2 else [2, 1, 0]
        return flow_of(3).split_of(op), devs
    model, sample = _gpt()
    assert_exact(parity(model, sample, _by_op(choose), 3))


def test_other_group_size_is_exact():
    """The first half data parallel over 2 devices, the second over 4, the data split 4 ways."""
    def choose(i, n, op, flow_of):
        k = 2 if i < n // 2 else 4
        return flow_of(k).split_of(op), list(range(k))
    model, sample = _gpt()
    assert_exact(parity(model, sample, _by_op(choose), 4, opt="adamw"))


def test_other_groups_without_a_schedule_are_exact():
    """Ops alternate between two disjoint device pairs, both data parallel, no pipeline schedule."""
    def choose(i, n, op, flow_of):
        return flow_of(2).split_of(op), [0, 1] if (i * 3 // n) % 2 == 0 else [3, 2]
    model, sample = _gpt()
    assert_exact(parity(model, sample, _by_op(choose), 4))


def test_replicated_producer_read_on_fewer_devices_is_exact():
    """The loss's square runs on device 1 only while what it reads is replicated on 0 and 1: the
    replica on 0 gets its gradient back too."""
    def split_stage(graph, resource):
        for op in graph.nodes():
            if isinstance(op, IRDataOperation) or op.name != "mul":
                for dev, piece in enumerate(graph.replicate(op, times=2)):
                    graph.assign(piece, dev)
            else:
                graph.assign(op, 1)
        return graph
    model, sample = build("mlp")
    assert_exact(parity(model, sample, split_stage, 2))



def _reads_tied(op) -> bool:
    return any(t.name and "wte" in t.name for t in op.inputs)


HEADS = {   # how the LM head reads the tied weight: (split of the head op or None, its devices)
    "replicated-disjoint": (None, [1, 2, 3]),
    "replicated-overlapping": (None, [0, 1, 2, 3]),
    "split-hidden": ((0, 2), [2, 1]),    # each device holds half the weight's columns
}


@pytest.mark.parametrize("head", list(HEADS))
def test_tied_weight_read_whole_and_split_is_counted_once(head):
    """The tied embedding read whole on device 0, the blocks data parallel over 1..3, the LM head
    reading the same weight replicated (whole on each of its devices) or split along the hidden
    dim: the head's copies of the weight's gradient count once, every share counts."""
    split, devices = HEADS[head]

    def choose(i, n, op, flow_of):
        if _reads_tied(op) and op.name == "embedding":
            return None, [0]
        if _reads_tied(op):
            return split, devices
        return flow_of(3).split_of(op), [1, 2, 3]
    model, sample = _gpt()
    assert_exact(parity(model, sample, _by_op(choose), 4, opt="adamw"))


# ------------------------------------------------------------------ the exchange planner

def test_exchange_sends_each_reader_only_its_rows_and_returns_each_gradient_once():
    box = ((0, 8), (0, 4))
    where = {0: (box, ())}                                   # one producer
    need = {1: ((0, 4), (0, 4)), 2: ((4, 8), (0, 4))}         # two readers, half each
    tags = iter(range(1, 100))
    takes = exchange(where, need, {1: (), 2: ()}, True, lambda q, r, b: next(tags))
    assert [(k.src, k.region, k.grad) for k in takes[1]] == [(0, ((0, 4), (0, 4)), "")]
    assert [(k.src, k.region, k.grad) for k in takes[2]] == [(0, ((4, 8), (0, 4)), "")]


def test_exchange_replicated_readers_return_the_gradient_once_and_every_producer_replica_gets_it():
    box = ((0, 8),)
    where = {0: (box, ()), 1: (box, ())}                     # a replicated producer
    need = {2: box, 3: box}                                  # a replicated reader
    tags = iter(range(1, 100))
    takes = exchange(where, need, {2: (), 3: ()}, True, lambda q, r, b: next(tags))
    assert [k.grad for k in takes[2]] == [""] and [k.grad for k in takes[3]] == ["none"]
    (first,) = takes[2]
    assert {first.src} | {q for q, _, _ in first.also} == {0, 1}   # both replicas get the gradient
    assert takes[3][0].also == ()


def test_exchange_sums_partial_terms():
    box = ((0, 4),)
    t0, t1 = ((0, "k", 0, 2),), ((0, "k", 1, 2),)
    where = {0: (box, t0), 1: (box, t1)}
    takes = exchange(where, {2: ((0, 2),)}, {2: ()}, True, lambda q, r, b: 7)
    assert sorted(k.src for k in takes[2]) == [0, 1] and all(k.region == ((0, 2),) for k in takes[2])


def test_exchange_refuses_a_region_nobody_holds():
    from cube.passes.adapter import LayoutError
    where = {0: (((0, 4),), ())}
    with pytest.raises(LayoutError, match=r"no piece holds \(\(4, 8\),\)"):
        exchange(where, {1: ((0, 8),)}, {1: ()}, False, lambda q, r, b: 1)


def test_subtract_tiles_the_rest():
    box, cut = ((0, 4), (0, 4)), ((1, 3), (2, 4))
    rest = subtract(box, cut)
    cells = {(i, j) for b in rest for i in range(*b[0]) for j in range(*b[1])}
    assert len(cells) == sum((b[0][1] - b[0][0]) * (b[1][1] - b[1][0]) for b in rest)   # disjoint
    assert cells | {(i, j) for i in range(1, 3) for j in range(2, 4)} == {(i, j) for i in range(4) for j in range(4)}


def test_report_shows_each_exchange_region_and_the_bytes_it_sends(tmp_path):
    """1 -> 2 per-stage replication: stage 0 sends each of stage 1's devices only its half of the batch."""
    import cube
    model, sample = _gpt(batch=16)   # the global batch: 4 micro-batches of 4 rows
    policy = functools.partial(PASPipeDream, stage_to_num_ranks={0: 1, 1: 2}, nmicros=4)
    cube.explain(model, sample, policy, 3, tmp_path)
    text = (tmp_path / "plan.txt").read_text()
    rank0 = text.split("== rank 0")[1].split("== rank 1")[0]
    sends = [line for line in rank0.splitlines() if line.split()[1:2] == ["send"] and "sends" in line]
    half = 2 * 16 * 32 * 4    # two of four rows, 16 positions, 32 features, float32
    assert sends and all(line.endswith(f"sends {half} B") for line in sends), rank0
    assert {line.split("ranks=")[1].split(")")[0] for line in sends} == {"(0, 1", "(0, 2"}
    assert "sends in forward:" in rank0


def test_exchange_check_catches_a_gradient_counted_twice_or_a_region_missed():
    """The proof run after every exchange: replicated readers that both return the gradient (the
    per-stage replication bug) and a region read by no one are internal errors."""
    from dataclasses import replace

    from cube.passes.exchange import CubeInternalError, check
    box = ((0, 8),)
    where, need, contrib = {0: (box, ())}, {1: box, 2: box}, {1: (), 2: ()}
    takes = exchange(where, need, contrib, True, lambda q, r, b: 5)
    check(where, need, contrib, True, takes)
    doubled = {r: [replace(k, grad="") for k in mine] for r, mine in takes.items()}
    with pytest.raises(CubeInternalError, match="counted other than once"):
        check(where, need, contrib, True, doubled)
    short = {1: [replace(takes[1][0], region=((0, 4),), part=((0, 4),))], 2: takes[2]}
    with pytest.raises(CubeInternalError, match="do not tile"):
        check(where, need, contrib, True, short)
