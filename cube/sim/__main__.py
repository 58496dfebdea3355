"""``python -m cube.sim``: simulate a policy, or search for the best plan.

    python -m cube.sim SPEC --ngpus N --policy PASData [--option tp=2 ...] [--trace step.json] [--memory mem.png]
    python -m cube.sim SPEC --ngpus N --search [--mem-cap 16] [--out cube_auto_plan.json]
    python -m cube.sim SPEC --hardware dgx-a100-80g --ngpus 1536 --policy PASMegatron --option tp=8 ... --json
    python -m cube.sim SPEC --hardware dgx-a100-80g --ngpus 1536 --search [--budget 16] [--budget-s 60] [--mem-cap 80]

SPEC names the model and one global batch: a Python file (a training script is
fine, its ``main`` guarded by ``if __name__ == "__main__"``) or a module,
optionally with ``:function``, defining ``build()`` that returns
``(model, batch)`` (default function: ``build``). Op costs are measured on this
device (cached; ``--estimate`` uses FLOP/byte estimates instead) and
collectives are calibrated once per world size (``--no-calibrate``: defaults;
``--recalibrate``: measured again now).
``--hardware`` names a cluster this machine is not (``cube.sim.hardware``):
op and network costs then come from its profile, and one rank of each
symmetric class is simulated (``cube.sim.symmetry``), so thousands of ranks
take seconds; SPEC's ``build()`` may then return a model on the meta device,
and ``--search`` climbs through ``PASMegatron`` plans (``cube.sim.cluster_search``)
under the device's memory.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from cube.policy import load_module, parse_options


def load_spec(spec: str):
    """``(model, batch)`` from ``file.py[:fn]`` or ``module[:fn]`` (see the module docstring).

    Raises:
        ValueError: no such file, module or function, or it returns something else.
    """
    where, _, name = spec.partition(":")
    name = name or "build"
    if where.endswith(".py"):   # the file's own folder, so it can import its neighbours
        sys.path.insert(0, os.path.dirname(os.path.abspath(where)))
    try:
        module = load_module(where)
    except FileNotFoundError:
        raise ValueError(f"no file {where!r}; pass a Python file or module defining {name}() -> (model, batch)") \
            from None
    except ImportError as e:
        raise ValueError(f"cannot import {where!r} ({e}); pass a Python file or an importable module") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where!r} defines no function {name}(); add `def {name}(): return model, batch` "
                         f"(the nn.Module and one global batch) or name another with {where}:function")
    out = fn()
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.nn.Module)):
        raise ValueError(f"{where}:{name}() must return (model, batch), got {type(out).__name__}")
    return out


def _assumed(result, hw, args, options: dict, precision) -> str:
    """The text output's last lines: throughput (TFLOP/s per device, MFU against the profile's peak) and
    what the prediction assumed (precision, micro-batches, recompute, ZeRO, the policy's options)."""
    from cube.sim.report import prediction
    p = prediction(result, hw, args.ngpus, precision, 0.0, policy=args.policy, options=options)
    mfu = f", MFU {p['mfu'] * 100:.1f}% of {hw.name}'s {p['mfu_peak']} peak" if p["mfu"] is not None else \
        " (this host: no peak to measure MFU against)"
    if p["mfu"] is not None and precision == "fp8":   # torchtitan's convention: MFU is ill-defined over both
        mfu += " (fp8: counted against the bf16 peak, as the float8 and bf16 products mix)"
    micro = p.get("micro_batches")
    said = [f"precision {p['precision']}", f"ZeRO-{args.zero}" if args.zero else "no ZeRO",
            f"recompute {options.get('recompute', 'as CUBE_RECOMPUTE or none')}",
            f"micro-batches {options.get('nmicros', 'the policy default')}"
            + (f" ({micro['simulated']} simulated, {micro['real']} extrapolated)" if micro else "")]
    said += [f"{k}={v}" for k, v in options.items() if k not in ("recompute", "nmicros")]
    return (f"throughput: {p['tflops_per_device']:.3g} TFLOP/s per device{mfu}\n"
            f"assumed: {args.ngpus} devices of {hw.name}, policy {args.policy}, " + ", ".join(said))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cube.sim", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", help="file.py[:build] or module[:build] returning (model, batch)")
    p.add_argument("--ngpus", type=int, required=True, help="world size to plan for")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--policy", help="a shipped policy name (PASData) or 'file.py:Name' / 'module:Name'")
    what.add_argument("--search", action="store_true", help="search data/tensor/pipeline plans")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword option of the policy (repeatable), e.g. tp=2, nmicros=8, recompute=all, "
                        "stage_to_num_ranks=1,2; values are read as int, float, bool, a tuple of ints or text")
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage of the optimizer (with --policy)")
    p.add_argument("--mem-cap", type=float, default=None,
                   help="GiB per device (search; default on a cluster: the profile's device memory)")
    p.add_argument("--budget", type=int, default=16, help="plans simulated at most (search on a cluster)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="wall seconds the search on a cluster may take (it stops before a plan that would not fit)")
    p.add_argument("--trace", default=None, help="write a Chrome trace (Perfetto) of the step")
    p.add_argument("--memory", default=None, help="write the memory-over-time plot (PNG, or CSV)")
    p.add_argument("--out", default="cube_auto_plan.json", help="where the search writes the best plan")
    p.add_argument("--top", type=int, default=20, help="rows of the search table")
    p.add_argument("--estimate", action="store_true", help="FLOP/byte estimates instead of measuring ops")
    p.add_argument("--no-calibrate", action="store_true", help="default communication costs, no host calibration")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the collectives again now and cache them (a shared host's costs drift)")
    p.add_argument("--cores", type=float, default=None,
                   help="cores the ranks share (default: this host's on CPU, none on GPU)")
    p.add_argument("--hardware", default="cpu-host",
                   help="the cluster: a shipped profile (dgx-a100-80g, dgx-h100, cpu-host: this machine, measured) "
                        "or a JSON profile (python -m cube.sim.calibrate --out my-cluster.json)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp8", "fp32"], default=None,
                   help="training precision on a profiled cluster (default bf16; fp32 on cpu-host); fp8: bf16 with "
                        "the linear layers' products in float8 (a profile with an fp8 peak, e.g. dgx-h100)")
    p.add_argument("--symmetric", dest="symmetric", action="store_true", default=None,
                   help="simulate one rank of each symmetric class (default on a profiled cluster)")
    p.add_argument("--no-symmetric", dest="symmetric", action="store_false", help="simulate every rank")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print the prediction as JSON (or write it to PATH)")
    p.add_argument("--moe-imbalance", type=float, default=1.0, metavar="F",
                   help="with --hardware: in a MoE layer split by experts (ep), the busiest rank receives F times "
                        "the mean (token, expert) rows (default 1: a balanced router)")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(message)s")
    if args.ngpus < 1:
        p.error("--ngpus must be at least 1")
    if args.budget < 1:
        p.error("--budget must be at least 1 (plans the cluster search simulates)")
    if args.budget_s is not None and not args.budget_s > 0:
        p.error("--budget-s must be a positive number of seconds (the cluster search's wall-clock budget)")
    try:
        options = parse_options(args.option)
    except ValueError as e:
        p.error(str(e))
    if args.recalibrate and args.no_calibrate:
        p.error("--recalibrate measures the collectives again; --no-calibrate uses defaults: give one")
    if not args.moe_imbalance >= 1:
        p.error(f"--moe-imbalance {args.moe_imbalance}: the busiest rank receives at least the mean rows; pass 1 "
                f"(balanced) or more (1.2: 20% over the mean)")
    if options and not args.policy:
        p.error("--option passes keyword options to --policy; the search chooses its own")

    from cube.sim import api, hardware
    started = time.perf_counter()
    try:
        hw = hardware.load(args.hardware)
    except ValueError as e:
        p.error(str(e))
    if args.moe_imbalance != 1 and hw.is_host:
        p.error("--moe-imbalance prices a cluster's MoE layers: pass --hardware (a cluster profile) with it")
    if args.recalibrate and not hw.is_host:
        p.error(f"--recalibrate measures this host's collectives; --hardware {args.hardware} takes its costs from "
                f"the profile")
    if args.precision == "fp8" and hw.is_host:
        p.error(f"--precision fp8 with --hardware {args.hardware}: this host's op costs are measured by timing "
                f"the traced aten ops, which are not the float8 kernels cube.runtime.float8 runs; pass a profile "
                f"with an fp8 peak (--hardware dgx-h100 or h100-hbm2e-500w) or --precision bf16")
    model, batch = load_spec(args.spec)
    precision = None if args.precision == "fp32" else args.precision
    if hw.is_host:
        costs, comm, host = api.default_models(args.ngpus, estimate=args.estimate, calibrate=not args.no_calibrate,
                                               cores=args.cores, recalibrate=args.recalibrate)
        if not args.estimate:
            from cube.sim.context import scaled
            scaled(costs, model, batch)   # what ops cost in a whole step beyond alone
    else:   # a cluster this machine is not: costs from the profile
        from cube.sim.cluster import ClusterComm, DeviceCosts
        peaks = hw.device["peak_tflops"]
        precision = args.precision or ("bf16" if "bf16" in peaks else next(iter(peaks)))
        precision = None if precision == "fp32" else precision
        try:
            costs = DeviceCosts(hw, precision, moe_imbalance=args.moe_imbalance)
        except ValueError as e:   # fp8 on a profile without float8 tensor cores
            p.error(str(e))
        comm, host = ClusterComm(hw), None
    symmetric = args.symmetric if args.symmetric is not None else not hw.is_host
    if args.policy:
        result = api.simulate_policy(model, batch, args.policy, args.ngpus, costs=costs, comm=comm,
                                     zero=args.zero, host=host, options=options, precision=precision,
                                     symmetric=symmetric)
        if args.json is not None:
            from cube.sim.report import prediction
            text = json.dumps(prediction(result, hw, args.ngpus, precision, time.perf_counter() - started,
                                         policy=args.policy, options=options), indent=2)
            if args.json == "-":
                print(text)
            else:
                Path(args.json).write_text(text + "\n")
                print(f"prediction: {args.json}")
            if args.json == "-":
                return 0
        print(result.summary())
        print(_assumed(result, hw, args, options, precision))
        if args.trace:
            print(f"trace: {result.chrome_trace(args.trace)}")
        if args.memory:
            print(f"memory: {result.memory_plot(args.memory)}")
        return 0
    cap = args.mem_cap * 2**30 if args.mem_cap else None
    if not hw.is_host:
        return _cluster_search(model, batch, args, hw, precision, cap)
    from cube.sim import search
    ranked = search.search(model, batch, args.ngpus, costs, comm, mem_cap=cap, host=host)
    print(search.table(ranked, args.top))
    best = next((c for c in ranked if c.feasible and c.result is not None), None)
    if best is None:
        print("no plan fits: raise --mem-cap or use more devices", file=sys.stderr)
        return 1
    search.write_plan(best, args.out)
    zero = best.config.get("zero", 0)
    print(f"\nbest: {best.name}: {best.step_time * 1e3:.2f} ms, {best.peak / 2**20:.1f} MiB; plan written to "
          f"{args.out}\nuse it: CUBE_AUTO_PLAN={args.out} with PAS='cube.policies.auto:PASAuto'"
          + (", cube.compile(..., zero=3)" if zero == 3 else "")
          + (f", cube.build_optimizer(model, torch.optim.AdamW, zero={zero})" if zero else "")
          + (f"; the dataloader yields the global batch, which each step cuts into "
             f"{best.config['nmicros']} micro-batches of {best.config['micro_batch']} samples"
             if best.config["pp"] > 1 else ""))
    if args.trace:
        graph = search.planned(search._Tracer(model, batch), best.config)
        from cube.sim.simulate import simulate
        res = simulate(graph, args.ngpus, costs=costs, comm=comm, zero=zero, host=host)
        print(f"trace of the best plan: {res.chrome_trace(args.trace)}")
        if args.memory:
            print(f"memory: {res.memory_plot(args.memory)}")
    return 0


def _cluster_search(model, batch, args, hw, precision, cap) -> int:
    from cube.sim import cluster_search
    started = time.perf_counter()
    ranked = cluster_search.search(model, batch, args.ngpus, hw, precision, mem_cap=cap, budget=args.budget,
                                   budget_s=args.budget_s, moe_imbalance=args.moe_imbalance)
    print(cluster_search.table(ranked, args.ngpus, args.top))
    print(f"{len(ranked)} plans simulated in {time.perf_counter() - started:.1f} s")
    if hw.kind == "gpu":   # what a user launching there needs to know before launching
        print("runs on: every plan above runs on NCCL: pipelines with several stages per rank (interleaved, ZB-V, "
              "DualPipeV) move their activations on ordered channels (cube.runtime.p2p.ordered)")
    best = next((c for c in ranked if c.feasible), None)
    if best is None:
        print(f"no plan fits {(cap or hw.memory_bytes) / 2**30:.0f} GiB per device: raise --mem-cap or --budget, "
              f"or use more devices", file=sys.stderr)
        return 1
    print(f"\nbest: {best.plan.name}: {best.step_time:.3f} s, {best.tokens_per_s:.0f} tokens/s per device, MFU "
          f"{best.mfu * 100:.1f}%, {best.peak / 2**30:.1f} GiB per rank, runs on {best.runs_on}; simulate it with\n"
          f"python -m cube.sim {args.spec} --hardware {args.hardware} --ngpus {args.ngpus} {best.plan.command()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
