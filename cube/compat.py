"""``import policies``, the shipped policies' old top-level name, where nothing else answers it.

The policies ship as ``cube.policies``; no top-level ``policies`` package is installed, so cube
never shadows a user's own module of that name. A checkout's ``policies/`` folder re-exports
``cube.policies`` for scripts run from the repository. For an installed cube, ``install()`` (run
by ``import cube``) adds a finder that answers ``policies`` with ``cube.policies`` only when no
other finder knows the name, and then ``policies.<name>`` with ``cube.policies.<name>`` (the same
module objects). A user's ``policies`` module or package always wins.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

OLD, NEW = "policies", "cube.policies"


class PoliciesAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``policies[.name]`` with the ``cube.policies`` modules (see the module docstring)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == OLD:
            others = [f for f in sys.meta_path if f is not self and hasattr(f, "find_spec")]
            if any(f.find_spec(fullname, path, target) is not None for f in others):
                return None   # a module of that name exists (the user's, or a checkout's shim)
        elif not (fullname.startswith(OLD + ".") and sys.modules.get(OLD) is sys.modules.get(NEW)):
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=fullname == OLD)

    def create_module(self, spec):
        return importlib.import_module(NEW + spec.name[len(OLD):])

    def exec_module(self, module):
        pass   # the cube.policies module is already executed


def install() -> None:
    """Adds the finder once (first in ``sys.meta_path``; it defers to every other finder)."""
    if not any(isinstance(f, PoliciesAlias) for f in sys.meta_path):
        sys.meta_path.insert(0, PoliciesAlias())
