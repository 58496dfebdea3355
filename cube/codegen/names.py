"""Readable, unique Python names for IR values (chosen only when printing)."""
from __future__ import annotations

import keyword
import re
from typing import Dict


class Namer:
    """Gives each object one identifier, unique within one generated module."""

    def __init__(self):
        self.names: Dict[int, str] = {}
        self.used: Dict[str, int] = {}

    def __call__(self, obj, hint: str) -> str:
        key = id(obj)
        if key in self.names:
            return self.names[key]
        base = re.sub(r"\W", "_", hint).strip("_") or "v"
        if base[0].isdigit() or keyword.iskeyword(base) or base in ("self", "torch", "aten", "runtime"):
            base = "v_" + base
        name = base
        while name in self.used:
            self.used[base] += 1
            name = f"{base}_{self.used[base]}"
        self.used.setdefault(base, 0)
        self.used[name] = self.used.get(name, 0)
        self.names[key] = name
        return name
