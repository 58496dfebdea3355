"""Text for examples/text/train.py: a corpus, byte-level tokens, train/validation splits and batches.

The default corpus is made on this machine, without a network, from text
every Python install has: the documentation strings of a fixed list of
standard-library modules (each module's, then its public classes', functions'
and methods' in name order), about 425 KB of English prose and code examples.
It is written once to ``<cube cache dir>/text/stdlib-docs-py<X.Y>.txt``
(``CUBE_CACHE_DIR`` moves it) and read from there afterwards. The same Python
version gives the same bytes; another version may change a docstring here and
there, so pass ``--data PATH`` (any UTF-8 or binary file) for text that is the
same everywhere.

Tokens are bytes (vocabulary 256): nothing to download or train, any file
works, and the model sees exactly the file. None of the installed packages
ships a real BPE vocabulary (``tokenizers`` and ``transformers`` fetch theirs
from a hub), and a byte model on half a megabyte is the honest small case.

Batches: the first 90% of the tokens are the train split, the last 10% the
validation split, and no window crosses the cut. Global batch ``i`` is
``batch`` windows of ``seq + 1`` tokens at offsets drawn by a generator seeded
with ``(seed, i)``: every rank draws the same global batches (cube hands each
rank its part), and a run resumed at step ``k`` continues with batch ``k``.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import os
import sys
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import torch

VOCAB_SIZE = 256   # byte-level
VAL_FRACTION = 0.1

# pure-Python modules of every CPython 3.10-3.12 build (no optional C extension, no Tk)
STDLIB_MODULES = (
    "abc", "argparse", "ast", "base64", "bisect", "calendar", "collections", "colorsys", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "inspect", "ipaddress", "itertools", "json", "logging", "mailbox", "math", "numbers", "operator", "optparse",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "reprlib", "sched", "secrets", "shlex", "shutil",
    "smtplib", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile", "textwrap", "threading",
    "timeit", "tokenize", "traceback", "typing", "unittest", "urllib.parse", "uuid", "warnings", "wave",
    "weakref", "zipfile",
)


def stdlib_text(modules=STDLIB_MODULES) -> str:
    """The documentation strings of ``modules``, in a fixed order, as one text."""
    parts: List[str] = []

    def add(title: str, obj) -> None:
        doc = inspect.getdoc(obj)
        if doc:
            parts.append(f"{title}\n\n{doc}")

    for name in modules:
        module = importlib.import_module(name)
        add(name, module)
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if attr.startswith("_") or getattr(obj, "__module__", None) != name:
                continue   # private, or imported from elsewhere
            if inspect.isfunction(obj):
                add(f"{name}.{attr}", obj)
            elif inspect.isclass(obj):
                add(f"{name}.{attr}", obj)
                for method, fn in sorted(vars(obj).items()):
                    if not method.startswith("_") and inspect.isfunction(fn):
                        add(f"{name}.{attr}.{method}", fn)
    return "\n\n".join(parts) + "\n"


def default_corpus(cache_dir: Optional[os.PathLike] = None) -> Path:
    """The stdlib corpus file, written on first use (atomically: ranks may race to write it)."""
    if cache_dir is None:
        from cube import config
        cache_dir = config.cache_dir()
    path = Path(cache_dir) / "text" / f"stdlib-docs-py{sys.version_info[0]}.{sys.version_info[1]}.txt"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(stdlib_text().encode("utf-8"))
        os.replace(tmp, path)
    return path


def encode(text: str) -> torch.Tensor:
    """Byte-level tokens of ``text`` (UTF-8)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens) -> str:
    """The text of byte tokens (bytes that are not valid UTF-8 become U+FFFD)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class TextData:
    """A file's bytes, split into a train part (first 90%) and a validation part (last 10%)."""

    def __init__(self, path: Optional[os.PathLike] = None, seq: int = 64):
        self.path = Path(path) if path is not None else default_corpus()
        raw = self.path.read_bytes()
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.tokens = (torch.frombuffer(bytearray(raw), dtype=torch.uint8).long() if raw
                       else torch.zeros(0, dtype=torch.long))
        self.seq = seq
        cut = int(len(self.tokens) * (1 - VAL_FRACTION))
        self.train, self.val = self.tokens[:cut], self.tokens[cut:]
        for name, part in (("train", self.train), ("validation", self.val)):
            if len(part) < seq + 1:
                raise ValueError(f"{self.path}: the {name} split has {len(part)} bytes, fewer than seq + 1 = "
                                 f"{seq + 1}; use a longer file or a shorter --seq")

    def batches(self, split: str, batch: int, seed: int = 0, start: int = 0) -> "Batches":
        """Endless global batches of ``split`` ("train" or "val"), from batch number ``start``."""
        return Batches({"train": self.train, "val": self.val}[split], batch, self.seq, seed, start)


class Batches:
    """Global batch ``i``: ``batch`` random windows of ``seq + 1`` tokens -> ``(ids[:, :-1], ids[:, 1:])``,
    the offsets drawn by a generator seeded with ``(seed, i)`` (the same on every rank, for any start)."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int = 0, start: int = 0):
        self.tokens, self.batch, self.seq, self.seed, self.step = tokens, batch, seq, seed, start

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> Tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.step)
        self.step += 1
        starts = torch.randint(0, len(self.tokens) - self.seq, (self.batch,), generator=gen)
        windows = torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
