"""What one rank of a plan holds and computes on the zoo's models, against its even share.

    python -m benchmarks.plan_shares [--quick] [--plans cp,cp_tp,tensor] [--models mamba,mamba2,llama4] [--tokens 64]

For each model of ``tests.zoo`` (its shipped configuration shrunk in size, batch ``tests.zoo.B``,
``--tokens`` tokens) under each plan of ``tests.zoo.PLANS``, the plan rank 0 runs
(``cube.plan``, nothing trained) gives:

- ``activations``: the elements of the activations rank 0's ops make, over those the plain model's
  ops make (the ops of the model's modules), and ``params``: the parameter elements rank 0 holds,
  over the model's;
- each over its even share (``1 / world``) as ``*_ratio``: 1.0 is a plan that divides the work
  evenly, ``world`` one that leaves every op whole on every rank;
- ``collectives``: rank 0's collective steps in forward, and the bytes it sends per step in forward
  and backward (``cube.codegen.report``).

The measures behind the tables of docs/models.md ("Context and tensor parallel together",
"Expert-major copies"). A model whose package is not installed is left out, with the reason.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODELS = ("mamba", "mamba2", "bamba", "falcon_h1", "minimax", "lfm2", "kimi_linear", "llama4")
QUICK = ("mamba", "llama4")
PLANS = ("cp", "cp_tp", "tensor")
_COLLECTIVE = re.compile(r"^\s+\d+\s+(all_reduce|identity_all_reduce|all_gather|reduce_scatter|all_to_all)\s", re.M)
_SENDS = re.compile(r"sends per step: forward (\d+) B, backward (\d+) B")


def measure(name: str, plan_name: str, tokens: int) -> dict:
    """Rank 0's shares, collectives and bytes of ``plan_name`` on zoo model ``name`` (module docstring)."""
    import torch

    import cube
    from cube.codegen.report import plan_text
    from tests import zoo
    plan = zoo.PLANS[plan_name]
    model, _ = zoo.build(name, zoo.B)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, zoo.V, (zoo.B, tokens), generator=gen)
    planned = cube.plan(model, (x, x.clone()), plan.make(), plan.world)
    rank0 = planned.program.plans[0]
    made = whole = 0
    for c in rank0.calls:
        if c.op is None or not c.op.module_path:
            continue
        for t, b in zip(c.op.outputs, c.layout.outputs):
            made += math.prod(e - s for s, e in b)
            whole += t.numel()
    params = [(t, b) for t, b in rank0.attrs if t.kind.name == "PARAM"]
    held = sum(math.prod(e - s for s, e in b) for _, b in params)
    total = sum(t.numel() for t, _ in params)
    text = plan_text(planned.program).split("== rank 1")[0]
    sends = _SENDS.search(text)
    return {"benchmark": "plan_shares", "name": f"{name} {plan_name}", "world": plan.world,
            "activations": made / whole, "activations_ratio": made / whole * plan.world,
            "params": held / total, "params_ratio": held / total * plan.world,
            "collectives": len(_COLLECTIVE.findall(text)),
            "forward_bytes": int(sends.group(1)) if sends else 0, "backward_bytes": int(sends.group(2)) if sends else 0}


def table(rows: List[dict]) -> str:
    head = "| model plan | world | activations (ratio) | parameters (ratio) | collectives | forward bytes | backward bytes |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['world']} | {r['activations']:.2f} ({r['activations_ratio']:.2f}) | "
                     f"{r['params']:.2f} ({r['params_ratio']:.2f}) | {r['collectives']} | {r['forward_bytes']} | "
                     f"{r['backward_bytes']} |")
    return "\n".join(lines)


def main(quick: bool = False, argv: Optional[Sequence[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--models", default=None)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args([] if argv is None else argv)
    quick = quick or args.quick
    from tests import zoo
    names = args.models.split(",") if args.models else list(QUICK if quick else MODELS)
    plans = args.plans.split(",")
    unknown = [p for p in plans if p not in zoo.PLANS]
    if unknown:
        raise ValueError(f"plan_shares: unknown plan(s) {unknown}; tests.zoo.PLANS has {sorted(zoo.PLANS)}")
    rows = []
    for name in names:
        if not zoo.installed(name):
            print(f"{name}: {zoo.PACKAGES[name]} is not installed here, left out", file=sys.stderr)
            continue
        for p in plans:
            print(f"planning {name} under {p} ...", file=sys.stderr, flush=True)
            rows.append(measure(name, p, args.tokens))
    print(table(rows))
    return rows


if __name__ == "__main__":
    main(argv=sys.argv[1:])
