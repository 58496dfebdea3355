"""Planning for a cluster this machine is not: hardware profiles, the network of nodes, symmetric
simulation (one rank per class, data parallel folded, micro-batches extrapolated) equal to the full
simulation, and the ``--hardware ... --json`` command line."""
import json
import re

import pytest
import torch

from cube.sim import hardware
from cube.sim.api import simulate_policy
from cube.sim.cluster import ClusterComm, DeviceCosts
from cube.sim.symmetry import Fold
from examples.gpt.model import GPT, GPTConfig

A100 = hardware.load("dgx-a100-80g")
H100 = hardware.load("dgx-h100")


def test_shipped_profiles_load_and_cite_their_sources():
    assert {"dgx-a100-80g", "dgx-h100", "cpu-host"} <= set(hardware.names())
    for name in ("dgx-a100-80g", "dgx-h100"):
        hw = hardware.load(name)
        assert not hw.is_host and hw.gpus_per_node == 8 and hw.raw["sources"]
        assert hw.peak_flops("bf16") > hw.peak_flops("fp32") > 0
        curve = hw.curve("gemm")
        assert 0 < curve.at(1e9) < curve.at(1e12) < curve.max <= 1
    assert hardware.load("cpu-host").is_host
    assert hardware.load("dgx-h100").peak_flops("bf16") > A100.peak_flops("bf16")


def test_bad_profiles_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown hardware profile 'dgx-z9'.*dgx-a100-80g"):
        hardware.load("dgx-z9")
    bad = tmp_path / "bad.json"
    bad.write_text('{"device": {"kind": "gpu"}}')
    with pytest.raises(ValueError, match="lacks peak_tflops"):
        hardware.load(bad)
    with pytest.raises(ValueError, match="no hardware profile file"):
        hardware.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="gives no peak for 'fp64'"):
        A100.peak_flops("fp64")
    with pytest.raises(ValueError, match="'dgx-a100-80g' has no fp8 peak.*no float8 tensor cores"):
        A100.peak_flops("fp8")


def test_network_knows_nodes_rails_and_algorithms():
    net = ClusterComm(A100)
    intra, inter = A100.network["intra"], A100.network["inter"]
    rail = inter["nic_gbps_per_gpu"] * 1e9 * inter["efficiency"]
    size = 1 << 30
    # 8 ranks on one node: NVLink's bus bandwidth
    one_node = net.cost("all_reduce", size, range(8))
    assert one_node == pytest.approx(14 * intra["alpha_us"] * 1e-6 + 2 * 7 / 8 * size / (intra["busbw_gbps"] * 1e9))
    # 8 ranks, one per node: each on its own rail, much slower
    spread = net.cost("all_reduce", size, [8 * k for k in range(8)])
    assert spread > 5 * one_node
    ring = 14 * inter["alpha_us"] * 1e-6 + 2 * 7 / 8 * size / rail
    assert spread == pytest.approx(min(ring, 2 * (3 * inter["alpha_us"] * 1e-6) + 2 * size / rail))
    # two whole nodes: every rail of both nodes works, capped by NVLink
    assert net.cost("all_gather", size, range(16)) < net.cost("all_gather", size, [8 * k for k in range(16)])
    # tiny messages across many nodes: the tree's log-depth latency beats the ring
    small = net.cost("all_reduce", 1024, [8 * k for k in range(64)])
    assert small < 2 * 63 * inter["alpha_us"] * 1e-6
    assert net.cost("p2p", size, (0, 1)) < net.cost("p2p", size, (0, 8))
    # a message between nodes goes over the sender's one rail: its latency, then the bytes at the rail's rate
    assert net.cost("p2p", size, (0, 8)) == pytest.approx(inter["alpha_us"] * 1e-6 + size / rail)
    with pytest.raises(ValueError, match="no inter-node network"):
        solo = hardware.Hardware("solo", "gpu", {**A100.raw, "network": {"intra": A100.network["intra"]}}, "x")
        ClusterComm(solo).cost("p2p", 10, (0, 8))


