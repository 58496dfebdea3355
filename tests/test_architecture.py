"""The package's import rules, checked on the syntax tree of every module under ``cube/``.

- The pipeline's stages (``cube/{ir,trace,passes,codegen,runtime}``) never import the
  driver (``cube.compiler``), the simulator (``cube.sim``) or the shipped policies:
  imports point down the pipeline, and the simulator and the policies sit beside it.
- Nothing in ``cube/`` outside ``cube/policies`` imports the shipped policies (``cube.policies``,
  or the repository's compatibility folder ``policies``): a policy is loaded by the name a user gives.
- No module imports another cube module's private (``_name``) names.
- Code generation prints a program the passes made: ``build_plans`` is not named in ``cube/codegen``.
- Environment variables are read in ``cube/config.py`` only (and the launcher's in
  ``cube/runtime/device.py``).

Imports count wherever they are (module level or inside a function), absolute or relative,
and ``importlib.import_module("...")`` / ``__import__("...")`` of a constant name too. Each
failure lists every offending ``file:line``.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
CUBE = ROOT / "cube"
STAGES = ("ir", "trace", "passes", "codegen", "runtime")
ENV_READERS = ("cube/config.py", "cube/runtime/device.py")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> Dict[str, Tuple[str, ast.Module]]:
    """``{relative path: (module name, syntax tree)}`` of every module under ``cube/``."""
    out = {}
    for path in sorted(CUBE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        out[rel] = (_module_name(path), ast.parse(path.read_text(), filename=rel))
    return out


SOURCES = _sources()


def _absolute(module: str, rel: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (relative ones resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if rel.endswith("__init__.py") else module.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(rel: str) -> List[Tuple[int, str, List[str]]]:
    """``(line, imported module, names imported from it)`` of every import in ``rel``, in line order.

    For ``from M import n`` the module is ``M`` and the names ``[n]``; ``n`` may be a submodule
    (``from cube import compiler``), so the rules also test ``M.n``.
    """
    module, tree = SOURCES[rel]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, _absolute(module, rel, node), [a.name for a in node.names]))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value, []))
    return sorted(out, key=lambda entry: entry[0])


def _within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def _imports_of(rel: str, packages: Tuple[str, ...]) -> Iterator[Tuple[int, str]]:
    """``(line, what)`` of the imports in ``rel`` of anything inside ``packages``."""
    for line, target, names in _imports(rel):
        for full in [target] + [f"{target}.{n}" for n in names]:
            hit = next((p for p in packages if _within(full, p)), None)
            if hit is not None:
                yield line, full
                break


def _report(found: List[str], rule: str) -> None:
    if found:
        pytest.fail(f"{rule}: {len(found)} place(s)\n" + "\n".join(f"  {f}" for f in found))


def test_there_are_modules_to_check():
    assert "cube/compiler.py" in SOURCES and "cube/runtime/p2p.py" in SOURCES
    assert sum(rel.startswith("cube/runtime/") for rel in SOURCES) > 10


def test_stages_do_not_import_the_driver_the_simulator_or_policies():
    found = [f"{rel}:{line}: imports {what}"
             for rel in SOURCES if rel.split("/")[1] in STAGES
             for line, what in _imports_of(rel, ("cube.compiler", "cube.sim", "cube.policies", "policies"))]
    _report(found, "cube/{" + ",".join(STAGES) + "} import cube.compiler, cube.sim or the policies")


def test_nothing_in_cube_imports_policies():
    found = [f"{rel}:{line}: imports {what}" for rel in SOURCES if not rel.startswith("cube/policies/")
             for line, what in _imports_of(rel, ("cube.policies", "policies"))]
    _report(found, "cube/ imports the shipped policies")


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_imports_private_names_of_another():
    found = []
    for rel in SOURCES:
        for line, target, names in _imports(rel):
            if not _within(target, "cube"):
                continue
            bad = [n for n in names if _private(n)] + [p for p in target.split(".") if _private(p)]
            if bad:
                found.append(f"{rel}:{line}: from {target} import {', '.join(bad)}")
    _report(found, "private names imported from another cube module")


def test_codegen_does_not_name_build_plans():
    found = [f"{rel}:{i}: {text.strip()}"
             for rel in SOURCES if rel.startswith("cube/codegen/")
             for i, text in enumerate((ROOT / rel).read_text().splitlines(), 1) if "build_plans" in text]
    _report(found, "cube/codegen names build_plans (code generation prints the program the passes made)")


def _env_reads(rel: str) -> Iterator[Tuple[int, str]]:
    """``(line, how)`` of every read of the environment in ``rel``: ``os.environ``, ``os.getenv``
    (also through ``import os as x``) and ``from os import environ, getenv``."""
    _, tree = SOURCES[rel]
    aliases = {"os"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname for a in node.names if a.name == "os" and a.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                and isinstance(node.value, ast.Name) and node.value.id in aliases:
            yield node.lineno, f"{node.value.id}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module == "os" and not node.level:
            for a in node.names:
                if a.name in ("environ", "getenv", "environb"):
                    yield node.lineno, f"from os import {a.name}"


def test_environment_is_read_in_config_only():
    found = [f"{rel}:{line}: {how}" for rel in SOURCES if rel not in ENV_READERS
             for line, how in sorted(set(_env_reads(rel)))]
    _report(found, "environment variables read outside " + " and ".join(ENV_READERS))


@pytest.mark.parametrize("source,expected", [
    ("import cube.compiler\n", ["cube.compiler"]),
    ("def f():\n    from cube import sim\n", ["cube.sim"]),
    ("from ..compiler import CompiledStep\n", ["cube.compiler"]),
    ("from .. import sim\n", ["cube.sim"]),
    ("import importlib\nimportlib.import_module('policies.data')\n", ["policies.data"]),
    ("from cube.runtime import p2p\nimport torch\n", []),
])
def test_the_import_rules_see_every_form(source, expected, monkeypatch):
    """The checker itself: nested, relative and dynamic imports are found (``cube/runtime/x.py``)."""
    rel = "cube/runtime/x.py"
    monkeypatch.setitem(SOURCES, rel, ("cube.runtime.x", ast.parse(source)))
    assert [what for _, what in _imports_of(rel, ("cube.compiler", "cube.sim", "policies"))] == expected


def test_the_environment_rule_sees_every_form(monkeypatch):
    rel = "cube/runtime/x.py"
    source = "import os\nimport os as o\nfrom os import getenv\na = os.environ.get('A')\nb = o.getenv('B')\n"
    monkeypatch.setitem(SOURCES, rel, ("cube.runtime.x", ast.parse(source)))
    assert sorted(_env_reads(rel)) == [(3, "from os import getenv"), (4, "os.environ"), (5, "o.getenv")]
