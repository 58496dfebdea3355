"""Stage balancing (cube.schedule.balance): the dynamic program on synthetic costs, and the
stages it gives the GPT example (no processes needed)."""
import itertools
import random

import pytest
import torch

from cube.ir.blocks import block_of
from cube.schedule.balance import (CostModel, block_cuts, crossing, forward_ops, op_flops, residual_cuts, split,
                                   stage_costs, stage_starts)


def _brute(costs, nstages, edge, cuts):
    """The smallest bottleneck over every choice of cuts."""
    return min(max(stage_costs(costs, (0,) + combo, edge))
               for combo in itertools.combinations(sorted(cuts), nstages - 1))


@pytest.mark.parametrize("seed", range(40))
def test_split_reaches_the_smallest_bottleneck(seed):
    rnd = random.Random(seed)
    n = rnd.randint(1, 9)
    nstages = rnd.randint(1, n)
    costs = [rnd.choice([0, 1, 2, 3, 5, 8, 13]) * rnd.random() for _ in range(n)]
    edge = [rnd.random() * 3 for _ in range(n + 1)] if seed % 2 else None
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(nstages - 1, n - 1))) if seed % 3 == 0 else range(1, n)
    starts = split(costs, nstages, edge, cuts)
    assert starts[0] == 0 and len(starts) == nstages and starts == sorted(set(starts))
    assert all(k in cuts for k in starts[1:])
    got = max(stage_costs(costs, starts, edge))
    assert got == pytest.approx(_brute(costs, nstages, edge, cuts), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("costs,nstages,edge,cuts,want", [
    ([1] * 8, 4, None, None, [0, 2, 4, 6]),
    ([5, 1, 1, 1, 1, 1], 2, None, None, [0, 1]),
    ([2, 2, 2, 3], 2, None, None, [0, 2]),
    # a large activation at boundary 2 moves the cut where less crosses
    ([2, 2, 2, 3], 2, [0, 0, 10, 0, 0], None, [0, 3]),
    # only the allowed positions
    ([1] * 6, 2, None, [1, 4], [0, 4]),
    # the bottleneck (4) leaves room: the other stages are made even (3 and 3, not 2 and 4)
    ([4, 1, 1, 1, 1, 1, 1], 3, None, None, [0, 1, 4]),
    ([7], 1, None, None, [0]),
])
def test_split_on_known_costs(costs, nstages, edge, cuts, want):
    assert split(costs, nstages, edge, cuts) == want


def test_split_errors_name_the_cause():
    with pytest.raises(ValueError, match="3 stages but only 2 places.*at most 2 pipeline stages"):
        split([1, 1, 1], 3, cuts=[1])
    with pytest.raises(ValueError, match="non-negative"):
        split([1, -1], 2)
    with pytest.raises(ValueError, match=r"cuts \[3\] out of range"):
        split([1, 1, 1], 2, cuts=[3])
    with pytest.raises(ValueError, match="cut_costs must hold 4"):
        split([1, 1, 1], 2, cut_costs=[0, 0])
    with pytest.raises(ValueError, match="nstages must be a positive int"):
        split([1, 1], 0)


def test_split_is_fast_on_a_long_model():
    costs = [random.Random(0).random() for _ in range(3000)]
    starts = split(costs, 8)
    assert len(starts) == 8 and max(stage_costs(costs, starts)) < sum(costs) / 8 * 1.01


def _gpt_graph(layers=4):
    """The examples/gpt/train.py configuration (vocab 512, d256, 4 heads, T64, batch 16)."""
    from cube.trace import build_graph, export
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=layers, n_head=4, n_embd=256))
    ids = torch.randint(0, 512, (16, 64))
    graph, _ = build_graph(export(model, (ids, torch.roll(ids, -1, dims=1))), model, "tuple")
    return graph


@pytest.fixture(scope="module")
def gpt_graph():
    return _gpt_graph()


def _blocks_per_stage(graph, starts):
    stages = graph.staging(starts)
    return [len({block_of(op.module_path) for op in st} - {None}) for st in stages]