def test_device_costs_follow_the_profile():
    costs = DeviceCosts(A100, "bf16")
    assert costs.peak == 312e12 and costs.act_bytes == 2
    fp32 = DeviceCosts(A100, None)
    assert fp32.peak == A100.peak_flops("fp32") and fp32.act_bytes == 4
    with pytest.raises(ValueError, match="measured"):
        DeviceCosts(hardware.load("cpu-host"))


def test_backward_factor_per_op_class_and_causal_attention(tmp_path):
    from types import SimpleNamespace
    raw = json.loads((hardware.HERE / "dgx-h100.json").read_text())
    raw["device"]["backward_factor"] = {"default": 2.0, "attention": 3.0}
    raw["device"]["launch_us"] = 0.0
    path = tmp_path / "h.json"
    path.write_text(json.dumps(raw))
    costs = DeviceCosts(hardware.load(path), "bf16")
    q = torch.empty(8, 16, 1024, 64)

    def sdpa(causal):
        return SimpleNamespace(name="scaled_dot_product_attention", args=(), kwargs={"is_causal": causal},
                               inputs=[q, q, q], outputs=[q])
    shape = tuple(q.shape)
    full = costs.forward_seconds(sdpa(False), [shape] * 3, [shape], False)
    causal = costs.forward_seconds(sdpa(True), [shape] * 3, [shape], False)
    assert causal == pytest.approx(full / 2)   # the kernel skips the masked half (compute-bound here)
    assert costs.backward_seconds(sdpa(False), full) == pytest.approx(3 * full)
    mm = SimpleNamespace(name="matmul", args=(), kwargs={}, inputs=[q, q], outputs=[q])
    assert costs.backward_seconds(mm, 1.0) == 2.0
    assert DeviceCosts(H100, "bf16").backward_seconds(mm, 1.0) == 2.0   # a number: every class


def test_fold_maps_folded_groups_to_the_real_ranks():
    # context parallel pairs inside dp stay whole: dp 8 in pairs folds to 2 pairs; a pair is itself,
    # a group over both folded pairs' first ranks is the real group of every pair's first rank
    pairs = Fold(("dp",), (4,), (8,), inner=2)
    assert pairs.real_group([0, 1]) == (0, 1) and pairs.real_group([0, 2]) == (0, 2, 4, 6)
    assert pairs.real_group([0, 1, 2, 3]) == tuple(range(8))
    fold = Fold(("pp", "dp", "tp"), (2, 2, 4), (2, 6, 4))
    assert fold.world == 16 and fold.real_world == 48 and fold.batch == (16, 48)
    assert fold.real_rank(5) == 5 and fold.real_rank(9) == 25   # (1, 0, 1) -> 24 + 1
    # the data parallel pair (0, 0, 1), (0, 1, 1) is the real group of all six replicas
    assert fold.real_group([1, 5]) == tuple(1 + 4 * d for d in range(6))
    # a tensor parallel group stays itself
    assert fold.real_group([4, 5, 6, 7]) == (4, 5, 6, 7)
    assert fold.representatives() == (0, 8)


def _gpt(layers=4, batch=192, device="meta"):
    with torch.device(device):
        model = GPT(GPTConfig(vocab_size=512, block_size=128, n_layer=layers, n_head=4, n_embd=256))
    ids = torch.zeros(batch, 128, dtype=torch.long, device=device)
    return model, (ids, ids)


