"""``python -m tests.fuzz.worker``: runs plans read from stdin, one JSON request a line.

A request is ``{"model": name, "seed": int}``. The answer is one stdout line,
``@@fuzz-result {json}`` (see ``tests.fuzz.oracle.Result``); anything else the
run prints goes to stderr so it cannot be mistaken for an answer.
"""
from __future__ import annotations

import json
import logging
import sys
import traceback
import warnings


def main() -> int:
    from tests.fuzz.oracle import run
    from tests.fuzz.pool import MARK
    out = sys.stdout
    sys.stdout = sys.stderr   # stray prints of a plan must not reach the answer channel
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            res = run(req["model"], req["seed"]).to_dict()
        except Exception:   # outside the rank threads: the harness itself failed on this plan
            res = {"model": req["model"], "seed": req["seed"], "outcome": "crash", "category": "harness",
                   "detail": traceback.format_exc()[-3000:], "plan": "", "seconds": 0.0}
        out.write(MARK + json.dumps(res) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