@pytest.mark.parametrize("nstages", [2, 4])
def test_gpt_example_stages_hold_equal_numbers_of_blocks(gpt_graph, nstages):
    starts = stage_starts(gpt_graph, nstages)
    assert _blocks_per_stage(gpt_graph, starts) == [4 // nstages] * nstages
    # each cut is at a block's first op (a layer norm): only the residual stream crosses it
    ops = forward_ops(gpt_graph)
    cross = crossing(ops)
    for op in starts[1:]:
        assert op.name == "layer_norm" and op.module_path.endswith("ln_1")
        assert [tuple(t.shape) for t in cross[ops.index(op)]] == [(16, 64, 256)]


def test_profiled_cost_moves_the_cut(gpt_graph):
    """A measured cost (here: block 0 and 1 three times slower) changes the split."""
    base = CostModel()
    slow = lambda op: base.op(op) * (3 if (block_of(op.module_path) or "") in ("layers.0", "layers.1") else 1)
    starts = stage_starts(gpt_graph, 2, cost=slow)
    # the slow blocks 0 and 1 end up on the first stage with at most half of block 1 beside them
    first = {block_of(op.module_path) for op in gpt_graph.staging(starts)[0]} - {None}
    assert first == {"layers.0", "layers.1"}
    assert starts[1].module_path.startswith("layers.1.") and starts[1].module_path.endswith("ln_2")


def test_cuts_inside_blocks_are_the_residual_stream(gpt_graph):
    """Inside each block the one place as cheap to cut as a block boundary: after the attention's
    residual add, where only the residual stream crosses."""
    ops = forward_ops(gpt_graph)
    cross = crossing(ops)
    inside = residual_cuts(ops, cross)
    assert len(inside) == 4   # one per block
    for k in inside:
        assert ops[k - 1].name == "add" and ops[k].module_path.endswith("ln_2")
        assert [tuple(t.shape) for t in cross[k]] == [(16, 64, 256)]


def test_cuts_inside_blocks_balance_the_head_stage(gpt_graph):
    """A stage with the LM head and loss is balanced against one of layers by half a layer: the
    bottleneck is no worse than with whole layers, and lower here."""
    ops = forward_ops(gpt_graph)
    model = CostModel()
    costs = [model.op(op) for op in ops]
    edge = [sum(model.send(t) for t in ts) for ts in crossing(ops)]
    whole = max(stage_costs(costs, split(costs, 2, edge, block_cuts(ops)), edge))
    starts = [ops.index(op) for op in stage_starts(gpt_graph, 2)]
    assert max(stage_costs(costs, starts, edge)) <= whole
    heavy = lambda op: model.op(op) * (8 if op.module_path in ("lm_head", "") and op.name != "add" else 1)
    costs = [heavy(op) for op in ops]
    whole = max(stage_costs(costs, split(costs, 2, edge, block_cuts(ops)), edge))
    starts = [ops.index(op) for op in stage_starts(gpt_graph, 2, cost=heavy)]
    assert max(stage_costs(costs, starts, edge)) < whole
    assert any(k in residual_cuts(ops, crossing(ops)) for k in starts[1:])


def test_flops_of_matmuls_and_attention(gpt_graph):
    ops = forward_ops(gpt_graph)
    fc = next(op for op in ops if op.module_path == "layers.0.mlp.c_fc")
    assert op_flops(fc) == 2 * 16 * 64 * 1024 * 256
    sdpa = next(op for op in ops if op.name == "scaled_dot_product_attention")
    assert op_flops(sdpa) == 2 * (16 * 4 * 64 * 64) * (64 + 64)
    assert op_flops(next(op for op in ops if op.name == "gelu")) == 0


def test_models_without_blocks_are_cut_anywhere():
    from cube.trace import build_graph, export
    from tests.models import build
    model, sample = build("mlp")
    graph, _ = build_graph(export(model, sample), model, "tuple")
    starts = stage_starts(graph, 2)
    assert len(starts) == 2 and all(len(st) > 0 for st in graph.staging(starts))
    with pytest.raises(ValueError, match="pipeline stages"):
        stage_starts(graph, len(forward_ops(graph)) + 1)