@pytest.mark.parametrize("policy,world,options,zero", [
    ("PASHybrid", 16, {"tp": 2}, 0),                              # dp 8 folded to 2, one rank per tp group
    ("PASMegatron", 16, {"tp": 2, "pp": 2, "nmicros": 12}, 0),    # dp 4 folded, 12 micro-batches from 3
    ("PASMegatron", 16, {"tp": 2, "pp": 2, "nmicros": 16, "nvirtual": 2}, 0),   # interleaved: from 6
    ("PASHybrid", 16, {"tp": 2}, 1),                              # ZeRO shards over the real 8 replicas
    ("PASMegatron", 16, {"tp": 2, "pp": 2, "nmicros": 12}, 2),
    ("PASData", 16, {}, 3),                                       # ZeRO-3: parameter chunks of 16 replicas
    ("PASMegatron", 16, {"tp": 2, "pp": 2, "nmicros": 12}, 3),
    ("PASMegatron", 32, {"tp": 2, "pp": 2, "cp": 2, "nmicros": 6}, 1),   # dp 8 folded to 2 context pairs
])
def test_symmetric_simulation_equals_the_full_one(policy, world, options, zero):
    model, batch = _gpt()
    kw = dict(costs=DeviceCosts(A100, "bf16"), comm=ClusterComm(A100), precision="bf16", options=options,
              zero=zero)
    full = simulate_policy(model, batch, policy, world, **kw)
    sym = simulate_policy(model, batch, policy, world, symmetric=True, **kw)
    assert sym.fold.folded and len(sym.ranks) < len(full.ranks) / 4
    assert sym.step_time == pytest.approx(full.step_time, rel=0.01)
    assert sym.peak_memory == pytest.approx(full.peak_memory, rel=0.02)
    assert sym.model_flops == pytest.approx(full.model_flops, rel=1e-9) and full.model_flops > 0
    if "nmicros" in options and "cp" not in options:   # context parallel: every micro-batch simulated
        assert sym.micro == (6 if "nvirtual" in options else 3, options["nmicros"])


@pytest.mark.parametrize("options", [
    {"tp": 2, "pp": 2, "nmicros": 8, "nvirtual": 2, "recompute": "all"},   # interleaved, recompute runs
    {"tp": 1, "pp": 2, "nmicros": 6, "schedule_name": "zbv"},              # split backward: W actions
])
def test_replayed_actions_build_the_programs_action_by_action(options, monkeypatch):
    import importlib
    from cube.sim import replay
    sim_mod = importlib.import_module("cube.sim.simulate")   # the module (cube.sim.simulate is also the function)
    built, calls = {}, {"replayed": 0}
    build, replay_one = sim_mod.build_programs, replay.Replays.replay

    def keep(*args, **kw):
        programs = build(*args, **kw)
        built[replay.Replays.enabled] = {r: [(i.op, i.dur, i.key, i.group, i.label, i.cat, i.nbytes,
                                              {k: v for k, v in i.mem.items() if v}) for i in p.ins]
                                         for r, p in programs.items()}
        return programs

    def counted(self, *args):
        done = replay_one(self, *args)
        calls["replayed"] += done
        return done

    monkeypatch.setattr(sim_mod, "build_programs", keep)
    monkeypatch.setattr(replay.Replays, "replay", counted)
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(replay.Replays, "enabled", enabled)
        model, batch = _gpt(batch=48)
        results[enabled] = simulate_policy(model, batch, "PASMegatron", 8, costs=DeviceCosts(A100, "bf16"),
                                           comm=ClusterComm(A100), precision="bf16", options=options)
    assert calls["replayed"] > 0
    assert built[True] == built[False]
    assert results[True].step_time == results[False].step_time
    assert results[True].peak_memory == results[False].peak_memory


SPEC = '''
import torch
from examples.gpt.model import GPT, GPTConfig


def build():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=51200, block_size=2048, n_layer=24, n_head=16, n_embd=2048))
    ids = torch.zeros(256, 2048, dtype=torch.long, device="meta")
    return model, (ids, ids)
'''


