"""``python -m tests.fuzz.worker``: runs plans read from stdin, one JSON request a line.

A request is ``{"model": name, "seed": int}``, or ``{"model": name, "plan": source}``
with an explicit plan as ``Plan.literal()`` writes it. ``{"sleep": seconds}`` only
sleeps (how the tests check the parent's watchdog). The answer is one stdout line,
``@@fuzz-result {json}`` (see ``tests.fuzz.oracle.Result``); anything else the
run prints goes to stderr so it cannot be mistaken for an answer.
"""
from __future__ import annotations

import json
import logging
import sys
import time
import traceback
import warnings


def main() -> int:
    from tests.fuzz.oracle import run
    from tests.fuzz.plan import parse
    from tests.fuzz.pool import MARK
    out = sys.stdout
    sys.stdout = sys.stderr   # stray prints of a plan must not reach the answer channel
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if "sleep" in req:
            time.sleep(req["sleep"])
        try:
            plan = parse(req["plan"]) if req.get("plan") else None
            res = run(req["model"], req.get("seed"), plan).to_dict()
        except Exception:   # outside the rank threads: the harness itself failed on this plan
            res = {"model": req["model"], "seed": req.get("seed"), "outcome": "crash", "category": "harness",
                   "detail": traceback.format_exc()[-3000:], "plan": "", "seconds": 0.0}
        out.write(MARK + json.dumps(res) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
