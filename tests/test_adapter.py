"""Layout transitions: which primitives the adapter pass chooses (no processes needed)."""
import pytest

from cube.compiler import trace_and_plan
from cube.compiler import generate_all
from cube.ir.layout import piece_layout
from cube.passes.adapter import transitions
from cube.passes.rank_plans import build_plans
from cube.policy import load_policy
from tests.models import build

FULL = ((0, 8), (0, 4))
TOP, BOTTOM = ((0, 4), (0, 4)), ((4, 8), (0, 4))
LEFT, RIGHT = ((0, 8), (0, 2)), ((0, 8), (2, 4))
T0, T1 = ((0, "k", 0, 2),), ((0, "k", 1, 2),)


def kinds(steps):
    return {r: [(s.kind, s.ranks, s.dim) + ((s.grad,) if s.grad else ()) for s in ss] for r, ss in steps.items()}


def test_same_layout_needs_nothing():
    assert kinds(transitions({0: (FULL, ()), 1: (FULL, ())}, {0: FULL, 1: FULL}, {0: (), 1: ()})) == {0: [], 1: []}


def test_partial_sums_to_replicas_is_all_reduce():
    got = kinds(transitions({0: (FULL, T0), 1: (FULL, T1)}, {0: FULL, 1: FULL}, {0: (), 1: ()}))
    assert got == {0: [("all_reduce", (0, 1), -1)], 1: [("all_reduce", (0, 1), -1)]}


def test_partial_sums_to_split_is_reduce_scatter():
    got = kinds(transitions({0: (FULL, T0), 1: (FULL, T1)}, {0: TOP, 1: BOTTOM}, {0: (), 1: ()}))
    assert got == {0: [("reduce_scatter", (0, 1), 0)], 1: [("reduce_scatter", (0, 1), 0)]}
    # the chunk order follows the boxes, not the rank numbers
    got = kinds(transitions({0: (FULL, T0), 1: (FULL, T1)}, {0: BOTTOM, 1: TOP}, {0: (), 1: ()}))
    assert got[0] == [("reduce_scatter", (1, 0), 0)]


def test_split_to_replicas_is_all_gather_with_the_gradient_layout_of_the_reader():
    # whole readers (complete gradients): backward keeps each rank's chunk
    got = kinds(transitions({0: (LEFT, ()), 1: (RIGHT, ())}, {0: FULL, 1: FULL}, {0: (), 1: ()}))
    assert got[0] == [("all_gather", (0, 1), 1, "R")]
    # split readers (partial gradients over the same ranks): backward reduce-scatters
    got = kinds(transitions({0: (LEFT, ()), 1: (RIGHT, ())}, {0: FULL, 1: FULL}, {0: T0, 1: T1}))
    assert got[0] == [("all_gather", (0, 1), 1, "V")]


def test_replicas_to_split_is_chunk():
    got = kinds(transitions({0: (FULL, ()), 1: (FULL, ())}, {0: LEFT, 1: RIGHT}, {0: (), 1: ()}))
    assert got == {0: [("chunk", (0, 1), 1)], 1: [("chunk", (0, 1), 1)]}


def test_split_to_other_split_is_all_to_all():
    got = kinds(transitions({0: (TOP, ()), 1: (BOTTOM, ())}, {0: LEFT, 1: RIGHT}, {0: (), 1: ()}))
    assert got[0] == [("all_to_all", (0, 1), 1)] and got[1] == [("all_to_all", (0, 1), 1)]


def test_replicas_read_by_split_op_get_identity_forward_all_reduce_backward():
    got = kinds(transitions({0: (FULL, ()), 1: (FULL, ())}, {0: FULL, 1: FULL}, {0: T0, 1: T1}))
    assert got[0] == [("identity_all_reduce", (0, 1), -1)]


