"""Every side-by-side benchmark, each in a fresh process, then one table of their ratios.

    python -m benchmarks [--quick] [--only NAME [NAME ...]] [--list] [--timeout SECONDS]

A benchmark is a module ``benchmarks/<name>.py`` with a function
``main(quick=False)`` that prints its own table and returns its rows: dicts
with ``benchmark`` and ``name``, numeric measures, and optionally ``target``.
Modules are found by reading this folder, so a new one joins the run without a
change here; a module without ``main(quick)`` is listed as skipped, with why.

Each benchmark runs in its own Python process (no warm caches or state
shared), its output passes through, and its rows come back as JSON. The
summary lists every numeric measure whose key ends in ``ratio`` (cube / torch:
lower is better for cube) or ``exponent`` (growth with size: 1.0 is linear).
``--quick`` asks each benchmark for its short version (a few minutes in all on
a 2-core CPU machine).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ORDER = ("parallel", "compile_scaling", "memory")   # listed first, in this order; others follow by name
_MARK = "BENCHMARK_ROWS "


def _takes_quick(tree: ast.Module) -> Optional[str]:
    """None when the module defines ``main`` with a ``quick`` parameter, else why not."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "main":
            names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            return None if "quick" in names else f"its main({', '.join(names)}) takes no quick argument"
    return "it has no main(quick) function"


def discover(folder: Path = HERE) -> Dict[str, Optional[str]]:
    """The benchmark modules in ``folder``: name -> None when runnable, else why it is skipped.

    Modules are read, not imported, so finding them runs no benchmark code.
    """
    found = {}
    for path in sorted(folder.glob("*.py")):
        if path.name.startswith("_"):
            continue
        try:
            found[path.stem] = _takes_quick(ast.parse(path.read_text(), str(path)))
        except (SyntaxError, UnicodeDecodeError, OSError) as e:
            found[path.stem] = f"it cannot be read: {e}"
    first = [n for n in ORDER if n in found]
    return {n: found[n] for n in first + sorted(set(found) - set(first))}


def parse_args(argv: Optional[Sequence[str]] = None, available: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line; ``--only`` names must be among ``available`` (default: discovered)."""
    available = list(discover()) if available is None else list(available)
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="each benchmark's short version")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these ({', '.join(available)})")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per benchmark (default 3600)")
    args = p.parse_args(argv)
    unknown = [n for n in args.only or () if n not in available]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}: choose from {', '.join(available)}")
    return args


def run_one(name: str, quick: bool, timeout: float) -> Tuple[List[dict], Optional[str]]:
    """Runs ``benchmarks.<name>.main(quick)`` in a fresh process; returns its rows and an error, if any."""
    code = (f"import json, sys; from benchmarks import {name} as m; rows = m.main(quick={quick!r}); "
            f"sys.stdout.flush(); print({_MARK!r} + json.dumps(rows, default=str), flush=True)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    rows = None
    try:
        for line in proc.stdout:
            if line.startswith(_MARK):
                rows = json.loads(line[len(_MARK):])
            else:
                print(line, end="", flush=True)
        proc.wait()
    finally:
        timer.cancel()
    if rows is None:
        why = "killed after the timeout" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        return [], f"failed ({why})"
    return rows, None


def summary(results: Dict[str, Tuple[List[dict], Optional[str]]]) -> List[Tuple[str, str, str, float, str]]:
    """``(benchmark, row name, measure, value, target)`` for every ratio and exponent in the results."""
    out = []
    for bench, (rows, _) in results.items():
        for row in rows:
            for key, value in row.items():
                if (key.endswith("ratio") or key.endswith("exponent")) and isinstance(value, (int, float)):
                    out.append((bench, str(row.get("name", "")), key, float(value), str(row.get("target", ""))))
    return out


def report(results: Dict[str, Tuple[List[dict], Optional[str]]], skipped: Dict[str, str]) -> None:
    lines = summary(results)
    width = max([len(f"{b}: {n}") for b, n, *_ in lines] + [30])
    print("\n== benchmark summary: ratios cube / torch (lower is better for cube), growth exponents ==")
    print(f"{'benchmark: row':<{width}}  {'measure':<16}{'value':>9}  target")
    for bench, name, key, value, target in lines:
        print(f"{bench + ': ' + name:<{width}}  {key:<16}{value:>9.3f}  {target}")
    for bench, (_, error) in results.items():
        if error:
            print(f"{bench}: {error}")
    for bench, why in skipped.items():
        print(f"{bench}: skipped, {why}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the selected benchmarks; 0 when every one that ran succeeded."""
    found = discover()
    args = parse_args(argv, list(found))
    if args.list:
        for name, why in found.items():
            print(f"{name:<20}{'' if why is None else 'skipped: ' + why}")
        return 0
    chosen = args.only or list(found)
    skipped = {n: found[n] for n in chosen if found[n] is not None}
    results = {}
    for name in chosen:
        if found[name] is not None:
            continue
        print(f"\n== {name}{' (quick)' if args.quick else ''} ==", flush=True)
        start = time.perf_counter()
        results[name] = run_one(name, args.quick, args.timeout)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
    report(results, skipped)
    return 1 if any(error for _, error in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
