"""What ``pip install`` ships: the shipped policies live in ``cube.policies`` (no top-level
``policies`` package to clash with a user's module of that name), and the repository's
``policies/`` folder keeps the old imports working from a checkout."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def _setup_packages() -> list:
    """The packages ``setup.py`` installs: its ``find_packages(include=[...])`` run from the root."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    packages = next(k.value for k in call.keywords if k.arg == "packages")
    assert isinstance(packages, ast.Call) and packages.func.id == "find_packages", ast.dump(packages)
    include = ast.literal_eval(next(k.value for k in packages.keywords if k.arg == "include"))
    return find_packages(where=str(ROOT), include=include)


def test_setup_installs_cube_policies_and_no_top_level_policies():
    packages = _setup_packages()
    assert "cube.policies" in packages and "cube" in packages
    tops = sorted({p.split(".")[0] for p in packages})
    assert tops == ["cube"], f"setup.py installs top-level packages {tops}; only cube should be"


def test_old_policies_imports_are_the_cube_policies_modules():
    import cube.policies.data
    import cube.policies.megatron3d
    import policies
    import policies.megatron3d
    from policies.data import PASData
    assert PASData is cube.policies.data.PASData
    assert policies.megatron3d is cube.policies.megatron3d
    assert policies.resolve("PASData") == "cube.policies.data:PASData"


def test_every_shipped_policy_resolves_inside_cube_and_the_old_strings_load():
    from cube.policy import SHIPPED, load_policy
    for name, module in SHIPPED.items():
        assert module.startswith("cube.policies."), (name, module)
        assert load_policy(name) is load_policy(f"policies.{module.rsplit('.', 1)[1]}:{name}")
    assert load_policy(str(ROOT / "policies" / "data.py") + ":PASData") is load_policy("PASData")


def test_the_compatibility_folder_has_a_module_for_every_policy_module():
    moved = {p.stem for p in (ROOT / "cube" / "policies").glob("*.py")}
    kept = {p.stem for p in (ROOT / "policies").glob("*.py")}
    assert moved == kept, f"policies/ lacks {sorted(moved - kept)} or has extra {sorted(kept - moved)}"


def _installed_like(tmp_path) -> dict:
    """An environment where ``cube`` is importable but the repository (and its ``policies/``
    folder) is not on the path, as after ``pip install``."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "cube").symlink_to(ROOT / "cube")
    return {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}


def _python(code: str, cwd, env) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_installed_cube_answers_the_old_import_with_cube_policies(tmp_path):
    code = ("import cube, cube.policies.data, policies, policies.megatron3d\n"
            "from policies.data import PASData\n"
            "print(policies is cube.policies, PASData is cube.policies.data.PASData,\n"
            "      policies.megatron3d is cube.policies.megatron3d, cube.policy.load_policy('PASData') is PASData)")
    assert _python(code, tmp_path, _installed_like(tmp_path)) == "True True True True"


def test_a_users_own_policies_module_wins(tmp_path):
    env = _installed_like(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "policies.py").write_text("MINE = True\n")
    assert _python("import sys, cube, policies; print(policies.MINE, 'cube.policies' in sys.modules)", work, env) == \
        "True False"
    assert _python("import cube\ntry:\n    import policies.data\nexcept ImportError:\n    print('refused')",
                   work, env) == "refused"
