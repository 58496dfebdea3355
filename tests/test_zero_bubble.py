"""Zero-bubble pipelines (ZB-H1, ZB-V): schedules as data, the split backward, parity with eager.

The parity cases train on in-process ranks and compare the loss and every parameter piece after
each step with the plain model trained on the same global batch (``tests.inprocess.parity``).
"""
import functools

import pytest
import torch

from cube.schedule import Schedule, custom, sched_1f1b, sched_zb_h1, sched_zbv, validate
from cube.schedule.schedules import Action
from cube.policies.pipeline import PASZBH1, PASZBV
from tests.inprocess import assert_exact, parity
from tests.models import build


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 5), (4, 2)])
def test_zb_h1_reaches_its_bound_and_keeps_1f1b_memory(p, m):
    s = sched_zb_h1(None, m, p)
    assert s.splits_backward and s.name == "zb-h1"
    # unit-time F, B, W: every rank works 3m steps; the fill and drain cost (p - 1)(F + B - W) = p - 1
    if m >= p:
        assert s.steps() == 3 * m + p - 1
    # 1F1B with a whole backward (B + W) per step: 3 (m + p - 1) unit steps
    assert s.steps() < 3 * (m + p - 1)
    for r, acts in enumerate(s.ranks):   # micro-batches between F and W never exceed 1F1B's p
        held = peak = 0
        for a in acts:
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak <= p


@pytest.mark.parametrize("n,m", [(2, 4), (2, 8), (4, 8)])
def test_zbv_places_stages_in_a_v_and_nearly_fills_the_pipeline(n, m):
    s = sched_zbv(None, m, 2 * n)
    assert [s.rank_of(k) for k in range(2 * n)] == list(range(n)) + list(reversed(range(n)))
    assert s.stages_of(0) == [0, 2 * n - 1]
    work = 6 * m   # two stages' F, B and W per micro-batch on each rank
    assert s.steps() <= work + n   # the bubble is at most one unit per rank
    for acts in s.ranks:
        held = peak = 0
        for a in acts:
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        assert peak <= 2 * n   # 1F1B's memory: n micro-batches of a rank's whole layers


def test_a_w_before_its_b_is_a_deadlock_shown_on_the_grid():
    with pytest.raises(ValueError, match=r"deadlocks .* W0.s0 waits for \[.B0.s0.\]"):
        custom(None, 1, 2, [["F0", "W0", "B0"], ["F0", "B0", "W0"]])


def test_a_split_schedule_must_list_every_w():
    with pytest.raises(ValueError, match=r"rank 1 misses \['W1.s1'\]"):
        custom(None, 2, 2, [["F0", "F1", "B0", "W0", "B1", "W1"], ["F0", "B0", "W0", "F1", "B1"]])


def test_bad_entries_and_placements_are_clear_errors():
    with pytest.raises(ValueError, match="write F<micro>, B<micro> or W<micro>"):
        custom(None, 1, 1, [["F0", "X0"]])
    with pytest.raises(ValueError, match="nstages .* must be even"):
        sched_zbv(None, 4, 3)
    bad = Schedule(2, 1, [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 1, 0), Action("B", 1, 0)]],
                   "custom", placement=(0, 0))
    with pytest.raises(ValueError, match="placement"):
        validate(bad)


def test_schedules_print_as_action_lists():
    text = str(sched_zb_h1(None, 4, 2))
    assert "rank 0: F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3" in text
    assert str(sched_1f1b(None, 4, 2)).count("W") == 0
    assert "F0.s3" in str(sched_zbv(None, 4, 4))


def test_generated_code_defers_the_weight_gradients_of_linear_layers_only():
    from cube.compiler import generate_code
    model, sample = build("gpt4_nobias")
    batch = tuple(torch.cat([t] * 4) for t in sample)
    src = generate_code(model, batch, functools.partial(PASZBH1, nmicros=4), world_size=2)
    assert "runtime.zb.linear(" in src[1] and "aten.linear.default(" not in src[1]
    assert "aten.layer_norm.default(" in src[1]   # other parameters' gradients stay in B
    # nobody waits for the first stage's input gradients: its backward stays whole
    assert "runtime.zb" not in src[0] and "aten.linear.default(" in src[0]
    plain = generate_code(model, batch, "cube.policies.pipeline:PAS1F1B", world_size=2)
    assert not any("runtime.zb" in s for s in plain.values())