def test_command_line_predicts_a_cluster_as_json(tmp_path, capsys):
    from cube.sim.__main__ import main
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    args = [str(spec), "--hardware", "dgx-a100-80g", "--ngpus", "256", "--policy", "PASMegatron",
            "--option", "tp=8", "--option", "pp=4", "--option", "nmicros=32", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["hardware"] == "dgx-a100-80g" and out["ngpus"] == 256 and out["precision"] == "bf16"
    assert out["step_time_s"] > 0 and out["peak_memory_gib"] > 0 and out["seconds"] > 0
    assert 0 < out["mfu"] < 1 and out["tflops_per_device"] == pytest.approx(out["mfu"] * 312, rel=1e-6)
    assert out["symmetry"]["mesh"] == {"pp": 4, "dp": 8, "tp": 8}
    assert out["micro_batches"] == {"simulated": 5, "real": 32}
    rank = next(iter(out["ranks"].values()))
    assert {"compute_s", "comm_s", "bubble_s", "peak_memory_gib"} <= set(rank)
    assert rank["compute_s"] + rank["comm_s"] + rank["bubble_s"] == pytest.approx(rank["end_s"], rel=1e-6)
    with pytest.raises(SystemExit):
        main([str(spec), "--hardware", "nope", "--ngpus", "8", "--policy", "PASData"])


def test_calibrate_fits_a_profile_the_simulator_uses(tmp_path, capsys):
    from cube.sim.calibrate import fit_curve, main
    peak, half = fit_curve([(1e9, 2e-3), (2e9, 3e-3), (4e9, 5e-3)])   # t = (f + 1e9) / 1e12
    assert peak == pytest.approx(1e12) and half == pytest.approx(1e9)
    with pytest.raises(ValueError, match="do not grow"):
        fit_curve([(1e9, 2e-3), (2e9, 1e-3)])
    out = tmp_path / "here.json"
    assert main(["--out", str(out), "--quick", "--no-calibrate"]) == 0
    hw = hardware.load(out)
    assert hw.name == "here" and hw.device["peak_tflops"] and hw.memory_rate > 0
    assert 0 < hw.device["efficiency"]["memory"] <= 1   # elementwise ops against the copy
    got = json.loads(out.read_text())["measurements"]
    assert got["gemm"] and set(got["elementwise_bytes_per_s"]) == {"add", "mul", "gelu"}
    model, batch = _gpt(layers=2, batch=8, device="cpu")
    res = simulate_policy(model, batch, "PASData", 2, costs=DeviceCosts(hw, next(iter(hw.device["peak_tflops"]))),
                          comm=ClusterComm(hw))
    assert res.step_time > 0
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x.txt")])


def test_cluster_search_ranks_plans_under_the_memory_cap(capsys):
    from cube.sim.cluster_search import Plan, search, static_bytes, table
    model, batch = _gpt(batch=64)
    given = Plan(tp=2, pp=2, dp=4, micro_batch=1, nmicros=16, nvirtual=2)   # PASMegatron's plan to beat
    lines = []
    ranked = search(model, batch, 16, A100, budget=5, include=[given], progress=lines.append)
    assert 1 < len(ranked) <= 5 and len(lines) == len(ranked)
    assert [t.rank_key() for t in ranked] == sorted(t.rank_key() for t in ranked)
    mine = next(t for t in ranked if t.plan == given)
    assert mine.origin == "given" and mine.feasible   # a small GPT fits an A100 whatever the plan
    assert ranked[0].feasible and ranked[0].step_time <= mine.step_time
    assert len({t.plan for t in ranked}) == len(ranked)
    assert all(t.plan.tp <= A100.gpus_per_node and t.plan.tp * t.plan.pp * t.plan.dp == 16 for t in ranked)
    text = table(ranked, 16)
    assert ranked[0].plan.name in text.splitlines()[1] and len(text.splitlines()) == len(ranked) + 1

    # a cap between the plans' peaks: those above it rank last, marked; nothing over it statically is simulated
    peaks = sorted(t.peak for t in ranked if t.result is not None)
    cap = (peaks[0] + peaks[-1]) / 2
    params = sum(p.numel() for p in model.parameters())
    capped = search(model, batch, 16, A100, mem_cap=cap, budget=4, progress=lambda line: None)
    assert all(t.feasible == (t.peak <= cap) for t in capped if t.result is not None)
    assert capped[0].feasible and capped[0].peak <= cap
    assert all(static_bytes(params, 4, t.plan) <= cap for t in capped)
    over = [k for k, t in enumerate(capped) if not t.feasible]
    assert all(k > j for k in over for j, t in enumerate(capped) if t.feasible)
    with pytest.raises(ValueError, match="'cpu-host' is this host; pass a cluster profile"):
        search(model, batch, 16, hardware.load("cpu-host"))
    with pytest.raises(ValueError, match="budget=0 simulates nothing"):
        search(model, batch, 16, A100, budget=0)


def test_cluster_search_from_the_command_line(tmp_path, capsys):
    from cube.sim.__main__ import main
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC.replace("n_layer=24", "n_layer=4").replace("256, 2048", "64, 2048"))
    assert main([str(spec), "--hardware", "dgx-a100-80g", "--ngpus", "32", "--search", "--budget", "3"]) == 0
    captured = capsys.readouterr()
    assert "best: tp" in captured.out and "--policy PASMegatron --option tp=" in captured.out
    assert captured.err.count("/3] tp") == 3   # one progress line per simulated plan
    assert "tokens/s per device, MFU" in captured.out and "runs on nccl" in captured.out
    assert re.search(r"3 plans simulated in [\d.]+ s", captured.out), captured.out
    with pytest.raises(SystemExit):
        main([str(spec), "--hardware", "dgx-a100-80g", "--ngpus", "32", "--search", "--budget", "0"])
    with pytest.raises(SystemExit):
        main([str(spec), "--hardware", "dgx-a100-80g", "--ngpus", "32", "--search", "--budget-s", "0"])


