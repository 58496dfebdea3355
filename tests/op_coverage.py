"""cube's partition rules against DTensor's sharding strategies, on the ops the tier's models use.

``python -m tests.op_coverage`` traces every model of ``tests.zoo`` (as shipped), lists the ops
their graphs hold, and for each says whether DTensor has a sharding strategy for it in this torch
(its sharding propagator's ``op_strategy_funcs``, ``op_single_dim_strategy_funcs`` and
``op_to_rules``) and whether cube has a partition rule (``cube.trace.rules.REGISTRY``); then the
totals, and the ops one covers and the other does not. ``tests/test_zoo.py`` checks that cube
covers every op DTensor covers among them.
"""
from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Set


def dtensor_ops() -> Set[str]:
    """Names (``aten::linear`` -> ``linear``) of the ops DTensor's sharding propagator has a strategy for."""
    from torch.distributed.tensor import DTensor
    prop = DTensor._op_dispatcher.sharding_propagator
    names = set()
    for table in ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"):
        for op in getattr(prop, table, {}):
            schema = getattr(op, "_schema", None)
            if schema is not None:
                names.add(schema.name.split("::")[-1])
    return names


def cube_ops() -> Set[str]:
    """Names of the ops cube has a partition rule for."""
    from cube.trace.rules import REGISTRY
    return set(REGISTRY.rules)


def model_ops(models: List[str]) -> Dict[str, Set[str]]:
    """Op name -> the models of the tier whose traced graph holds it."""
    import cube
    from cube.ir.operator import IRFwOperation
    from tests import zoo
    out: Dict[str, Set[str]] = {}
    for name in filter(zoo.installed, models):
        model, batch = zoo.build(name)
        for op in cube.trace_model(model, batch).graph.ops:
            if isinstance(op, IRFwOperation):
                out.setdefault(op.name, set()).add(name)
    return out


def report(models: List[str]) -> str:
    used = model_ops(models)
    dt, cu = dtensor_ops(), cube_ops()
    lines = ["| op | models | DTensor | cube |", "|---|---|---|---|"]
    for op in sorted(used):
        lines.append(f"| `{op}` | {len(used[op])} | {'yes' if op in dt else '-'} | {'yes' if op in cu else '-'} |")
    both = [op for op in used if op in dt and op in cu]
    only_dt = sorted(op for op in used if op in dt and op not in cu)
    only_cube = sorted(op for op in used if op in cu and op not in dt)
    neither = sorted(op for op in used if op not in dt and op not in cu)
    lines += ["", f"{len(used)} ops in {len(models)} models: both {len(both)}, DTensor only {len(only_dt)} "
                  f"{only_dt}, cube only {len(only_cube)} {only_cube}, neither {len(neither)} {neither}",
              f"DTensor has strategies for {len(dt)} op names in this torch; cube has rules for {len(cu)}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    from tests import zoo
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(zoo.MODELS))
    args = ap.parse_args(argv)
    print(report(args.models.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