@pytest.mark.parametrize("kind", ["linear", "matmul", "addmm"])
def test_the_split_backward_equals_autograd(kind):
    from cube.runtime import zb
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True) if kind != "addmm" else torch.randn(15, 8, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(6, 8) if kind == "linear" else torch.randn(8, 6))
    b = torch.nn.Parameter(torch.randn(6)) if kind != "matmul" else None
    plain = {"linear": lambda x, w, b: torch.nn.functional.linear(x, w, b), "matmul": lambda x, w, b: x @ w,
             "addmm": lambda x, w, b: torch.addmm(b, x, w)}[kind]
    split = {"linear": lambda x, w, b: zb.linear(x, w, b), "matmul": lambda x, w, b: zb.matmul(x, w),
             "addmm": lambda x, w, b: zb.addmm(b, x, w)}[kind]
    params = [t for t in (w, b) if t is not None]
    ref = [t.detach().clone().requires_grad_() for t in (x, w, b) if t is not None]
    plain(*ref, *([] if b is not None else [None])).pow(2).sum().backward()
    with zb.collecting() as work:
        split(x, w, b).pow(2).sum().backward()
    assert torch.allclose(x.grad, ref[0].grad, rtol=1e-6)
    assert all(p.grad is None for p in params) and len(work) == 1   # B left the weights to W
    zb.apply(work)
    for p, r in zip(params, ref[1:]):
        assert torch.allclose(p.grad, r.grad, rtol=1e-5, atol=1e-6)
    assert not work


PARITY = [
    # (policy, world, micro-batches, optimizer, recompute)
    (PASZBH1, 2, 4, "adamw", False),
    (PASZBH1, 2, 8, "sgd", False),
    (PASZBH1, 4, 4, "sgd", False),
    (PASZBH1, 4, 8, "adamw", False),
    (PASZBH1, 2, 4, "adamw", "all"),   # blocks recomputed in B: their linears still leave W its work
    (PASZBV, 2, 4, "adamw", False),
    (PASZBV, 2, 8, "sgd", False),
]

# GPT-2 under SGD: its fused c_attn bias holds the key bias, whose gradient is zero by construction, so
# AdamW turns round-off into updates of size lr (tests/models.py), under 1F1B as much as under ZB-H1;
# c_attn is three projections (cube.trace.fused), so the key bias is a piece of its own holding
# only round-off after SGD, compared against a floor (param_floor)
HF = [("hf_gpt2", "runtime.zb.linear", "sgd"), ("hf_llama", "runtime.zb.linear", "adamw")]


@pytest.mark.multirank
@pytest.mark.parametrize("name,fn,opt", HF, ids=[c[0] for c in HF])
def test_zero_bubble_trains_hugging_face_models_like_eager(name, fn, opt):
    """GPT-2's Conv1D is an addmm with an (in, out) weight, run as linear(x, w.t(), b) on (batch, sequence)
    rows (cube.trace.rows): the deferred gradient is the parameter's own; Llama's projections are linears."""
    from cube.compiler import generate_code
    model, sample = build(name)
    plan = functools.partial(PASZBH1, nmicros=4)
    src = generate_code(model, tuple(torch.cat([t] * 4) for t in sample), plan, world_size=2)
    assert any(fn + "(" in s for s in src.values())
    assert_exact(parity(model, sample, plan, 2, steps=2, nmicros=4, opt=opt, param_floor=1e-3))


@pytest.mark.multirank
@pytest.mark.parametrize("policy,world,nmicros,opt,recompute", PARITY,
                         ids=[f"{c[0].__name__}-pp{c[1]}-m{c[2]}-{c[3]}" + ("-recompute" if c[4] else "")
                              for c in PARITY])
def test_zero_bubble_trains_like_eager(policy, world, nmicros, opt, recompute):
    model, sample = build("gpt4_nobias")
    plan = functools.partial(policy, nmicros=nmicros, recompute=recompute)
    assert_exact(parity(model, sample, plan, world, steps=3, nmicros=nmicros, opt=opt))


@pytest.mark.multirank
def test_zero_bubble_under_bf16_autocast_matches_1f1b():
    """Under autocast the deferred weight gradient is computed in the forward's dtype, as autograd
    does: ZB-H1 and 1F1B train the same bf16 model to the same parameters."""
    from cube.policies.pipeline import PAS1F1B
    model, sample = build("gpt4_nobias")
    a = parity(model, sample, functools.partial(PASZBH1, nmicros=4), 2, steps=2, nmicros=4, precision="bf16-autocast")
    b = parity(model, sample, functools.partial(PAS1F1B, nmicros=4), 2, steps=2, nmicros=4, precision="bf16-autocast")
    assert_exact(a, tol=1e-3)   # bf16-level differences from the float32 eager model (tests/test_precision.py)
    assert a == pytest.approx(b, rel=0.05, abs=1e-6)   # and the same as 1F1B's