def test_a_simulated_plan_says_its_throughput_and_what_it_assumed(tmp_path, capsys):
    from cube.sim.__main__ import main
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC.replace("n_layer=24", "n_layer=4").replace("256, 2048", "64, 2048"))
    assert main([str(spec), "--hardware", "dgx-a100-80g", "--ngpus", "16", "--policy", "PASMegatron",
                 "--option", "tp=4", "--option", "pp=2", "--option", "nmicros=4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"throughput: [\d.]+ TFLOP/s per device, MFU [\d.]+% of dgx-a100-80g's bf16 peak", out), out
    assert re.search(r"assumed: 16 devices of dgx-a100-80g, policy PASMegatron, precision bf16, no ZeRO, recompute "
                     r".*, micro-batches 4.*tp=4, pp=2", out), out


def test_the_cluster_search_tries_every_schedule_and_each_one_is_a_policy_option():
    """ZB-H1, ZB-V and DualPipeV are moves of the climb; a V schedule holds two stages per pipeline
    rank (so at most half the blocks' ranks), and DualPipeV at least 2 pp micro-batches."""
    from cube.sim.cluster_search import Space, moves
    space = Space(world=64, batch=128, layers=8, node=8)
    base = space.plan(tp=1, pp=4, micro_batch=1)
    got = {what: p for what, p, _ in moves(space, base) if what.startswith("schedule ")}
    assert set(got) == {"schedule zb-h1", "schedule zbv", "schedule dualpipev"}
    assert got["schedule dualpipev"].options()["schedule_name"] == "dualpipev"
    assert "dualpipev" in got["schedule dualpipev"].name and "--option schedule_name=dualpipev" in \
        got["schedule dualpipev"].command()
    assert space.plan(tp=1, pp=8, micro_batch=1, schedule="zbv") is None        # 16 stages > 8 blocks
    assert space.plan(tp=1, pp=4, micro_batch=2, schedule="dualpipev") is None  # 4 micro-batches < 8 stages
    assert space.plan(tp=1, pp=4, micro_batch=2, schedule="zbv") is not None
    assert space.plan(tp=8, pp=1, micro_batch=1, schedule="zb-h1") is None   # no pipeline: 1F1B only


def test_bf16_runtime_is_priced_as_megatron_runs_it():
    """``precision="bf16"`` runs the forward in the weights' dtype (cube.passes.precision): priced
    as cube's runtime runs it, a Megatron-LM GPT layer stack (tp 2, pp 2, interleaved, recompute) is
    within 5% of the step priced as Megatron-LM runs it (``half_model``: every activation bf16): the
    only cast it pays, and all the difference, is the logits' widening before the loss (3.4% here,
    with 4 layers of hidden 2048 beside a 51200-word vocabulary; 0.1% on Table 1's rows)."""
    from benchmarks.cluster_sim import megatron_gpt
    from cube.ir.operator import IRFwOperation
    from cube.compiler import plan
    from cube.sim.precision import run_dtypes
    options = {"tp": 2, "pp": 2, "nmicros": 4, "nvirtual": 2, "recompute": "all"}
    steps = {}
    for half_model in (True, False):
        model, batch = megatron_gpt(4, 2048, 16, 8)
        steps[half_model] = simulate_policy(model, batch, "PASMegatron", 8, costs=DeviceCosts(A100, "bf16", half_model),
                                            comm=ClusterComm(A100), precision="bf16", options=options).step_time
    assert 1.0 < steps[False] / steps[True] <= 1.05, steps
    model, batch = megatron_gpt(2, 512, 8, 8)
    graph = plan(model, batch, "PASMegatron", 8, options=options, precision="bf16").graph
    dtypes, casts = run_dtypes(graph, "bf16")
    roots = {id(op.root): op.root for op in graph.select(ntype=IRFwOperation)}
    assert {roots[k].name for k in casts} == {"cross_entropy_loss"}
    floats = {dtypes.get(id(o)) for r in roots.values() for o in r.outputs
              if o.dtype.is_floating_point and r.name != "cross_entropy_loss"}
    assert floats == {torch.bfloat16}


def test_zero3_folds_to_one_rank_at_4096_and_shards_its_state_over_all_of_them():
    """A ZeRO-3 plan on 4096 ranks is simulated as 2 replicas, one of them simulated; its optimizer
    state (AdamW's moments and the float32 main parameters: 12 bytes per parameter) and parameter
    chunks are cut over all 4096 ranks, not over the 2 simulated."""
    import time
    model, batch = _gpt(layers=2, batch=4096)
    params = sum(p.numel() for p in model.parameters())
    kw = dict(costs=DeviceCosts(A100, "bf16"), comm=ClusterComm(A100), precision="bf16", symmetric=True)
    t0 = time.perf_counter()
    z3 = simulate_policy(model, batch, "PASData", 4096, zero=3, **kw)
    assert time.perf_counter() - t0 < 30
    assert z3.fold.real == (4096,) and z3.fold.shape == (2,) and len(z3.ranks) == 1
    state = next(iter(z3.ranks.values())).breakdown["optimizer"]
    assert state == pytest.approx(12 * params / 4096, rel=0.05)
    z0 = simulate_policy(model, batch, "PASData", 4096, zero=0, **kw)
    assert next(iter(z0.ranks.values())).breakdown["optimizer"] == pytest.approx(12 * params, rel=0.01)
    # the gathers and reduce-scatters over 4096 ranks in 512 nodes cost more than the all-reduces
    # they replace hide
    assert z3.step_time > z0.step_time


def test_the_cluster_search_moves_over_zero_stages_context_and_expert_parallel():
    """ZeRO 0-3 (fully sharded data parallel against 3D), context parallel (the sequence cut over
    data parallel neighbours) and, for a model with experts, expert parallel are moves; each is a
    PASMegatron option or the plan's ZeRO stage."""
    from cube.sim.cluster_search import Space, moves
    space = Space(world=64, batch=128, layers=8, node=8, seq=2048)
    base = space.plan(tp=2, pp=2, micro_batch=1)
    got = {what: p for what, p, _ in moves(space, base)}
    assert {got[f"zero {z}"].zero for z in (1, 2, 3)} == {1, 2, 3}
    assert "--zero 3" in got["zero 3"].command()
    cp = got["more context parallel"]
    assert cp.cp == 2 and cp.options()["cp"] == 2 and "cp2" in cp.name and got["less context parallel"] is None
    assert cp.nmicros == 2 * base.nmicros   # a context parallel pair shares its samples: twice the micro-batches
    assert not any(w.endswith("expert parallel") for w in got)   # no experts: no expert parallel
    moe = Space(world=64, batch=128, layers=8, node=8, seq=2048, experts=8)
    ep = {what: p for what, p, _ in moves(moe, moe.plan(tp=1, pp=1, micro_batch=1))}["more expert parallel"]
    assert ep.ep == 2 and ep.options()["ep"] == 2
    assert moe.plan(tp=1, pp=1, micro_batch=1, ep=16) is None                # 16 does not divide 8 experts
    assert space.plan(tp=1, pp=1, micro_batch=1, cp=2, ep=2) is None         # not both (PASMegatron)
    assert Space(world=64, batch=128, layers=8, node=8, seq=6).plan(tp=1, pp=1, micro_batch=1, cp=4) is None


def test_the_cluster_search_keeps_to_its_wall_clock_budget_and_reports_throughput(capsys):
    from cube.sim.__main__ import main
    from cube.sim.cluster_search import search, table
    model, batch = _gpt(batch=64)
    lines = []
    ranked = search(model, batch, 16, A100, budget=50, budget_s=1e-3, progress=lines.append)
    assert len(ranked) == 1   # the first plan is always simulated; none after the budget is spent
    best = ranked[0]
    tokens = 64 * 128
    assert best.tokens_per_s == pytest.approx(tokens / best.step_time / 16)
    assert best.mfu == pytest.approx(best.result.model_flops / best.step_time / 16 / A100.peak_flops("bf16"))
    assert best.runs_on == "nccl" and " nccl " in table(ranked, 16).splitlines()[1]
    with pytest.raises(ValueError, match="budget_s=0 leaves no time"):
        search(model, batch, 16, A100, budget_s=0)


def _mixtral(layers=1, batch=8, seq=128):
    """A Mixtral-shaped MoE (Hugging Face's, 8 experts, 2 per token) small enough to trace in seconds."""
    pytest.importorskip("transformers")
    from benchmarks.mixtral import build
    return build(layers=layers, batch=batch, seq=seq, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=1000)


def _expert_numel(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.ndim >= 3)   # the (E, ., .) expert weights


@pytest.mark.slow   # building and tracing Hugging Face's Mixtral takes 10-40 s here; the FLOP test below is fast
def test_expert_parallel_prices_the_all_to_alls_from_the_token_counts_and_cuts_expert_memory():
    """Under ``ep`` each MoE layer's rows go to the ranks holding their experts by an all-to-all and
    come back by another (forward, and their adjoints in backward): each takes this rank's (token,
    expert) rows, tokens x experts per token x hidden x the rows' bytes, after the per-expert counts
    (one integer per expert). Each rank holds ``1/ep`` of the expert weights and of their state."""
    model, batch = _mixtral()
    cfg = model.model.config
    world, tokens = 4, batch[0].numel()
    per_rank = tokens // world * cfg.num_experts_per_tok * cfg.hidden_size * 4   # float32 rows, as traced
    kw = dict(costs=DeviceCosts(A100, "bf16"), comm=ClusterComm(A100), precision="bf16")
    held, traces = {}, {}
    for ep in (1, 2, 4):
        res = simulate_policy(model, batch, "PASMegatron", world, options={"tp": 1, "pp": 1, "nmicros": 1, "ep": ep},
                              traces=traces, **kw)
        sent = sorted((e.nbytes, e.cat) for e in res.events if e.rank == 0 and e.thread == "comm"
                      and e.name.startswith("all_to_all"))
        layers = cfg.num_hidden_layers
        want = [] if ep == 1 else sorted([(8 * cfg.num_local_experts, "forward")] * layers
                                         + [(per_rank, "forward")] * 2 * layers + [(per_rank, "backward")] * 2 * layers)
        assert sent == want, (ep, sent)
        held[ep] = res.memory[0][0][1]   # rank 0 at the start of the step: parameters and optimizer state
    numel, experts = sum(p.numel() for p in model.parameters()), _expert_numel(model)
    per_param = held[1] / numel   # every parameter whole at ep=1 (and a few buffers)
    assert held[1] - held[2] == pytest.approx(per_param * experts / 2, rel=1e-3)
    assert held[2] - held[4] == pytest.approx(per_param * experts / 4, rel=1e-3)


def test_the_experts_grouped_matmuls_are_priced_by_their_flops():
    from cube.ir.ops import flops
    rows, d, f, e = 512, 64, 128, 8
    assert flops("grouped_mm_fallback", [(rows, d), (e, d, 2 * f), (e,)], [(rows, 2 * f)]) == 2 * rows * d * 2 * f
    fused = flops("moe_experts", [(rows // 2,), (rows // 2, d), (rows,), (e // 2, 2 * f, d), (e // 2, d, f)], [(rows, d)])
    assert fused == 2 * rows * (2 * f * d + d * f)   # every (token, expert) row through both expert weights


@pytest.mark.slow
def test_a_busier_expert_parallel_rank_slows_the_step_monotonically():
    """``moe_imbalance``: the busiest rank of an expert parallel group receives that many times the
    mean rows; its all-to-alls and experts grow by it, and so does the step."""
    model, batch = _mixtral(layers=2, batch=64, seq=256)
    traces, steps = {}, []
    for f in (1.0, 1.2, 1.5, 2.0):
        res = simulate_policy(model, batch, "PASMegatron", 16, costs=DeviceCosts(A100, "bf16", moe_imbalance=f),
                              comm=ClusterComm(A100), precision="bf16", symmetric=True, traces=traces,
                              options={"tp": 1, "pp": 1, "nmicros": 1, "ep": 4})
        steps.append(res.step_time)
    assert steps == sorted(steps) and len(set(steps)) == len(steps), steps
    with pytest.raises(ValueError, match="moe_imbalance=0.9: the busiest rank"):
        DeviceCosts(A100, "bf16", moe_imbalance=0.9)


@pytest.mark.slow
@pytest.mark.parametrize("ep,zero", [(2, 0), (4, 1)])
def test_expert_parallel_pipelines_extrapolate_their_micro_batches(ep, zero):
    """An ``ep`` pipeline given more micro-batches than its steady state needs is simulated with
    ``pp + 1`` and extended (``cube.sim.symmetry``): within 1% of simulating every rank and every
    micro-batch."""
    model, batch = _mixtral(layers=4, batch=64, seq=256)
    options = {"tp": 1, "pp": 2, "ep": ep, "nmicros": 8}
    kw = dict(costs=DeviceCosts(A100, "bf16"), comm=ClusterComm(A100), precision="bf16", options=options, zero=zero)
    full = simulate_policy(model, batch, "PASMegatron", 16, **kw)
    sym = simulate_policy(model, batch, "PASMegatron", 16, symmetric=True, **kw)
    assert sym.micro == (3, 8) and len(sym.ranks) < len(full.ranks)
    assert sym.step_time == pytest.approx(full.step_time, rel=0.01)
    assert sym.peak_memory == pytest.approx(full.peak_memory, rel=0.02)


@pytest.mark.slow
def test_the_cluster_search_tries_expert_parallel_on_a_moe_model():
    from cube.sim.cluster_search import search
    model, batch = _mixtral(layers=2, batch=64, seq=256)
    ranked = search(model, batch, 16, A100, budget=4, progress=lambda line: None)
    eps = [t for t in ranked if t.plan.ep > 1 and t.result is not None]
    assert eps and all(0 < t.step_time < 10 and t.tokens_per_s > 0 for t in eps), [t.plan.name for t in ranked]


def test_moe_imbalance_on_the_command_line_is_checked(tmp_path, capsys):
    from cube.sim.__main__ import main
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC)
    with pytest.raises(SystemExit):
        main([str(spec), "--hardware", "dgx-a100-80g", "--ngpus", "8", "--policy", "PASData", "--moe-imbalance", "0.5"])
    assert "--moe-imbalance 0.5: the busiest rank receives at least the mean rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):   # this host's costs are measured: no cluster's MoE layers to price
        main([str(spec), "--ngpus", "8", "--policy", "PASData", "--moe-imbalance", "1.2"])
    assert "--moe-imbalance prices a cluster's MoE layers: pass --hardware" in capsys.readouterr().err
