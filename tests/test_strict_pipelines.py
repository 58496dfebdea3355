"""Every pipeline schedule under NCCL's matching rule (``CUBE_P2P_ORDER=strict``), and DualPipeV.

Under the strict rule a pair's messages match in the order they are posted, tags ignored. cube's
pipeline messages then travel on ordered channels (``cube.runtime.p2p.ordered``): each value with a
header naming it, read off a peer's channel in the order it was sent and kept until its reader asks.
Each schedule with several stages per rank (interleaved 1F1B, ZB-V, DualPipeV) consumes a
neighbour's messages in another order than that neighbour sends them; the parity cases show they
train exactly as the plain model on 2 and 4 in-process ranks, and the last case shows that without
the channels (receives matched by tag, as on gloo) the same step is caught crossing a pair.
"""
import functools

import pytest
import torch

from cube.runtime import p2p
from cube.schedule import sched_dualpipev, sched_zbv, validate
from cube.policies.pipeline import PAS1F1BInterleaved, PASDualPipeV, PASZBH1, PASZBV
from tests.inprocess import assert_exact, parity
from tests.models import build
from tests.tiers import tiered


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv("CUBE_P2P_ORDER", "strict")


@pytest.mark.parametrize("n,m", [(1, 2), (2, 4), (2, 7), (3, 6), (3, 9), (4, 8), (4, 13)])
def test_dualpipev_is_a_valid_v_schedule_with_1f1b_memory(n, m):
    s = sched_dualpipev(None, m, 2 * n)
    assert s.name == "dualpipev" and s.placement == tuple(min(k, 2 * n - 1 - k) for k in range(2 * n))
    assert s.splits_backward and validate(s)
    for r, acts in enumerate(s.ranks):
        held = peak = 0
        for a in acts:   # stage-micro-batches between their F and their W
            held += {"F": 1, "W": -1}.get(a.kind, 0)
            peak = max(peak, held)
        # at most 2n stage-micro-batches of half a rank's layers: 1F1B's n micro-batches of all of them,
        # and fewer on the later ranks
        assert peak <= 2 * n + 1, (r, peak, str(s))
    # unit-time F, B, W of half a rank's layers: every rank works 6m units; the bubble is no larger than
    # ZB-V's and smaller than 1F1B's on the same ranks (whole stages: F 2 units, B + W 4, 6(m + n - 1) in all)
    assert 6 * m <= s.steps() <= sched_zbv(None, m, 2 * n).steps()
    assert s.steps() < 6 * (m + n - 1) or n == 1


def test_dualpipev_pairs_a_forward_with_another_micro_batchs_backward():
    """In the steady phase each forward of one stage is followed by the backward of the rank's other
    stage on an earlier micro-batch: the pair DualPipe overlaps."""
    s = sched_dualpipev(None, 8, 4)
    acts = s.ranks[0]
    pairs = [(a, b) for a, b in zip(acts, acts[1:]) if a.kind == "F" and b.kind == "B" and a.stage != b.stage]
    assert len(pairs) >= 2 * (8 - 4 + 1) - 1   # the main phase's pairs, both directions of the V
    assert all(a.micro > b.micro for a, b in pairs)


def test_dualpipev_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"at least as many micro-batches as stages: nmicros \(3\) < nstages \(4\)"):
        sched_dualpipev(None, 3, 4)
    with pytest.raises(ValueError, match="two stages on each rank: nstages \\(3\\) must be even"):
        sched_dualpipev(None, 4, 3)


CASES = [
    # (schedule, policy, world, micro-batches, optimizer)
    ("interleaved", PAS1F1BInterleaved, 2, 4, "adamw"),
    ("interleaved", PAS1F1BInterleaved, 4, 4, "sgd"),
    ("zb-h1", PASZBH1, 2, 4, "sgd"),
    ("zb-h1", PASZBH1, 4, 4, "adamw"),
    ("zbv", PASZBV, 2, 4, "sgd"),
    ("zbv", PASZBV, 4, 8, "adamw"),
    ("dualpipev", PASDualPipeV, 2, 4, "adamw"),
    ("dualpipev", PASDualPipeV, 2, 6, "sgd"),
    ("dualpipev", PASDualPipeV, 4, 8, "sgd"),
    ("dualpipev", PASDualPipeV, 4, 8, "adamw"),
]
IDS = [f"{c[0]}-pp{c[2]}-m{c[3]}-{c[4]}" for c in CASES]
SLOW = ["dualpipev-pp4-m8-adamw"]   # dualpipev-pp4-m8-sgd runs the same plan in the default tier


