"""Pipeline schedules as data, their validator, and graph.staging (no processes needed).

Printed schedules are golden-tested: on an intended change, regenerate with
``CUBE_UPDATE_GOLDEN=1 python -m pytest tests/test_schedule.py`` and review the diff.
"""
import pytest

from cube.compiler import trace_and_plan
from cube.ir import IRDataOperation, IRFwOperation
from cube.policy import load_policy
from cube.schedule import custom, sched_1f1b, sched_1f1b_interleaved, sched_gpipe, validate
from cube.trace import build_graph, export
from tests.models import build
from tests.test_golden import _check


def test_printed_schedules_match_golden():
    parts = []
    for s in (sched_gpipe(None, 4, 2), sched_1f1b(None, 4, 2), sched_1f1b(None, 8, 4),
              sched_1f1b_interleaved(None, 4, 2, 2)):
        parts += [str(s), s.grid(), f"steps: {s.steps()}", ""]
    _check("schedules.txt", "\n".join(parts))


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (3, 5)])
def test_1f1b_reaches_the_pipeline_bound(p, m):
    # with every micro-step one unit, 1F1B and GPipe both take 2 * (m + p - 1) steps
    assert sched_1f1b(None, m, p).steps() == 2 * (m + p - 1)
    assert sched_gpipe(None, m, p).steps() == 2 * (m + p - 1)
    # 1F1B keeps at most p micro-batches in flight on the first stage (GPipe keeps m)
    acts = sched_1f1b(None, m, p).ranks[0]
    live = peak = 0
    for a in acts:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    assert peak == min(p, m)


def test_hand_written_schedule_is_checked():
    s = custom(None, 2, 2, [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]])
    assert validate(s) and s.steps() == 6


@pytest.mark.parametrize("ranks,match", [
    ([["F0", "B0", "F1", "B1"], ["F0", "F1", "B0", "B1"]], r"deadlocks at step 2: rank 0's next action B0"),
    ([["F0", "F1", "B0"], ["F0", "B0", "F1", "B1"]], r"rank 0 misses \['B1.s0'\]"),
    ([["F0", "F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], r"rank 0 repeats \['F0.s0'\]"),
    ([["F0", "F1", "B0", "B1", "F0.s1"], ["F0", "B0", "F1", "B1"]], r"stage 1 runs on rank 1"),
    ([["F0", "F2", "B0", "B2"], ["F0", "B0", "F1", "B1"]], r"micro-batches are 0..1"),
    ([["X0"], ["F0"]], r"write F<micro>, B<micro> or W<micro>"),
])
def test_validator_names_the_offending_cell(ranks, match):
    with pytest.raises(ValueError, match=match) as info:
        custom(None, 2, 2, ranks)
    if "deadlocks" in match:
        assert "??" in str(info.value) and "rank 1" in str(info.value)   # the grid, marked


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="nmicros must be a positive int"):
        sched_1f1b(None, 0, 2)
    with pytest.raises(ValueError, match="multiple of nranks"):
        sched_1f1b_interleaved(None, 3, 2, 2)


def _graph():
    model, sample = build("gpt")
    graph, _ = build_graph(export(model, sample), model, "tuple")
    return graph


def test_staging_groups_ops_and_stages_can_be_placed():
    graph = _graph()
    ln = [op for op in graph.select(name="layer_norm") if op.module_path == "layers.1.ln_1"][0]
    first = graph.select(ntype=IRFwOperation)[0]
    stages = graph.staging([first, ln])
    fw = graph.select(ntype=IRFwOperation)
    assert [op for st in stages for op in st] == fw
    assert stages[1][0] is ln and all(op.module_path != "layers.1.ln_1" for op in stages[0])
    # a stage start later than the first op: the ops before it join stage 0
    assert graph.staging([fw[3], ln])[0][0] is fw[0]


def test_stages_out_of_order_are_a_clear_error():
    graph = _graph()
    ln = [op for op in graph.select(name="layer_norm") if op.module_path == "layers.1.ln_1"][0]
    first = graph.select(ntype=IRFwOperation)[0]
    with pytest.raises(ValueError, match=r"stage 1 starts at op 'arange'.*model.py:104.*program order"):
        graph.staging([ln, first])
    with pytest.raises(ValueError, match="forward ops"):
        graph.staging([graph.select(ntype=IRDataOperation)[0]])


def _staged(schedule):
    def policy(graph, resource):
        fw = graph.select(ntype=IRFwOperation)
        stages = graph.staging([fw[0], fw[len(fw) // 2]]) if schedule != "nostages" else [fw]
        for node in graph.select(ntype=IRDataOperation):
            for dev, piece in enumerate(graph.replicate(node, times=2)):
                graph.assign(piece, dev)
        for dev, stage in enumerate(stages):
            graph.assign(stage, dev)
        if schedule == "interleaved":
            sched_1f1b_interleaved(graph, 4, 1, 2)
        else:
            sched_1f1b(graph, 4, 2)
        if schedule == "nostages":
            graph.stages = []
        return graph
    return policy


def test_scheduled_plan_generates_a_pipelined_step():
    from cube.compiler import generate_all
    model, sample = build("gpt_nobias")
    graph, _ = trace_and_plan(model, sample, "tuple", load_policy(_staged("1f1b")), 2)
    sources = generate_all(graph, 2, "staged")
    assert "runtime.pipeline.run(model, batches, ['F0', 'F1', 'B0', 'F2', 'B1', 'F3', 'B2', 'B3']" in sources[0]
    assert "loss_from=1" in sources[0] and "loss_to=(0,)" in sources[1]
    assert "runtime.p2p.send(" in sources[0] and "runtime.p2p.recv(0" in sources[1]


MISFITS = [("nostages", "no stages: call graph.staging"),
           ("interleaved", r"device 0 runs ops of stages \[0\], but the 1f1b-interleaved schedule runs stages "
                           r"\[0, 1\] together.*devices of stage k % 1")]


@pytest.mark.parametrize("kind,match", MISFITS)
def test_schedules_that_do_not_fit_the_placement_are_clear_errors(kind, match):
    from cube.compiler import generate
    model, sample = build("gpt_nobias")
    graph, _ = trace_and_plan(model, sample, "tuple", load_policy(_staged(kind)), 2)
    with pytest.raises(ValueError, match=match):
        generate(graph, 0, 2, "staged")
