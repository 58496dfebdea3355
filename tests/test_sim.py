"""cube.sim: cost models, the simulator on hand-checkable costs, memory, the profiler cache, the search.

Every timing here comes from given costs (``FixedCosts``, a ``CommModel`` with chosen
alpha/beta), never from measured speed; no processes are launched.
"""
import json

import pytest
import torch
import torch.nn as nn

from cube.compiler import generate_code, trace_and_plan
from cube.passes.rank_plans import build_plans
from cube.sim import CommModel, Estimator, FixedCosts, OpCost, Profiler, simulate
from cube.sim import comm as comm_mod
from cube.sim import engine, search
from cube.sim.program import ACCUMULATE, Ins, Program
from cube.sim.simulate import build_programs
from examples.gpt.model import GPT, GPTConfig
from cube.policies.auto import plan

F, B = 1.0, 2.0   # seconds of each linear's forward and backward


class TwoLinears(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.l1 = nn.Linear(d, d, bias=False)
        self.l2 = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.l2(self.l1(x)).sum()


def _graph(cfg, model=None, batch=8, zero=0):
    torch.manual_seed(0)
    model = model or TwoLinears()
    x = torch.randn(batch, 8)
    world = cfg["dp"] * cfg["tp"] * cfg.get("pp", 1)
    graph, _ = trace_and_plan(model, (x,), "tensor", lambda g, r: plan(g, r, cfg), world, zero=zero)
    return graph, world


def _free_comm(**beta) -> CommModel:
    """Communication that costs nothing, except ``beta[kind]`` seconds per byte where given."""
    kinds = comm_mod.KINDS
    return CommModel("gloo", {k: 0.0 for k in kinds}, {k: beta.get(k, 0.0) for k in kinds})


LINEARS = FixedCosts(fw=0.0, bw=0.0, by_name={"linear": (F, B)})


# ---------------------------------------------------------------------- pipelines
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_two_stage_pipeline_matches_the_analytic_bubble(schedule, m):
    p = 2
    graph, world = _graph({"dp": 1, "tp": 1, "pp": p, "starts": [0, 1], "nmicros": m, "schedule": schedule})
    res = simulate(graph, world, costs=LINEARS, comm=_free_comm())
    assert res.step_time == pytest.approx((m + p - 1) * (F + B))
    for s in res.ranks.values():   # each stage computes m (F + B); the rest is the bubble
        assert s.compute == pytest.approx(m * (F + B))
        assert 1 - s.compute / res.step_time == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("nvirtual", [1, 2])
def test_interleaved_pipeline_shrinks_the_bubble_by_its_virtual_stages(nvirtual):
    """Four linears on 2 ranks, as 2 stages of two linears (1F1B) or 4 stages of one (interleaved,
    stage k on rank k % 2): each rank computes m (2F + 2B) either way, and the bubble
    (p - 1)(2F + 2B) shrinks by the number of stages per rank."""
    from cube.ir import IRDataOperation
    from cube.schedule import sched_1f1b, sched_1f1b_interleaved
    p, m = 2, 4

    def policy(graph, resource):
        stages = graph.staging(graph.select(name="linear")[::2 // nvirtual])
        for node in graph.select(ntype=IRDataOperation):
            for dev, piece in enumerate(graph.replicate(node, times=p)):
                graph.assign(piece, dev)
        for k, stage in enumerate(stages):
            graph.assign(stage, k % p)
        if nvirtual > 1:
            sched_1f1b_interleaved(graph, m, p, nvirtual)
        else:
            sched_1f1b(graph, m, p)
        return graph

    torch.manual_seed(0)
    graph, _ = trace_and_plan(FourLinears(), (torch.randn(8, 8),), "tensor", policy, p)
    res = simulate(graph, p, costs=LINEARS, comm=_free_comm())
    assert [s.compute for s in res.ranks.values()] == pytest.approx([m * 2 * (F + B)] * p)
    assert res.step_time == pytest.approx(m * 2 * (F + B) + (p - 1) * 2 * (F + B) / nvirtual)


def test_pipeline_pays_for_its_messages():
    # a p2p message of the 8x8 float activation (256 bytes) costs 256 * beta each way
    beta = 1e-3
    graph, world = _graph({"dp": 1, "tp": 1, "pp": 2, "starts": [0, 1], "nmicros": 1, "schedule": "1f1b"})
    res = simulate(graph, world, costs=LINEARS, comm=_free_comm(p2p=beta))
    # (the loss the last stage sends back arrives while the first stage still runs backward)
    assert res.step_time == pytest.approx(2 * (F + B) + 2 * 256 * beta)


@pytest.mark.parametrize("m", [1, 4])
def test_gradients_accumulate_over_micro_batches_at_memory_speed(m):
    """Each micro-batch after the first adds its gradient to the one the parameter holds (autograd's
    in-place ``grad += new``: two reads and a write of the 8x8 float weight, 768 bytes, at the copy
    rate); the first is taken as it is."""
    rate = 768.0   # bytes per second the copies move: one accumulation costs 1 s
    graph, world = _graph({"dp": 1, "tp": 1, "pp": 2, "starts": [0, 1], "nmicros": m, "schedule": "1f1b"})
    costs = FixedCosts(fw=0.0, bw=0.0, by_name={"linear": (F, B)}, copy_rate=rate / 2)   # copy_cost(n) moves 2n
    res = simulate(graph, world, costs=costs, comm=_free_comm())
    for s in res.ranks.values():
        assert s.compute == pytest.approx(m * (F + B) + (m - 1) * 1.0)
        assert s.repeat_accumulate == pytest.approx((m - 1) * 1.0)
    assert res.step_time >= (m + 1) * (F + B) + (m - 1) * 1.0


@pytest.mark.parametrize("recompute", [False, True])
def test_autocast_casts_each_weight_per_forward_and_its_gradient_back(recompute):
    """Under ``precision="bf16-autocast"`` every forward call (and a recompute) casts each float32 weight a
    linear reads to bf16 (4 + 2 bytes an element), and backward casts its gradient back to float32
    (2 + 4); the norm's parameters are not cast, and without autocast nothing is."""
    import cube
    from cube.ir.operator import IRFwOperation


    def policy(graph, resource):
        from cube.policies.single import PASSingle
        graph = PASSingle(graph, resource, recompute=False)
        if recompute:   # the block's body, norm to the second linear, run again in backward
            body = ("layer_norm", "linear", "relu")
            graph.recompute([n for n in graph.select(ntype=IRFwOperation) if n.name in body])
        return graph
    rate = 1e6
    costs = FixedCosts(fw=0.0, bw=0.0, copy_rate=rate / 2)   # seconds = bytes moved / rate
    weights = 2 * 64 * 256   # elements of the two linear weights
    for precision in (None, "bf16-autocast"):
        planned = cube.plan(NormMLP(), (torch.randn(2, 64),), policy, 1, precision=precision)
        prog, = build_programs(planned.graph, 1, costs, _free_comm(), 0, False, planned.program).values()
        spent = {}
        for ins in prog.ins:
            if ins.label in ("autocast cast", "grad cast", ACCUMULATE):
                spent[ins.label, ins.cat] = spent.get((ins.label, ins.cat), 0.0) + ins.dur
        if precision is None:
            assert spent == {}
            continue
        cast = weights * 6 / rate
        expect = {("autocast cast", "forward"): cast, ("grad cast", "backward"): cast}
        if recompute:
            expect[("autocast cast", "recompute")] = cast
        assert spent == pytest.approx(expect)


# ---------------------------------------------------------------------- collectives
@pytest.mark.parametrize("n", [2, 4, 8])
def test_collective_costs_follow_the_alpha_beta_model(n):
    m = CommModel("gloo", {k: 1e-5 for k in comm_mod.KINDS}, {k: 1e-9 for k in comm_mod.KINDS})
    nbytes = 1 << 20
    assert m.cost("all_reduce", nbytes, n) == pytest.approx(2 * (n - 1) * 1e-5 + 2 * (n - 1) / n * nbytes * 1e-9)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert m.cost(kind, nbytes, n) == pytest.approx((n - 1) * 1e-5 + (n - 1) / n * nbytes * 1e-9)
    assert m.cost("p2p", nbytes, n) == pytest.approx(1e-5 + nbytes * 1e-9)
    assert m.cost("all_reduce", nbytes, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective kind 'broadcast'"):
        m.cost("broadcast", nbytes, n)


def test_a_collective_starts_when_its_last_member_arrives():
    m = CommModel("gloo", {"all_reduce": 1e-3}, {"all_reduce": 1e-8})
    cost = m.cost("all_reduce", 4096, 2)
    coll = dict(op="coll", dur=cost, key=((0, 1), 0), group=(0, 1), label="all_reduce")
    progs = {0: Program(0, [Ins("compute", 1.0), Ins(**coll)], {}, []),
             1: Program(1, [Ins("compute", 3.0), Ins(**coll), Ins("compute", 0.5)], {}, [])}
    ends, events, _ = engine.run(progs)
    assert ends[0] == pytest.approx(3.0 + cost)
    assert ends[1] == pytest.approx(3.5 + cost)
    comm = [e for e in events if e.thread == "comm"]
    assert {(e.rank, e.start) for e in comm} == {(0, 3.0), (1, 3.0)}


def test_mismatched_programs_are_a_deadlock():
    progs = {0: Program(0, [Ins("recv", key="never")], {}, []), 1: Program(1, [Ins("compute", 1.0)], {}, [])}
    with pytest.raises(engine.DeadlockError, match="rank 0: at instruction 0 recv"):
        engine.run(progs)


def test_fit_recovers_alpha_and_beta():
    samples = [(k, n, b, CommModel("gloo", {k: 2e-5}, {k: 3e-10}).cost(k, b, n))
               for k in comm_mod.KINDS for n in (2, 4) for b in (1 << 12, 1 << 20, 1 << 23)]
    m = comm_mod.fit(samples)
    for k in comm_mod.KINDS:
        assert m.alpha[k] == pytest.approx(2e-5, rel=1e-6) and m.beta[k] == pytest.approx(3e-10, rel=1e-6)


def test_a_calibration_made_on_a_busy_host_is_measured_again(tmp_path, monkeypatch):
    fresh = []

    def calibrate(world):
        fresh.append(world)
        return CommModel("gloo", {"all_reduce": 1e-3 * len(fresh)}, calibrated=True, background=0.1)
    monkeypatch.setattr(comm_mod, "calibrate", calibrate)
    cache = tmp_path / "comm.json"
    busy = CommModel("gloo", {"all_reduce": 6e-5}, calibrated=True, background=1.7)
    cache.write_text(json.dumps({comm_mod.cache_key(2): busy.to_json()}))
    kept = comm_mod.load(2, calibrate_missing=False, cache=cache)   # kept, if asked not to measure
    assert kept.alpha["all_reduce"] == 6e-5 and fresh == []
    got = comm_mod.load(2, calibrate_missing=True, cache=cache)   # measured again, and kept
    assert fresh == [2] and got.alpha["all_reduce"] == 1e-3 and got.background == 0.1
    assert comm_mod.load(2, calibrate_missing=True, cache=cache).alpha["all_reduce"] == 1e-3 and fresh == [2]
    # asked to measure again: measured, and cached, though the cache holds one from a quiet host
    again = comm_mod.load(2, cache=cache, again=True)
    assert fresh == [2, 2] and again.alpha["all_reduce"] == 2e-3
    assert json.loads(cache.read_text())[comm_mod.cache_key(2)]["alpha"]["all_reduce"] == 2e-3


def test_arrival_costs_add_to_the_alpha_beta_and_survive_the_cache():
    m = CommModel("gloo", {"all_reduce": 1e-4, "p2p": 1e-5}, {"all_reduce": 0.0, "p2p": 0.0},
                  arrival={2: 1e-3, 4: 2e-3}, p2p_arrival=5e-4)
    assert m.cost("all_reduce", 4096, 2) == pytest.approx(2 * 1e-4 + 1e-3)
    assert m.cost("all_reduce", 4096, 4) == pytest.approx(6 * 1e-4 + 2e-3)
    assert m.cost("all_reduce", 4096, 8) == pytest.approx(14 * 1e-4 + 2e-3)   # the nearest size measured
    assert m.cost("p2p", 4096, 2) == pytest.approx(1e-5 + 5e-4)
    assert m.cost("all_reduce", 4096, 1) == 0.0
    back = CommModel.from_json(json.loads(json.dumps(m.to_json())))
    assert back.arrival == {2: 1e-3, 4: 2e-3} and back.p2p_arrival == 5e-4


@pytest.mark.parametrize("cores,per_rank", [(2.0, True), (4.0, True), (2.0, False)])
def test_arrival_fit_recovers_the_costs_the_loops_were_made_with(cores, per_rank):
    from cube.sim import arrival
    from cube.sim.host import Host
    host = Host(cores, 1.0, 0.3, per_rank)
    burst, true, p2p_true = 3e-3, {2: 8e-4, 4: 1.5e-3}, 1e-3

    def cost(n):
        return 2 * (n - 1) * 1e-4

    def per_iter(after, n=0, dur=0.0):
        return arrival._per_iter(arrival._loop(4, burst, after, n, dur), host)
    times = {"none": per_iter("none"), "coll": {n: per_iter("coll", n, cost(n) + a) for n, a in true.items()},
             "p2p": per_iter("p2p", dur=3e-4 + p2p_true)}
    coll, p2p = arrival.fit(json.loads(json.dumps(times)), 4, host, cost, 3e-4)   # through JSON, as cached
    assert coll == pytest.approx(true, rel=1e-6) and p2p == pytest.approx(p2p_true, rel=1e-6)


def test_communication_faster_after_compute_than_back_to_back_adds_nothing():
    from cube.sim import arrival
    from cube.sim.host import Host
    host = Host(2.0)
    none = arrival._per_iter(arrival._loop(2, 3e-3, "none"), host)
    coll, p2p = arrival.fit({"none": none, "coll": {2: none + 1e-4}, "p2p": none}, 2, host, lambda n: 5e-4, 2e-4)
    assert coll == {2: 0.0} and p2p == 0.0


@pytest.mark.multirank
@pytest.mark.parametrize("world", [2, 3])
def test_calibrating_gloo_measures_the_arrival_costs(world):
    # 3: an odd world (its tensors cut into 3 whole pieces; no pairs to exchange messages)
    m = comm_mod.calibrate(world, sizes=(1 << 12, 1 << 16), repeats=2)
    assert m.calibrated and set(m.arrival) == {world}
    assert m.arrival[world] >= 0.0 and m.p2p_arrival >= 0.0
    if world % 2:
        assert m.p2p_arrival == 0.0
    steps = 2 * (world - 1)
    assert m.cost("all_reduce", 1 << 16, world) >= steps * m.alpha["all_reduce"] + m.arrival[world]


def test_arrival_groups_cut_the_world_into_whole_groups():
    from cube.sim import arrival
    assert arrival.groups_of(4, 2) == [(0, 1), (2, 3)] and arrival.groups_of(4, 4) == [(0, 1, 2, 3)]
    assert [arrival.group_of(4, 2, r) for r in range(4)] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert arrival.groups(4, [2, 4]) == [(0, 1), (0, 1, 2, 3), (2, 3)]
    assert arrival.sizes_for(6, [2, 4, 6]) == [2, 6] and arrival.sizes_for(2, [2]) == [2]


# ---------------------------------------------------------------------- data parallel
def test_data_parallel_step_is_compute_plus_exposed_communication(monkeypatch):
    # one bucket per weight (tiny buckets): W2's sum overlaps l1's backward, W1's cannot overlap anything
    monkeypatch.setenv("CUBE_BUCKET_MB", "0.0001")
    c = 3.0                       # seconds of each bucket's all-reduce: 8x8 floats, 2 ranks (factor 1)
    comm = _free_comm(all_reduce=c / 256)
    graph, world = _graph({"dp": 2, "tp": 1, "pp": 1})
    res = simulate(graph, world, costs=LINEARS, comm=comm)
    compute = 2 * (F + B)
    # W2 ready at 2F + B, summed until 2F + B + c; W1 ready at 2F + 2B, waits for the stream, ends at 2F + B + 2c
    assert res.step_time == pytest.approx(2 * F + B + 2 * c)
    assert res.step_time - compute == pytest.approx(2 * c - B)   # the communication not hidden
    assert res.ranks[0].compute == pytest.approx(compute)


def test_one_bucket_waits_for_all_of_backward():
    c = 3.0
    graph, world = _graph({"dp": 2, "tp": 1, "pp": 1})
    res = simulate(graph, world, costs=LINEARS, comm=_free_comm(all_reduce=c / 512))
    assert res.step_time == pytest.approx(2 * (F + B) + c)


# ---------------------------------------------------------------------- memory
def _memory(zero):
    graph, world = _graph({"dp": 2, "tp": 1, "pp": 1}, zero=3 if zero == 3 else 0)
    return build_programs(graph, world, LINEARS, _free_comm(), zero=zero)[0]


def test_zero_stages_shard_optimizer_state_gradients_and_parameters():
    params = 2 * 8 * 8 * 4                 # two 8x8 float weights, one bucket over 2 ranks
    base = {z: _memory(z).base for z in (0, 1, 2, 3)}
    assert base[0] == {"params": params, "optimizer": 2 * params}           # AdamW: two moments
    assert base[1] == {"params": params, "optimizer": params}               # state: half each
    assert base[2] == base[1]
    assert base[3] == {"params": params // 2, "optimizer": params}           # parameters at rest too
    g = {z: sum(i.mem.get("grads", 0) for i in _memory(z).ins if i.cat != "optimizer") for z in (0, 1, 2, 3)}
    assert g[0] == g[1] == params and g[2] == g[3] == params // 2       # kept after the step's reduction
    for z in (0, 1, 2, 3):   # nothing leaks: the step ends where it started
        assert sum(sum(i.mem.values()) for i in _memory(z).ins) == 0


def test_peak_memory_and_trace(tmp_path):
    graph, world = _graph({"dp": 1, "tp": 1, "pp": 2, "starts": [0, 1], "nmicros": 4, "schedule": "gpipe"})
    gpipe = simulate(graph, world, costs=LINEARS, comm=_free_comm())
    graph, world = _graph({"dp": 1, "tp": 1, "pp": 2, "starts": [0, 1], "nmicros": 4, "schedule": "1f1b"})
    f1b = simulate(graph, world, costs=LINEARS, comm=_free_comm())
    # GPipe keeps all 4 micro-batches' activations on the first stage, 1F1B at most 2
    assert gpipe.ranks[0].breakdown["activations"] > f1b.ranks[0].breakdown["activations"]
    trace = json.loads(open(f1b.chrome_trace(tmp_path / "t.json")).read())["traceEvents"]
    assert {e["pid"] for e in trace} == {0, 1}
    assert any(e["ph"] == "X" and e["cat"] == "backward" for e in trace)
    plot = f1b.memory_plot(tmp_path / "mem.png")
    assert plot.endswith((".png", ".csv")) and open(plot, "rb").read()


def test_recompute_trades_time_for_activation_memory():
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)
    model = GPT(cfg)
    ids = torch.randint(0, 64, (4, 8))
    out = {}
    for rc in (False, True):
        policy = lambda g, r, rc=rc: plan(g, r, {"dp": 1, "tp": 1, "pp": 1, "recompute": rc})  # noqa: E731
        graph, _ = trace_and_plan(model, (ids, ids), "tuple", policy, 1)
        out[rc] = simulate(graph, 1, costs=Estimator(), comm=_free_comm())
    assert out[True].step_time > out[False].step_time
    assert out[True].ranks[0].breakdown["activations"] < out[False].ranks[0].breakdown["activations"]


# ---------------------------------------------------------------------- profiler
def test_profiler_measures_once_then_reads_its_cache(tmp_path):
    graph, world = _graph({"dp": 2, "tp": 1, "pp": 1})
    calls = [c for c in build_plans(graph, world)[0].calls if c.op is not None]
    first = Profiler(device="cpu", cache=tmp_path / "p.json", repeats=1)
    costs = [first.op_cost(c) for c in calls]
    assert first.misses >= 1 and first.hits == 0
    assert all(c.measured and c.fw > 0 for c in costs)
    linear = costs[[c.op.name for c in calls].index("linear")]
    assert ("in", 0) in linear.saved and linear.bw > 0   # the input is kept for the weight's gradient
    first.save()
    second = Profiler(device="cpu", cache=tmp_path / "p.json", repeats=1)
    again = [second.op_cost(c) for c in calls]
    assert second.misses == 0 and second.hits >= 1
    assert [c.fw for c in again] == [c.fw for c in costs]


def test_whole_step_times_the_model_and_sums_its_profiled_ops(tmp_path):
    from cube.sim.context import Context, WholeStep, fit_context
    from cube.sim.profile import typical
    torch.manual_seed(0)
    model, x = TwoLinears(64), torch.randn(32, 64)
    prof = Profiler(device="cpu", cache=tmp_path / "p.json", repeats=1)
    step = WholeStep(model, (x,))
    assert [c.op.name for c in step.calls].count("linear") == 2
    per_op = sum(prof.op_cost(c).fw + prof.op_cost(c).bw for c in step.calls if c.op.name == "linear")
    prof.context = Context(3.0, 1.0)   # the sum is of the ops as profiled, whatever context the profiler has now
    assert step.profiled(prof) >= per_op > 0 and prof.context == Context(3.0, 1.0)
    assert step.count(prof) >= 4   # each linear's forward and backward at least
    assert step.seconds() > 0 and all(p.grad is None for p in step.gen.parameters())   # gradients cleared
    got = fit_context(model, (x,), prof, steps=2)
    assert got.scale >= 1.0 and got.per_call >= 0.0 and got.memory > 0.0
    numels = [p.numel() for p in model.parameters()]
    prof.context = Context()
    alone, copy = prof.optimizer_cost(numels), prof.copy_cost(1 << 20)
    prof.context = Context(1.0, 0.0, 2.0)   # the optimizer step and copies: times the memory factor
    assert prof.optimizer_cost(numels) == pytest.approx(2 * alone)
    assert prof.copy_cost(1 << 20) == pytest.approx(2 * copy)
    assert typical([5.0, 1.0, 3.0, 100.0]) == 2.0   # the median of the faster half


def test_context_fit_separates_a_scale_from_a_cost_per_call():
    """Whole steps of one model at two batch sizes: measured = scale * profiled + per_call * calls."""
    from cube.sim.context import fit, quarter
    from cube.sim.profile import Context
    truth = Context(1.2, 80e-6)
    points = [(p, 176, truth.scale * p + truth.per_call * 176) for p in (0.327, 0.077)]
    got = fit(points)
    assert got.scale == pytest.approx(truth.scale) and got.per_call == pytest.approx(truth.per_call)
    assert fit(points[:1]) == Context(points[0][2] / points[0][0])   # one step: the scale alone
    assert fit([(0.3, 10, 0.2)]) == Context(1.0)   # never cheaper than alone
    neg = fit([(0.3, 10, 0.5), (0.1, 10, 0.1)])   # a negative cost per call: the scale alone
    assert neg.scale == pytest.approx(1.5) and neg.per_call == 0.0
    below = fit([(0.3, 10, 0.9 * 0.3 + 0.01), (0.1, 10, 0.9 * 0.1 + 0.01)])   # a scale under 1: raised to 1
    assert below.scale == 1.0 and below.per_call >= 0.0
    assert fit([]) == Context()
    with_opt = fit(points, optimizer=(0.01, 0.03))   # the optimizer step: memory-bound work's own factor
    assert with_opt.memory == pytest.approx(3.0) and with_opt.scale == pytest.approx(truth.scale)
    x, y = torch.zeros(16, 3), torch.zeros(16)
    assert [t.shape[0] for t in quarter((x, y))] == [4, 4] and quarter(x).shape[0] == 4
    assert quarter((x, torch.zeros(8))) is None and quarter(torch.zeros(1, 3)) is None


def test_profiler_estimates_what_it_cannot_run(tmp_path):
    graph, world = _graph({"dp": 1, "tp": 1, "pp": 1})
    call = next(c for c in build_plans(graph, world)[0].calls if c.op is not None)
    prof = Profiler(device="cpu", cache=False, repeats=1)
    prof._measure_call = lambda call: (_ for _ in ()).throw(RuntimeError("no kernel"))
    cost = prof.op_cost(call)
    assert not cost.measured and cost.fw > 0


# ---------------------------------------------------------------------- stages and search
class NormMLP(nn.Module):
    """A pre-norm MLP block with its residual, summed: float32 norm and residual, bf16 products
    under autocast."""

    def __init__(self, d=64):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(d), nn.Linear(d, 4 * d, bias=False)
        self.out = nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return (x + self.out(torch.relu(self.fc(self.norm(x))))).sum()


class FourLinears(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(4)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_pipeline_stages_are_balanced_on_simulated_costs():
    torch.manual_seed(0)
    tracer = search._Tracer(FourLinears(), torch.randn(8, 8))
    cfg = {"dp": 1, "tp": 1, "pp": 2, "micro_batch": 8, "world": 2}
    even = search.balance(tracer, cfg, LINEARS, _free_comm())
    assert even == [0, 2]                           # two layers per stage
    last_heavy = FixedCosts(fw=0.0, bw=0.0, fn=lambda call: OpCost(3.0, 6.0) if call.op.name == "linear"
                            and call.op.module_path.endswith("3") else None, by_name={"linear": (1.0, 2.0)})
    assert search.balance(tracer, cfg, last_heavy, _free_comm()) == [0, 3]   # 9 | 9 instead of 6 | 12


def test_search_ranks_plans_and_emits_a_policy_that_compiles(tmp_path, monkeypatch):
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, 64, (8, 8))
    batch = (ids, torch.roll(ids, -1, 1))
    lines = []
    ranked = search.search(model, batch, 2, Estimator(), CommModel("gloo"), mem_cap=64 * 2**20,
                           progress=lines.append, micros=(1, 2), zero=(0, 1, 3))
    assert len(ranked) == len(lines) >= 8
    times = [c.step_time for c in ranked if c.feasible]
    assert times == sorted(times) and len(times) >= 5
    kinds = {(c.config["dp"], c.config["tp"], c.config["pp"]) for c in ranked if c.result is not None}
    assert {(2, 1, 1), (1, 2, 1), (1, 1, 2)} <= kinds
    assert "step ms" in search.table(ranked)
    best = ranked[0]
    path = search.write_plan(best, str(tmp_path / "plan.json"))
    monkeypatch.setenv("CUBE_AUTO_PLAN", path)
    micro = tuple(t[:best.config["micro_batch"]] for t in batch)
    sources = generate_code(model, micro, "cube.policies.auto:PASAuto", world_size=2,
                            zero=3 if best.config["zero"] == 3 else 0)
    assert set(sources) == {0, 1} and all("class GenModel" in s for s in sources.values())
    # every kind of plan the search proposes compiles
    for c in ranked:
        if c.result is not None and c.config["pp"] > 1:
            monkeypatch.setenv("CUBE_AUTO_PLAN", search.write_plan(c, str(tmp_path / "pipe.json")))
            micro = tuple(t[:c.config["micro_batch"]] for t in batch)
            assert "runtime.pipeline.run" in generate_code(model, micro, "cube.policies.auto:PASAuto", world_size=2)[0]
            break


def test_auto_policy_errors_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("CUBE_AUTO_PLAN", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="run `python -m cube.sim"):
        generate_code(TwoLinears(), torch.randn(8, 8), "cube.policies.auto:PASAuto", world_size=2)
    (tmp_path / "p.json").write_text(json.dumps({"dp": 4, "tp": 1, "pp": 1}))
    monkeypatch.setenv("CUBE_AUTO_PLAN", str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match="launch 4 processes or search again"):
        generate_code(TwoLinears(), torch.randn(8, 8), "cube.policies.auto:PASAuto", world_size=2)


SPEC = '''
import torch
from examples.gpt.model import GPT, GPTConfig


def build():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 64, (8, 8))
    return model, (ids, torch.roll(ids, -1, 1))


if __name__ == "__main__":
    raise SystemExit("a training script's main does not run when the simulator reads it")
'''


def test_command_line_simulates_a_policy_and_searches(tmp_path, capsys, monkeypatch):
    from cube.sim.__main__ import main
    spec = tmp_path / "train.py"
    spec.write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    common = ["--ngpus", "2", "--estimate", "--no-calibrate"]
    assert main([str(spec), *common, "--policy", "PASData", "--trace", "t.json", "--memory", "m.png"]) == 0
    out = capsys.readouterr().out
    assert "predicted step time" in out and (tmp_path / "t.json").exists()
    assert main([f"{spec}:build", *common, "--search", "--mem-cap", "1", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "best:" in out and "cube.policies.auto:PASAuto" in out
    cfg = json.loads((tmp_path / "cube_auto_plan.json").read_text())
    assert cfg["dp"] * cfg["tp"] * cfg["pp"] == 2 and cfg["predicted_step_ms"] > 0
    with pytest.raises(ValueError, match=r"defines no function nope\(\)"):
        main([f"{spec}:nope", *common, "--policy", "PASData"])
    with pytest.raises(SystemExit):   # measure again, and use defaults: contradictory
        main([str(spec), *common, "--recalibrate", "--policy", "PASData"])
    assert "--recalibrate measures the collectives again" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # a cluster's profile has no host collectives to measure
        main([str(spec), "--ngpus", "2", "--hardware", "dgx-a100-80g", "--recalibrate", "--policy", "PASData"])
    assert "--recalibrate measures this host's collectives" in capsys.readouterr().err


def test_auto_plan_is_part_of_the_code_cache_key(tmp_path, monkeypatch):
    from cube.policy import policy_source
    from cube.policies.auto import PASAuto
    path = tmp_path / "plan.json"
    monkeypatch.setenv("CUBE_AUTO_PLAN", str(path))
    sources = []
    for dp in (2, 1):
        path.write_text(json.dumps({"dp": dp, "tp": 1, "pp": 3 - dp}))
        sources.append(policy_source(PASAuto))
    assert "{'config': {'dp': 2" in sources[0] and "{'config': {'dp': 1" in sources[1]


def test_background_from_the_cpu_time_other_programs_take():
    from cube.sim.host import background_of
    # 2 ranks and one CPU-bound program on 2 saturated cores: fair shares of 2/3 core each
    assert abs(background_of(2 / 3, 4 / 3, ranks=2, cores=2.0) - 1.0) < 1e-9
    assert background_of(0.1, 1.0, ranks=2, cores=4.0) == 0.1   # cores to spare: it takes what it uses
    assert background_of(0.0, 2.0, ranks=2, cores=2.0) == 0.0


def test_sampler_sees_a_busy_program_during_its_span():
    import os
    import subprocess
    import sys
    import time
    from cube.sim.host import Sampler
    sampler = Sampler([], interval=0.1, ranks=1)
    sampler.start()
    # The spinner must be another program, not a descendant of this one (the sampler counts this
    # process's children as ours): a short-lived parent starts it and exits, orphaning it.
    spin = "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"
    launch = ("import subprocess, sys\n"
              f"print(subprocess.Popen([sys.executable, '-c', {spin!r}], stdout=subprocess.DEVNULL, "
              "stderr=subprocess.DEVNULL).pid)")
    pid = int(subprocess.run([sys.executable, "-c", launch], capture_output=True, text=True, check=True).stdout)

    def running() -> bool:   # (an orphan nobody reaps stays a zombie, state Z)
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    time.sleep(0.5)
    t0 = time.time()
    while running() and time.time() - t0 < 10:
        time.sleep(0.02)
    t1 = time.time()
    time.sleep(0.2)
    assert sampler.during([(t0, t1)]) > 0.5   # a program spinning on a core (and whatever else runs)
    assert sampler.mean() > 0


# the default tier runs the command on a model of linears and on the big model built on meta; the slow tier
# (CUBE_SLOW=1) on the other examples too (each 15-30 s: a trace, a plan and a simulation of its own)
@pytest.mark.parametrize("example", ["examples/mlp/linears.py", "examples/bigmodel/train.py",
                                     *(pytest.param(e, marks=pytest.mark.slow) for e in (
                                         "examples/gpt/train.py", "examples/text/train.py", "examples/onnx/train.py",
                                         "examples/spatial/train.py"))])
def test_the_readme_simulator_command_runs_on_every_example(example):
    """``python -m cube.sim examples/<each> --ngpus 4 --policy PASData --estimate``, as docs/simulator.md shows."""
    import subprocess
    import sys
    from tests.launch import ROOT
    done = subprocess.run([sys.executable, "-m", "cube.sim", example, "--ngpus", "4", "--policy", "PASData",
                           "--estimate"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "predicted step time" in done.stdout, done.stdout[-3000:]
    ranks = [line.split()[0] for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert ranks[-4:] == ["0", "1", "2", "3"], done.stdout[-3000:]


def test_mixed_precision_memory_follows_autocast():
    """Under ``precision="bf16-autocast"`` a linear's output is counted in bf16, a norm's and the residual
    stream (float32 input plus a bf16 projection) in float32, and the linear holds autocast's bf16
    copy of its weight (bigger than every activation here) until its backward."""
    import cube
    from cube.ir.operator import IRFwOperation
    from cube.sim.precision import autocast_dtypes

    model, x = NormMLP(), torch.randn(2, 64)
    peaks = {}
    for precision in (None, "bf16-autocast"):
        planned = cube.plan(model, (x,), "PASSingle", 1, precision=precision)
        if precision:
            dtypes = autocast_dtypes(planned.graph, precision)
            by = {op.name: dtypes.get(id(op.outputs[0])) for op in planned.graph.select(ntype=IRFwOperation)}
            assert by["linear"] == by["relu"] == torch.bfloat16
            assert by["layer_norm"] == by["add"] == by["sum"] == torch.float32
        prog, = build_programs(planned.graph, 1, Estimator(), _free_comm(), 0, True, planned.program).values()
        held = [0]
        for ins in prog.ins:   # the activations' high-water mark
            held.append(held[-1] + ins.mem.get("activations", 0))
        peaks[precision] = max(held)
    weight = 4 * 64 * 64 * 2   # one weight's bf16 copy
    assert peaks[None] < weight <= peaks["bf16-autocast"]


def test_host_clock_hides_behind_a_busy_device_and_idles_a_fast_one():
    """A GPU rank's host issues each op ahead of the device: three ops of 1 s on the device and
    2 s of dispatch each end at 6 s (host-bound); of 2 s and 1 s dispatch at 6 s (device-bound)."""
    host_bound = {0: Program(0, [Ins("compute", 1.0, host=2.0) for _ in range(3)], {}, [])}
    device_bound = {0: Program(0, [Ins("compute", 2.0, host=1.0) for _ in range(3)], {}, [])}
    no_host = {0: Program(0, [Ins("compute", 1.0) for _ in range(3)], {}, [])}
    assert engine.run(host_bound)[0][0] == pytest.approx(6.0)
    assert engine.run(device_bound)[0][0] == pytest.approx(6.0)
    assert engine.run(no_host)[0][0] == pytest.approx(3.0)


def _linear_block(d=64):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

        def forward(self, x):
            h = self.norm(x)   # float32 under autocast, read by two bf16 products
            return (self.q(h) * self.k(h)).sum()
    return Block()


def test_device_costs_follow_autocast_dtypes_casts_and_gradient_sums():
    """On a profiled GPU under bf16: the norm moves float32 bytes, each product pays the cast of its
    float32 input (not of its weight: the program casts weights once per forward call), a value read
    twice gets its second gradient added (one "grad sum"), and the host issues every op."""
    import json
    import cube
    from cube.ir.operator import IRFwOperation
    from cube.sim import hardware
    from cube.sim.cluster import DeviceCosts
    from cube.sim.precision import autocast_dtypes

    model, x = _linear_block(), torch.randn(4096, 64)
    planned = cube.plan(model, (x,), "PASSingle", 1, precision="bf16-autocast")
    raw = json.loads((hardware.HERE / "dgx-h100.json").read_text())
    raw["device"]["host_us_per_op"] = {"forward": 7.0, "backward": 11.0}
    hw = hardware.Hardware("h", "gpu", raw, "test")
    costs = DeviceCosts(hw, "bf16")
    ops = {op.name: op for op in planned.graph.select(ntype=IRFwOperation)}
    norm, lin = ops["layer_norm"], ops["linear"]
    shape = [tuple(t.shape) for t in norm.inputs], [tuple(t.shape) for t in norm.outputs]
    before = costs.device_seconds(norm, *shape)[0]
    costs.bind_dtypes(autocast_dtypes(planned.graph, "bf16-autocast"))
    assert costs.device_seconds(norm, *shape)[0] == pytest.approx(2 * before, rel=0.01)   # 4 bytes, not 2
    ins = [tuple(t.shape) for t in lin.inputs]
    kernel, cast = costs.device_seconds(lin, ins, [tuple(lin.outputs[0].shape)])
    assert cast == pytest.approx(4096 * 64 * (4 + 2) / hw.memory_rate)   # the activation only
    assert costs.host_seconds("forward") == pytest.approx(7e-6)
    assert costs.host_seconds("backward") == pytest.approx(11e-6)
    prog, = build_programs(planned.graph, 1, costs, _free_comm(), 0, True, planned.program).values()
    sums = [i for i in prog.ins if i.label == "grad sum"]
    assert len(sums) == 1 and sums[0].cat == "backward" and sums[0].host == 0.0
    issued = [i for i in prog.ins if i.op == "compute" and i.host > 0]
    assert {i.host for i in issued} == {7e-6, 11e-6}
