"""Every wrong, crash or hang the plan fuzzer found, kept as a named test.

Each test runs one plan, from (model, seed) or an explicit shrunk plan
(``python -m tests.fuzz --shrink MODEL:SEED`` prints it), in a worker process
under a time limit, and asserts it trains exactly like the plain model. Bugs
in cube not fixed yet (``tests.fuzz.known.KNOWN``) are strict xfails naming the
bug: a fix turns them into unexpected passes, and then the entry goes.
"""
from __future__ import annotations

import pytest

from tests.fuzz.known import FOUND, KNOWN
from tests.fuzz.plan import Place, Plan
from tests.fuzz.pool import Worker

LIMIT = 180.0

# mlp seed 33 shrunk: stage 0 on device 0, stage 1 replicated on devices 1..3
REPLICATED_LATER_STAGE = Plan(
    ndev=4, schedule="1f1b", nmicros=1, groups=((0,), (1, 2, 3)), cuts=(0, 2), base=("rep", "rep"),
    data=(Place((0,)), Place((1, 2, 3), ((None, None, 3),))))

# mlp seed 65 shrunk: three GPipe stages on [3], [0] and [2, 1] (the last replicated)
REPLICATED_LAST_OF_THREE = Plan(
    ndev=4, schedule="gpipe", nmicros=1, groups=((3,), (0,), (2, 1)), cuts=(0, 3, 5), base=("rep", "rep", "rep"),
    data=(Place((3,)), Place((0,)), Place((1, 2), ((None, None, 2),))))

# mlp seed 69 shrunk: no schedule; the first linear replicated on devices 1..3, the rest on all four
NARROWER_PRODUCER = Plan(
    ndev=4, groups=((0, 1, 2, 3),), base=("rep",), data=(Place((0, 1, 2, 3), ((None, None, 4),)),),
    ops={0: Place((1, 2, 3), ((None, None, 3),))})

# hf_t5 seed 1115 shrunk (and without its one-stage GPipe schedule): plain data parallel on two devices
T5_BATCH_SPLIT = Plan(ndev=2, groups=((0, 1),), base=("dp",), data=(Place((0, 1), ((0, 0, 2),)),))

# mlp seed 1036 shrunk: the square split by features, the sum by batch (all-to-all between them)
SPLIT_DIM_CHANGE = Plan(
    ndev=2, groups=((1, 0),), base=("rep",), data=(Place((0, 1), ((None, None, 2),)),),
    ops={4: Place((0, 1), ((0, 1, 2),)), 5: Place((0, 1), ((0, 0, 2),))})

# hf_bart seed 5104 shrunk: the encoder's select read only for its shape (its output reaches no loss),
# placed over the devices in another order: the exchange moved a gradient that never came back
SHAPE_ONLY_READ = Plan(ndev=2, groups=((0, 1),), base=("dp",), data=(Place((0, 1), ((0, 0, 2),)),),
                       ops={14: Place((1, 0), ((0, 0, 2),))})

# gpt_nobias seed 100231 shrunk: the tied embedding replicated on 4 devices, the LM head split along the
# sequence on 2 of them, the attention's transpose split 4 ways (its backward all-gathers): the tied
# weight's gradient was ready at another point of backward on each rank, and its bucket's all-reduce,
# launched from there, met the all-gather of another rank
TIED_BUCKET_ORDER = Plan(
    ndev=4, groups=((0, 3, 1, 2),), base=("rep",), data=(Place((0, 1, 2, 3), ((None, None, 4),)),),
    ops={13: Place((0, 1, 2, 3), ((0, 2, 4),)), 45: Place((1, 3), ((0, 1, 2),))})

# mlp seed 100630 shrunk: tensor parallel on [2, 3, 0, 1], the last linear's reduction split over the
# devices in another order (ranks 1 and 3 swap their inputs point to point), everything recomputed:
# the transfer cut ranks 1 and 3's run in two, each re-run at its own point of backward, and their
# re-run collectives came in another order than on ranks 0 and 2
CUT_RECOMPUTE_RUN = Plan(
    ndev=4, schedule="1f1b", nmicros=1, groups=((2, 3, 0, 1),), base=("tp",),
    data=(Place((0, 1, 2, 3), ((0, 0, 4),)),), ops={3: Place((2, 1, 0, 3), ((0, 1, 4),))}, recompute=((0, 5),))

