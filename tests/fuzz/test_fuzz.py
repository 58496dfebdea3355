"""The fast tier of the plan fuzzer, and checks of the fuzzer itself.

``test_fast_tier`` runs ``FAST`` plans (fixed seeds, so CI sees the same plans
every run) on two worker processes and fails on any wrong, crash or hang
not listed in ``tests.fuzz.known``; refusals are allowed and reported.
The long tier is ``python -m tests.fuzz --plans 2000`` (see ``tests/fuzz/__main__.py``).
"""
from __future__ import annotations

import pytest

from tests.fuzz.draw import skeleton
from tests.fuzz.known import KNOWN
from tests.fuzz.oracle import category
from tests.fuzz.plan import Place, Plan, parse
from tests.fuzz.pool import Worker, run_all
from tests.fuzz.report import FAILURES, failures, table

FAST = [("mlp", s) for s in range(80)] + [("gpt_nobias", s) for s in range(30)]
SLOW = [("hf_llama", s) for s in range(12)] + [("hf_t5", s) for s in range(12)]
LIMIT = 120.0   # seconds per plan before it counts as a hang


def _no_new_failures(plans, limit: float) -> list:
    """Runs ``plans`` on two workers; fails on a wrong, crash or hang not in ``KNOWN``."""
    results = run_all([{"model": m, "seed": s} for m, s in plans], jobs=2, limit=limit)
    print("\n" + table(results))
    known = [r for r in results if r["outcome"] in FAILURES and (r["model"], r["seed"]) in KNOWN]
    new = [r for r in results if r["outcome"] in FAILURES and (r["model"], r["seed"]) not in KNOWN]
    if known:
        print("known failures (strict xfail in test_regressions.py):\n" + failures(known))
    assert len(results) == len(plans)
    assert not new, "\n" + failures(new) + "\n\n" + "\n\n".join(r["plan"] + "\n" + r["detail"] for r in new)
    return results


@pytest.mark.fuzz
def test_fast_tier():
    results = _no_new_failures(FAST, LIMIT)
    assert len(results) >= 100
    assert sum(r["outcome"] == "exact" for r in results) >= len(FAST) // 4, table(results)


@pytest.mark.fuzz
@pytest.mark.fuzz_slow
def test_hugging_face_models():
    results = _no_new_failures(SLOW, 2 * LIMIT)
    assert sum(r["outcome"] == "exact" for r in results) >= 1, table(results)


def test_a_plan_is_a_function_of_model_and_seed():
    assert skeleton("gpt_nobias", 7) == skeleton("gpt_nobias", 7)
    drawn = {repr(skeleton("mlp", s)) for s in range(40)}
    assert len(drawn) > 10   # the seeds do draw different plans


def test_a_plan_literal_rebuilds_the_plan():
    plan = Plan(ndev=3, schedule="1f1b", nmicros=2, groups=((2,), (0, 1)), cuts=(0, 4), base=("rep", "dp"),
                data=(Place((2,)), Place((1, 0), ((0, 0, 2),))), ops={5: Place((0, 1), ((1, 0, 2),))},
                recompute=((1, 3),))
    assert parse(plan.literal()) == plan
    text = plan.describe()
    assert "stage cuts at ops [0, 4]" in text and "op 5: split idx=1 dim=0 x2 over [0, 1]" in text


def test_refusals_are_categorized_from_their_message():
    assert category("op 'linear' reads x in a layout cube cannot produce from ...") == "layout cube cannot produce"
    assert category("illegal split of op 'view' at idx=0, dim=1: ...") == "annotation forbids split"
    assert category("something new entirely").startswith("other: something new")


def test_the_watchdog_kills_a_plan_past_its_limit_and_the_next_plan_runs():
    worker = Worker()
    try:
        hung = worker.ask({"sleep": 60, "model": "mlp", "seed": 0}, limit=5.0)
        assert hung["outcome"] == "hang" and hung["seed"] == 0
        assert worker.proc is None
        after = worker.ask({"model": "mlp", "seed": 0}, limit=LIMIT)
        assert after["outcome"] in ("exact", "refused"), after
        assert after["plan"].startswith(f"{skeleton('mlp', 0).ndev} devices")
    finally:
        worker.stop()
