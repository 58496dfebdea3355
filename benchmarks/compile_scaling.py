"""Compile time at scale: how each compile phase grows with the graph.

    python -m benchmarks.compile_scaling [--quick] [--blocks 4 16 64] [--ranks 8 64]
                                         [--policies PASData PASMegatronTP PAS1F1B] [--repeat 3]

Compiles GPT stacks of 4 to 640 blocks (d64, 64 heads of dim 1, T16, global
batch 64, vocabulary 128: small tensors, since compile time follows the node
count; the widths divide by 64, so every policy plans 64 ranks) with
``PASData``, ``PASMegatronTP`` and ``PAS1F1B`` for 8 and 64 ranks. Each
configuration is one dry run (``cube.compiler.generate_code``: every rank's
code, in one process, nothing launched) in a fresh process, so no run warms
another's caches. Prints, per configuration, the fx node count, the seconds
of each phase (trace, ir, policy, plan, codegen, and load: compiling rank 0's
module, what each rank does at load), the total, total / trace and the wall
time. Phases are timed in process CPU seconds, which other load on a shared
machine barely moves (wall time is shown beside them); then, per policy and
world size, the growth exponent: the least
squares slope of log(total) against log(nodes) (1.0 is linear), for the
total and for cube's own phases (all but trace).

``PAS1F1B`` puts one stage on each device, so a stack with fewer blocks than
ranks is skipped (shown in the table with the reason).

    python -m benchmarks.compile_scaling --llama7b [--ranks 64]

What one rank of a real launch does (trace, plan, its own code, load) for a
32-layer Llama of 7B parameters' shape built on the meta device, planned tp8 x
pp8 (x dp for more ranks) with 1F1B, 8 micro-batches of 2 x 2048 tokens: the
big-model target is under 30 s per rank at 64 ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # python benchmarks/compile_scaling.py as well as python -m
    sys.path.insert(0, str(ROOT))

MODEL = {"dim": 64, "heads": 64, "seq": 16, "batch": 64, "vocab": 128}
BLOCKS = (4, 16, 64, 160, 320, 640)
RANKS = (8, 64)
POLICIES = ("PASData", "PASMegatronTP", "PAS1F1B")
QUICK = {"blocks": (4, 16, 64), "ranks": (8,), "policies": POLICIES}
PHASES = ("trace", "ir", "policy", "plan", "codegen", "load")
_MARK = "COMPILE_SCALING_ROW "


def skip_reason(blocks: int, policy: str, ranks: int) -> Optional[str]:
    """Why a configuration cannot be planned (None when it can)."""
    if policy in ("PAS1F1B", "PASGPipe") and blocks < ranks:
        return f"one stage per device needs >= {ranks} blocks"
    if policy == "PASData" and MODEL["batch"] % ranks:
        return f"batch {MODEL['batch']} does not split over {ranks} ranks"
    if policy == "PASMegatronTP" and (MODEL["heads"] % ranks or MODEL["dim"] % ranks):
        return f"{MODEL['heads']} heads / width {MODEL['dim']} do not split over {ranks} ranks"
    return None


def measure(blocks: int, policy: str, ranks: int) -> dict:
    """One dry run in this process: the row of ``blocks``/``policy``/``ranks``."""
    import torch

    import cube.compiler as compiler
    import cube.policies as policies
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=MODEL["vocab"], block_size=MODEL["seq"], n_layer=blocks,
                          n_head=MODEL["heads"], n_embd=MODEL["dim"]))
    ids = torch.randint(0, MODEL["vocab"], (MODEL["batch"], MODEL["seq"]))
    nodes = {}
    export = compiler.export

    def counting_export(model, args):   # the dry run's own trace; only its node count is read
        ep = export(model, args)
        nodes["fx"] = len(ep.graph.nodes)
        return ep

    compiler.export = counting_export
    timings: Dict[str, float] = {}
    wall, clock = time.perf_counter(), time.perf_counter
    time.perf_counter = time.process_time   # cube times its phases with it: CPU seconds, steady under load
    try:
        sources = compiler.generate_code(model, (ids, torch.roll(ids, -1, 1)), policies.resolve(policy), ranks,
                                         timings=timings)
        start = time.perf_counter()
        exec(compile(sources[0], "rank0.py", "exec"), {"__name__": "cube_gen_rank0"})
        timings["load"] = time.perf_counter() - start
    finally:
        time.perf_counter = clock
    total = sum(timings[p] for p in PHASES)
    return {"benchmark": "compile_scaling", "name": f"{policy} x{ranks}, {blocks} blocks", "blocks": blocks,
            "nodes": nodes["fx"], "policy": policy, "ranks": ranks, "seconds": {p: timings[p] for p in PHASES},
            "total": total, "total_trace_ratio": total / timings["trace"], "target": "<= 10", "wall": clock() - wall,
            "lines": sum(s.count("\n") for s in sources.values())}


LLAMA7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096}
RANK_PHASES = ("trace", "ir", "policy", "plan", "codegen", "load")


def measure_rank(ranks: int = 64, tp: int = 8, pp: int = 8, nmicros: int = 8, seq: int = 2048) -> dict:
    """One rank's compile (rank 0 of ``ranks``) of the meta-built 7B-shape Llama: CPU seconds per
    phase, wall, peak RSS, and the generated module's size."""
    import functools
    import resource

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import cube.compiler as compiler
    from cube.policy import load_policy, policy_name
    from examples.bigmodel.model import CausalLM
    from cube.policies.megatron3d import PASMegatron
    cfg = LlamaConfig(**LLAMA7B, attn_implementation="eager", use_cache=False)
    with torch.device("meta"):
        model = CausalLM(LlamaForCausalLM(cfg))
    params = sum(t.numel() for t in model.parameters())
    ids = torch.randint(0, cfg.vocab_size, (2 * nmicros * max(1, ranks // (tp * pp)), seq))
    structure, sample = compiler._structure((ids, ids))
    policy = load_policy(functools.partial(PASMegatron, tp=tp, pp=pp, nmicros=nmicros))
    timings: Dict[str, float] = {}
    wall, clock = time.perf_counter(), time.perf_counter
    time.perf_counter = time.process_time   # CPU seconds, steady under other load
    try:
        graph, _ = compiler.trace_and_plan(model, sample, structure, policy, ranks, timings)
        source = compiler.generate(graph, 0, ranks, policy_name(policy), timings=timings)
        start = time.perf_counter()
        exec(compile(source, "rank0.py", "exec"), {"__name__": "cube_gen_rank0"})
        timings["load"] = time.perf_counter() - start
    finally:
        time.perf_counter = clock
    return {"benchmark": "compile_scaling", "name": f"llama7b meta tp{tp} pp{pp} x{ranks}, one rank",
            "params": params, "ranks": ranks, "seconds": {p: timings.get(p, 0.0) for p in RANK_PHASES},
            "total": sum(timings.get(p, 0.0) for p in RANK_PHASES), "wall": clock() - wall,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "lines": source.count("\n"), "target": "<= 30 s"}


def report_rank(row: dict) -> None:
    print(f"{row['name']} ({row['params'] / 1e9:.2f}B parameters on meta): CPU seconds per phase")
    print("".join(f"{p:>9}" for p in RANK_PHASES) + f"{'total':>9}{'wall':>9}{'peak MB':>9}{'lines':>8}")
    print("".join(f"{row['seconds'][p]:>9.2f}" for p in RANK_PHASES) +
          f"{row['total']:>9.2f}{row['wall']:>9.2f}{row['peak_rss_mb']:>9.0f}{row['lines']:>8}")
    print(f"target: {row['target']} per rank: {'met' if row['wall'] <= 30 else 'NOT met'}")


def run_fresh(blocks: int, policy: str, ranks: int, timeout: float = 1800) -> dict:
    """``measure`` in a fresh Python process; a failure becomes a row with a ``note``."""
    row = {"benchmark": "compile_scaling", "name": f"{policy} x{ranks}, {blocks} blocks", "blocks": blocks,
           "policy": policy, "ranks": ranks}
    why = skip_reason(blocks, policy, ranks)
    if why:
        return {**row, "note": f"skipped: {why}"}
    cmd = [sys.executable, "-m", "benchmarks.compile_scaling", "--worker", str(blocks), policy, str(ranks)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**row, "note": f"failed: over {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {**row, "note": f"failed (exit {done.returncode}): {tail}"}


def growth(rows: Sequence[dict], key=lambda r: r["total"]) -> Dict[tuple, float]:
    """Per (policy, ranks): the least squares slope of log(key(row)) against log(nodes)."""
    by: Dict[tuple, List[tuple]] = {}
    for r in rows:
        if "total" in r:
            by.setdefault((r["policy"], r["ranks"]), []).append((math.log(r["nodes"]), math.log(key(r))))
    out = {}
    for k, pts in by.items():
        if len({x for x, _ in pts}) < 2:
            continue
        mx = sum(x for x, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        out[k] = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return out


def report(rows: Sequence[dict]) -> List[dict]:
    """Prints the table and the growth exponents; returns one row per exponent."""
    print(f"GPT d{MODEL['dim']}, {MODEL['heads']} heads, T{MODEL['seq']}, batch {MODEL['batch']}: "
          f"dry run of every rank's code, one fresh process per row; CPU seconds per phase, and wall")
    head = f"{'blocks':>6}{'nodes':>7}  {'policy':<14}{'ranks':>5}" + "".join(f"{p:>8}" for p in PHASES)
    print(head + f"{'total':>8}{'/trace':>7}{'wall':>8}")
    for r in rows:
        lead = f"{r['blocks']:>6}{r.get('nodes', ''):>7}  {r['policy']:<14}{r['ranks']:>5}"
        if "total" not in r:
            print(f"{lead}  {r['note']}")
            continue
        print(lead + "".join(f"{r['seconds'][p]:>8.2f}" for p in PHASES) +
              f"{r['total']:>8.2f}{r['total_trace_ratio']:>7.2f}{r['wall']:>8.2f}")
    total = growth(rows)
    own = growth(rows, lambda r: r["total"] - r["seconds"]["trace"])
    out = []
    if total:
        print("growth exponent (least squares of log seconds vs log nodes; 1.0 is linear):")
    for (policy, ranks), e in sorted(total.items()):
        print(f"  {policy:<14} x{ranks:<3}  total {e:.2f}   cube phases (all but trace) {own[policy, ranks]:.2f}")
        out.append({"benchmark": "compile_scaling", "name": f"{policy} x{ranks} growth", "total_exponent": e,
                    "cube_exponent": own[policy, ranks], "target": "close to 1"})
    return out


def main(quick: bool = False, blocks: Optional[Sequence[int]] = None, ranks: Optional[Sequence[int]] = None,
         policies: Optional[Sequence[str]] = None, repeat: int = 1) -> List[dict]:
    """Runs every configuration (``quick``: 4 to 64 blocks, 8 ranks), prints the table, returns the rows.

    ``repeat`` runs each configuration that many times (each in a fresh process)
    and keeps the fastest, which filters out other load on a shared machine.

    Returns:
        One row per configuration (CPU ``seconds`` per phase, ``total``,
        ``total_trace_ratio`` = total / trace, ``wall``, or a ``note`` when
        skipped or failed) and one per growth exponent.
    """
    settings = QUICK if quick else {"blocks": BLOCKS, "ranks": RANKS, "policies": POLICIES}
    blocks, ranks, policies = blocks or settings["blocks"], ranks or settings["ranks"], policies or settings["policies"]
    rows = []
    for n in blocks:
        for world in ranks:
            for policy in policies:
                runs = [run_fresh(n, policy, world) for _ in range(max(1, repeat))]
                r = min(runs, key=lambda x: x.get("total", math.inf))
                rows.append(r)
                state = f"{r['total']:.1f} s" if "total" in r else r["note"]
                print(f"  [{policy} x{world}, {n} blocks: {state}]", file=sys.stderr, flush=True)
    return rows + report(rows)


def _cli(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"blocks {QUICK['blocks']}, ranks {QUICK['ranks']}")
    p.add_argument("--blocks", type=int, nargs="+", help=f"stack sizes (default {BLOCKS})")
    p.add_argument("--ranks", type=int, nargs="+", help=f"world sizes (default {RANKS})")
    p.add_argument("--policies", nargs="+", choices=["PASData", "PASMegatronTP", "PAS1F1B", "PASGPipe",
                                                      "PASHybrid", "PASSingle"],
                   help=f"shipped policies (default {POLICIES})")
    p.add_argument("--repeat", type=int, default=1, help="runs per configuration, the fastest kept")
    p.add_argument("--llama7b", action="store_true", help="one rank's compile of a meta 7B Llama (tp8 x pp8)")
    p.add_argument("--worker", nargs=3, metavar=("BLOCKS", "POLICY", "RANKS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.llama7b:
        report_rank(measure_rank((args.ranks or [64])[0]))
        return 0
    if args.worker:
        n, policy, world = args.worker
        print(_MARK + json.dumps(measure(int(n), policy, int(world))), flush=True)
        return 0
    main(args.quick, args.blocks, args.ranks, args.policies, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
