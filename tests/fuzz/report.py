"""Tables of fuzz outcomes: by model and outcome, refusals by category, failures with their reproduction."""
from __future__ import annotations

from collections import Counter
from typing import Dict, List

OUTCOMES = ["exact", "wrong", "refused", "crash", "hang"]
FAILURES = ("wrong", "crash", "hang")


def repro(res: dict) -> str:
    """The command that reruns one plan and prints it."""
    return f"python -m tests.fuzz --repro {res['model']}:{res['seed']}"


def table(results: List[dict]) -> str:
    """Plans per outcome per model, then refusals per category per model."""
    models = sorted({r["model"] for r in results})
    counts: Dict[str, Counter] = {m: Counter(r["outcome"] for r in results if r["model"] == m) for m in models}
    width = max([len(m) for m in models] + [5])
    lines = [f"{'model':<{width}} " + " ".join(f"{o:>7}" for o in OUTCOMES) + f" {'total':>7}"]
    for m in models + ["total"]:
        c = counts[m] if m != "total" else sum(counts.values(), Counter())
        lines.append(f"{m:<{width}} " + " ".join(f"{c[o]:>7}" for o in OUTCOMES) + f" {sum(c.values()):>7}")
    refusals = Counter((r["category"], r["model"]) for r in results if r["outcome"] == "refused")
    if refusals:
        lines += ["", "refusals by category:"]
        cats = sorted({c for c, _ in refusals}, key=lambda c: -sum(v for (k, _), v in refusals.items() if k == c))
        for cat in cats:
            per = ", ".join(f"{m} {refusals[(cat, m)]}" for m in models if refusals[(cat, m)])
            lines.append(f"  {sum(v for (k, _), v in refusals.items() if k == cat):>5}  {cat[:90]}  ({per})")
    return "\n".join(lines)


def failures(results: List[dict]) -> str:
    """Each wrong, crash or hang: what happened and how to rerun it."""
    out = []
    for r in results:
        if r["outcome"] in FAILURES:
            detail = r["detail"].strip().splitlines()
            out.append(f"{r['outcome']:>5} {r['model']} seed {r['seed']} [{r['category']}]: "
                       f"{detail[0][:160] if detail else ''}\n      {repro(r)}")
    return "\n".join(out)