def test_groups_pair_replicas_in_a_grid():
    # 2 x 2 grid: partial sums over ranks (0, 1) and (2, 3), each pair on its own
    src = {0: (TOP, T0), 1: (TOP, T1), 2: (BOTTOM, T0), 3: (BOTTOM, T1)}
    got = kinds(transitions(src, {0: TOP, 1: TOP, 2: BOTTOM, 3: BOTTOM}, {r: () for r in range(4)}))
    assert got[0] == [("all_reduce", (0, 1), -1)] and got[3] == [("all_reduce", (2, 3), -1)]
    # a value made whole on 4 ranks read in halves by two data-parallel pairs: chunk over (0, 2), (1, 3)
    src = {r: (FULL, ()) for r in range(4)}
    got = kinds(transitions(src, {0: TOP, 1: TOP, 2: BOTTOM, 3: BOTTOM}, {r: () for r in range(4)}))
    assert got[0] == [("chunk", (0, 2), 0)] and got[1] == [("chunk", (1, 3), 0)]


def test_missing_partial_sum_is_an_error():
    with pytest.raises(ValueError, match="partial sums"):
        transitions({0: (FULL, T0)}, {0: FULL}, {0: ()})


def test_row_linear_adds_its_bias_once():
    model, sample = build("mlp")
    graph, _ = trace_and_plan(model, sample, "tuple", load_policy("cube.policies.gallery:PASRow"), 2)
    lin = [op for op in graph.nodes() if op.name == "linear"]
    layouts = [piece_layout(p) for p in lin[:2]]
    assert layouts[0].unread == () and layouts[1].unread == (2,)


def _plan(name, policy, world):
    model, sample = build(name)
    graph, _ = trace_and_plan(model, sample, "tuple", load_policy(policy), world)
    return graph, build_plans(graph, world)


def _count(plan):
    out = {}
    for c in plan.calls:
        if c.step is not None:
            out[c.step.kind] = out.get(c.step.kind, 0) + 1
    return out


def test_data_parallel_plan_communicates_only_the_loss_and_gradients():
    graph, plans = _plan("gpt_nobias", "cube.policies.data:PASData", 2)
    for r, plan in plans.items():
        assert _count(plan) == {}                 # nothing moves inside forward or backward
        assert plan.loss_sum == (0, 1)            # the loss parts are summed while backward runs
        # the position embedding (no batch dim) is read by a batch-split add: its gradient is
        # summed at its parameter, with the others, not by an all-reduce inside backward
        assert {t.name for t, _ in plan.reduce} >= {"wte.weight", "wpe.weight", "layers.0.attn.q_proj.weight"}
        assert all(ranks == (0, 1) for _, ranks in plan.reduce)


def test_megatron_plan_is_two_sums_forward_and_two_backward_per_block():
    graph, plans = _plan("gpt_nobias", "cube.policies.megatron:PASMegatronTP", 2)
    nblocks = 2
    for plan in plans.values():
        steps = _count(plan)
        assert steps == {"identity_all_reduce": 2 * nblocks, "all_reduce": 2 * nblocks}, steps
        assert plan.reduce == []                                    # no data parallelism
        shards = {t.name: box for t, box in plan.attrs}
        assert shards["layers.0.attn.q_proj.weight"][0][1] - shards["layers.0.attn.q_proj.weight"][0][0] == 16
        assert shards["layers.0.mlp.c_proj.weight"][1][1] - shards["layers.0.mlp.c_proj.weight"][1][0] == 64


@pytest.mark.parametrize("name", ["hf_llama", "hf_gpt2"])
def test_megatron_finds_pairs_in_hf_models_without_module_names(name):
    pytest.importorskip("transformers")
    graph, plans = _plan(name, "cube.policies.megatron:PASMegatronTP", 2)
    split = {op.module_path.rsplit(".", 1)[-1] for op in graph.nodes()
             if op.name in ("linear", "addmm") and op.split is not None}
    want = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} if name == "hf_llama" \
        else {"c_fc", "c_proj"}
    assert want <= split, split


