"""A small JSON cache on disk, shared by the profiler and the communication model.

Entries live in ``<cache dir>/sim/<name>.json`` (``CUBE_CACHE_DIR``, else
``~/.cache/cube``). Saving merges with what is on disk and replaces the file
atomically, so several processes measuring at once lose nothing but duplicates.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional, Union

from cube import config


def default_path(name: str) -> Path:
    """``<cache dir>/sim/<name>.json``."""
    return config.cache_dir() / "sim" / f"{name}.json"


class JsonStore:
    """A dict persisted as one JSON file.

    Args:
        path: the file; None keeps the entries in memory only.
    """

    def __init__(self, path: Optional[Union[str, os.PathLike]]):
        self.path = Path(path) if path is not None else None
        self.data: dict = self._read()
        self.dirty = False

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}   # a damaged cache is measured again, not fatal

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        self.dirty = True

    def save(self) -> None:
        """Writes new entries (merged with the file's current content)."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        merged = self._read()
        merged.update(self.data)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self.data = merged
        self.dirty = False