@pytest.mark.multirank
@pytest.mark.parametrize("name,policy,world,nmicros,opt", tiered(CASES, IDS, SLOW))
def test_schedule_trains_like_eager_in_strict_order(strict, name, policy, world, nmicros, opt):
    model, sample = build("gpt4_nobias")
    plan = functools.partial(policy, nmicros=nmicros)
    assert_exact(parity(model, sample, plan, world, steps=2, nmicros=nmicros, opt=opt))


@pytest.mark.multirank
def test_megatron_dualpipev_with_tensor_parallel_in_strict_order(strict):
    """tp2 inside each of the V's stages, pp2: the tensor-parallel collectives and the pipeline's
    ordered channels on the same ranks."""
    from cube.policies.megatron3d import PASMegatron
    model, sample = build("gpt4_nobias")
    plan = functools.partial(PASMegatron, tp=2, pp=2, nmicros=4, schedule_name="dualpipev")
    assert_exact(parity(model, sample, plan, 4, steps=2, nmicros=4, opt="sgd"))


@pytest.mark.multirank
def test_hugging_face_llama_under_dualpipev_in_strict_order(strict):
    model, sample = build("hf_llama")
    plan = functools.partial(PASDualPipeV, nmicros=4)
    assert_exact(parity(model, sample, plan, 2, steps=2, nmicros=4, opt="adamw"))


@pytest.mark.multirank
def test_without_ordered_channels_strict_order_catches_the_crossed_pair(strict, monkeypatch):
    """The same interleaved step with receives matched by tag and posted ahead (what runs on gloo):
    its ranks post a pair's messages in other orders. The strict rule either pairs a receive with
    another message (and says which) or leaves every rank waiting (what NCCL would do; the in-process
    world names what each waits for)."""
    monkeypatch.setattr(p2p, "ordered", lambda: False)
    model, sample = build("gpt4_nobias")
    plan = functools.partial(PAS1F1BInterleaved, nmicros=4)
    with pytest.raises(Exception, match=r"CUBE_P2P_ORDER=strict: rank \d's receive of message \d+ .* meets that "
                                        r"rank's send of message \d+|every rank waits and none can go on: rank 0 "
                                        r"waits for message \d+ from rank 1"):
        parity(model, sample, plan, 2, steps=1, nmicros=4, opt="sgd")


def test_nccl_runs_every_schedule_on_ordered_channels(monkeypatch):
    """NCCL's backend turns the ordered channels on; no schedule is refused for it."""
    monkeypatch.delenv("CUBE_P2P_ORDER", raising=False)
    monkeypatch.setattr(p2p.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "nccl")
    assert p2p.ordered()
    monkeypatch.setattr(p2p.dist, "get_backend", lambda group=None: "gloo")
    assert not p2p.ordered()
    import inspect
    from cube.runtime import pipeline
    assert "NotImplementedError" not in inspect.getsource(pipeline)


def test_the_simulator_runs_dualpipev():
    from cube.sim import CommModel, FixedCosts
    from cube.sim.api import simulate_policy
    from cube.policies.pipeline import PAS1F1B
    model, sample = build("gpt4_nobias")
    batch = tuple(torch.cat([t] * 8) for t in sample)
    costs = FixedCosts(fw=0.0, bw=0.0, by_name={"linear": (1.0, 2.0)})
    kinds = ("p2p", "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
    free = CommModel(alpha={k: 0.0 for k in kinds}, beta={k: 0.0 for k in kinds})

    def step(policy):
        return simulate_policy(model, batch, functools.partial(policy, nmicros=8), 2, costs=costs,
                               comm=free).step_time

    assert step(PASDualPipeV) < step(PAS1F1B)