def test_hybrid_groups_form_a_grid():
    graph, plans = _plan("gpt_nobias", "cube.policies.hybrid:PASHybrid", 4)
    assert {ranks for _, ranks in plans[0].reduce} == {(0, 2)}
    assert {ranks for _, ranks in plans[3].reduce} == {(1, 3)}
    # rank 1 talks to its tensor-parallel partner 0 inside the step, and to its data-parallel
    # partner 3 for the loss and the gradients
    assert {c.step.ranks for c in plans[1].calls if c.step is not None} == {(0, 1)}
    assert plans[1].loss_sum == (1, 3)
    sources = generate_all(graph, 4, "PASHybrid")
    assert "GROUPS = [(0, 1), (0, 2), (1, 3), (2, 3)]" in sources[2]


def test_value_read_on_other_devices_is_a_clear_error():
    from cube.ir import IRDataOperation

    def two_stage(graph, resource):
        ops = graph.nodes()
        for i, op in enumerate(ops):
            graph.assign(op, 0 if isinstance(op, IRDataOperation) or i < len(ops) // 2 else 1)
        return graph
    model, sample = build("mlp")
    graph, _ = trace_and_plan(model, sample, "tuple", two_stage, 2)
    with pytest.raises(ValueError, match="device 1 holds no piece of the data operation"):
        build_plans(graph, 2)


def test_two_pieces_of_one_op_on_one_device_is_a_clear_error():
    def crowded(graph, resource):
        for op in graph.nodes():
            if op.name == "linear":
                pieces = graph.partition(op, op.algorithms("dim"), idx=1, dim=0, num=2)
                graph.assign(pieces, 0)
            else:
                graph.assign(op, 0)
        return graph
    model, sample = build("mlp")
    graph, _ = trace_and_plan(model, sample, "tuple", crowded, 1)
    with pytest.raises(ValueError, match=r"op 'linear' \(module 'layers.0'.*two pieces on device 0"):
        build_plans(graph, 1)


def test_consumer_on_fewer_devices_than_its_producer_returns_the_gradient_to_every_replica():
    """(Its parity: tests/test_layouts.py.) The replica that does not send the value still gets
    its gradient: a gradient-only link from the reader."""
    from cube.ir import IRDataOperation

    def split_stage(graph, resource):
        for op in graph.nodes():
            if isinstance(op, IRDataOperation) or op.name != "mul":
                for dev, piece in enumerate(graph.replicate(op, times=2)):
                    graph.assign(piece, dev)
            else:
                graph.assign(op, 1)     # the loss's square runs on device 1 only
        return graph
    model, sample = build("mlp")
    graph, _ = trace_and_plan(model, sample, "tuple", split_stage, 2)
    plans = build_plans(graph, 2)
    only = [c.step for c in plans[0].calls if c.step is not None and c.step.kind == "send" and c.step.grad == "only"]
    links = [c.step for c in plans[1].calls if c.step is not None and c.step.kind == "grad_to"]
    assert len(only) == 1 and [(s.ranks, s.tag) for s in links] == [(only[0].ranks, only[0].tag)]


def test_values_crossing_device_groups_are_sent_once_and_tied_weights_summed_over_both():
    graph, plans = _plan("gpt_nobias", "tests/extra_policies.py:PASTwoStages", 2)
    sends = [c.step for c in plans[0].calls if c.step is not None and c.step.kind == "send"]
    recvs = [c.step for c in plans[1].calls if c.step is not None and c.step.kind == "recv"]
    assert [s.tag for s in sends] == [r.tag for r in recvs] and len(sends) == 1   # the residual stream
    assert sends[0].ranks == (0, 1) and sends[0].grad == ""                       # its gradient comes back
    # the loss goes the other way, without a gradient
    back = [c.step for c in plans[1].calls if c.step is not None and c.step.kind == "send"]
    assert len(back) == 1 and back[0].grad == "none" and back[0].box == ()
    for plan in plans.values():   # wte (stage 0's embedding, stage 1's LM head) sums over both
        assert [(t.name, g) for t, g in plan.reduce] == [("wte.weight", (0, 1))]