# gpt_nobias seed 100736 shrunk: two GPipe stages on [0, 3] and [2, 1]; the tied embedding split along
# its hidden dim over [0, 3] (each holds half the weight), the LM head replicated on [2, 1]: the
# tied weight's sum paired device 0 (half of it) with device 1 (all of it)
TIED_HALVES_AND_WHOLE = Plan(
    ndev=4, schedule="gpipe", nmicros=1, groups=((0, 3), (2, 1)), cuts=(0, 10), base=("rep", "rep"),
    data=(Place((0, 3), ((None, None, 2),)), Place((1, 2), ((None, None, 2),))), ops={1: Place((0, 3), ((0, 1, 2),))})

# like hf_bart seed 101874 (a hang) and hf_t5 seed 101553: the tied embedding replicated on stage 0's
# [1, 2] (copies: device 2's is dropped), the batch split over them, the LM head on device 0: what
# device 2 made from its dropped copy stopped needing a gradient, so its send carried no gradient
# back while device 0 returned one (a stash between two stages of a rank likewise kept a gradient)
DROPPED_TIED_COPY_SENT = Plan(
    ndev=3, schedule="1f1b", nmicros=2, groups=((1, 2), (0,)), cuts=(0, 10), base=("dp", "rep"),
    data=(Place((1, 2), ((0, 0, 2),)), Place((0,),)), ops={1: Place((1, 2), ((None, None, 2),))})


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.stop()


def _exact(worker: Worker, model: str, seed=None, plan: Plan = None) -> None:
    req = {"model": model, "seed": seed} if plan is None else {"model": model, "plan": plan.literal()}
    res = worker.ask(req, LIMIT)
    assert res["outcome"] == "exact", f"{res['outcome']} [{res['category']}]\n{res['plan']}\n{res['detail']}"


@pytest.mark.fuzz
def test_replicated_later_stage_keeps_earlier_stage_gradients(worker):
    _exact(worker, "mlp", plan=REPLICATED_LATER_STAGE)


@pytest.mark.fuzz
def test_split_dim_change_runs_in_the_in_process_world(worker):
    _exact(worker, "mlp", plan=SPLIT_DIM_CHANGE)


@pytest.mark.fuzz
def test_replicated_last_of_three_gpipe_stages_keeps_earlier_gradients(worker):
    _exact(worker, "mlp", plan=REPLICATED_LAST_OF_THREE)


@pytest.mark.fuzz
def test_value_replicated_on_fewer_devices_than_its_readers(worker):
    _exact(worker, "mlp", plan=NARROWER_PRODUCER)


@pytest.mark.fuzz
def test_t5_split_along_the_batch(worker):
    _exact(worker, "hf_t5", plan=T5_BATCH_SPLIT)


@pytest.mark.fuzz
def test_shape_only_read_moves_no_gradient(worker):
    _exact(worker, "hf_bart", plan=SHAPE_ONLY_READ)


@pytest.mark.fuzz
def test_tied_weight_summed_after_backward_meets_no_other_collective(worker):
    _exact(worker, "gpt_nobias", plan=TIED_BUCKET_ORDER)


@pytest.mark.fuzz
def test_recompute_run_cut_by_a_transfer_reruns_no_collective(worker):
    _exact(worker, "mlp", plan=CUT_RECOMPUTE_RUN)


@pytest.mark.fuzz
def test_tied_weight_held_in_halves_on_one_stage_and_whole_on_another(worker):
    _exact(worker, "gpt_nobias", plan=TIED_HALVES_AND_WHOLE)


@pytest.mark.fuzz
def test_value_made_from_a_dropped_tied_copy_still_returns_its_gradient(worker):
    _exact(worker, "gpt_nobias", plan=DROPPED_TIED_COPY_SENT)


def _found(model: str, seed: int):
    marks = [pytest.mark.fuzz]
    if (model, seed) in KNOWN:
        marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(model, seed)]))
    if model.startswith("hf_"):
        marks.append(pytest.mark.fuzz_slow)
    return pytest.param(model, seed, marks=marks, id=f"{model}-{seed}")


@pytest.mark.parametrize("model,seed", [_found(m, s) for m, s in sorted(FOUND)])
def test_fuzzed_plan(worker, model, seed):
    """Each plan the fuzzer found failing, from (model, seed) (``tests.fuzz.known.FOUND`` says which bug)."""
    _exact(worker, model, seed=seed)