def test_the_simulator_runs_w_actions_in_the_bubble():
    """Given costs (each linear: forward 1, backward 2, nothing else costs): ZB-H1 and ZB-V predict
    shorter steps than 1F1B on the same stages, as their W fill the drain."""
    from cube.sim import CommModel, FixedCosts
    from cube.sim.api import simulate_policy
    from cube.policies.pipeline import PAS1F1B
    model, sample = build("gpt4_nobias")
    batch = tuple(torch.cat([t] * 8) for t in sample)
    costs = FixedCosts(fw=0.0, bw=0.0, by_name={"linear": (1.0, 2.0)})
    kinds = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
    free = CommModel(alpha={k: 0.0 for k in kinds}, beta={k: 0.0 for k in kinds})

    def step(policy, world):
        return simulate_policy(model, batch, functools.partial(policy, nmicros=8), world, costs=costs,
                               comm=free).step_time

    base2, base4 = step(PAS1F1B, 2), step(PAS1F1B, 4)
    # every rank computes the same in all three: only the waiting differs
    assert step(PASZBH1, 4) < 0.9 * base4
    assert step(PASZBV, 2) < step(PASZBH1, 2) < base2


def test_zbv_stages_placed_round_robin_are_a_clear_error():
    from cube import schedule
    from cube.compiler import generate_code
    from cube.policies.pipeline import _pipeline

    def round_robin(graph, resource):   # interleaved placement (stage k on device k % 2) under ZB-V
        return _pipeline(graph, resource, lambda g, m: schedule.sched_zbv(g, m, 4), None, 4, False, nvirtual=2)

    model, sample = build("gpt4_nobias")
    batch = tuple(torch.cat([t] * 4) for t in sample)
    with pytest.raises(ValueError, match=r"zbv schedule runs stages \[0, 3\] together .*0->0, 1->1, 2->1, 3->0"):
        generate_code(model, batch, round_robin, world_size=2)


MEGATRON = [("zb-h1", "sgd"), ("zbv", "sgd")]


@pytest.mark.multirank
@pytest.mark.parametrize("name,opt", MEGATRON, ids=[c[0] for c in MEGATRON])
def test_megatron_pp2_tp2_with_zero_bubble_trains_like_eager(name, opt):
    """Tensor parallel inside the stages: the column and row pieces' weight gradients wait for W too."""
    from cube.policies.megatron3d import PASMegatron
    model, sample = build("gpt4_nobias")
    plan = functools.partial(PASMegatron, tp=2, pp=2, nmicros=4, schedule_name=name)
    assert_exact(parity(model, sample, plan, 4, steps=2, nmicros=4, opt=opt))


def test_megatron_refuses_a_zero_bubble_schedule_with_other_virtual_stages():
    from cube.compiler import generate_code
    from cube.policies.megatron3d import PASMegatron
    model, sample = build("gpt4_nobias")
    batch = tuple(torch.cat([t] * 4) for t in sample)
    with pytest.raises(ValueError, match="schedule_name='zbv' runs 2 stage.*nvirtual=3"):
        generate_code(model, batch, functools.partial(PASMegatron, tp=1, pp=2, nvirtual=3, schedule_name="zbv"),
                      world_size=2)
    with pytest.raises(ValueError, match="unknown schedule_name 'dualpipe'"):
        generate_code(model, batch, functools.partial(PASMegatron, tp=1, pp=2, schedule_name="dualpipe"),
                      world_size=2)


SEARCHED = [{"dp": 2, "tp": 1, "pp": 2, "nmicros": 4, "schedule": "zb-h1"},
            {"dp": 1, "tp": 2, "pp": 2, "nmicros": 4, "schedule": "zbv"}]


@pytest.mark.multirank
@pytest.mark.parametrize("cfg", SEARCHED, ids=[c["schedule"] for c in SEARCHED])
def test_searched_zero_bubble_plans_train_like_eager(cfg):
    """``python -m cube.sim --search`` writes plans as ``cube.toolkit.grid_plan`` configs; the zero-bubble
    schedules are among them (ZB-V: ``2 pp`` stages in a V)."""
    from cube.sim.search import configs
    from cube.toolkit import grid_plan
    assert {"zb-h1", "zbv"} <= {c["schedule"] for c in configs(4, 16)}
    model, sample = build("gpt4_nobias")
    opt = "sgd" if cfg["tp"] > 1 else "adamw"   # tensor parallel: exact under SGD (tests/test_parallel.py)
    assert_exact(parity(model, sample, lambda g, r: grid_plan(g, r, cfg), 4, steps=2, nmicros=4, opt=opt))
