"""``python -m tests.fuzz``: the long tier of the plan fuzzer.

    python -m tests.fuzz --plans 2000 [--models mlp gpt_nobias ...] [--seed S] [--jobs J]
    python -m tests.fuzz --repro MODEL:SEED      # one plan, in this process, printed in full
    python -m tests.fuzz --shrink MODEL:SEED     # the smallest plan failing the same way, as a literal

Plans are spread over the models in turn (model ``k`` of ``m`` gets seeds
``S + k``, ``S + k + m``, ...), each run by a worker process under a time
limit. Prints the table of outcomes by model, refusals by category, and each
wrong, crash or hang with the command that reproduces it; exits 1 if there is any.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tests.fuzz.models import MODELS
from tests.fuzz.report import FAILURES, failures, table


def requests(models, plans: int, seed: int) -> list:
    """The (model, seed) requests of a run: ``plans`` of them, models in turn."""
    return [{"model": models[i % len(models)], "seed": seed + i} for i in range(plans)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plans", type=int, default=200)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes running plans at once")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds per plan before it is a hang")
    parser.add_argument("--json", type=Path, help="write every result to this file, one JSON line each as it comes")
    parser.add_argument("--repro", help="MODEL:SEED: run one plan here and print it")
    parser.add_argument("--shrink", help="MODEL:SEED: shrink a failing plan, print the smallest as a literal")
    args = parser.parse_args(argv)
    if args.shrink:
        return _shrink(args.shrink, args.limit)
    if args.repro:
        from tests.fuzz.oracle import run
        model, seed = args.repro.rsplit(":", 1)
        res = run(model, int(seed))
        print(f"{model} seed {seed}: {res.outcome} [{res.category}] in {res.seconds}s\n{res.plan}\n\n{res.detail}")
        return int(res.outcome in FAILURES)
    from tests.fuzz.pool import run_all
    start = time.monotonic()
    done = [0]

    if args.json:
        args.json.write_text("")

    def progress(res: dict) -> None:
        done[0] += 1
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(res) + "\n")
        if res["outcome"] in FAILURES or done[0] % 25 == 0:
            print(f"[{done[0]}/{args.plans} {time.monotonic() - start:.0f}s] {res['model']} seed {res['seed']}: "
                  f"{res['outcome']} {res['category']}", flush=True)

    results = run_all(requests(args.models, args.plans, args.seed), jobs=args.jobs, limit=args.limit,
                      on_result=progress)
    print(f"\n{len(results)} plans in {time.monotonic() - start:.0f}s\n")
    print(table(results))
    bad = failures(results)
    if bad:
        print("\nwrong / crash / hang (rerun each with the command below it):\n" + bad)
    return int(bool(bad))


def _shrink(spec: str, limit: float) -> int:
    from tests.fuzz.plan import parse
    from tests.fuzz.pool import Worker
    from tests.fuzz.shrink import shrink
    model, seed = spec.rsplit(":", 1)
    worker = Worker()
    first = worker.ask({"model": model, "seed": int(seed)}, limit)
    worker.stop()
    if first["outcome"] not in FAILURES or not first.get("literal"):
        print(f"{spec}: {first['outcome']} [{first['category']}]; nothing to shrink")
        return 0
    plan = shrink(model, parse(first["literal"]), first["outcome"], limit, log=print)
    worker = Worker()
    last = worker.ask({"model": model, "plan": plan.literal()}, limit)
    worker.stop()
    print(f"\n{spec}: {first['outcome']} [{first['category']}] shrinks to:\n{plan.literal()}\n\n{last['plan']}"
          f"\n\n{last['detail']}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
