"""Reading a rank's pieces of weights from files, without loading whole tensors.

``open_weights(path)`` recognizes:

- a safetensors file (``*.safetensors``): pieces are read with
  ``safe_open(...).get_slice``, so only the bytes of a piece are read;
- a directory with a ``*.index.json`` (the Hugging Face sharded layout; shards
  are safetensors or ``torch.save`` files), or a directory of ``*.safetensors``
  files without an index;
- a ``torch.save``d state dict (any other file), loaded memory-mapped
  (``torch.load(..., mmap=True)``): a piece touches only its pages;
- a cube checkpoint directory (``meta.json``): read through
  ``cube.runtime.checkpoint.load_checkpoint``, which reshards it.

Every reader knows the names and shapes in the file before reading any data, so
the checks of a load (missing, unexpected, mis-shaped tensors) are made from
file metadata alone, the same on every rank.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from cube.runtime import safetensors_file as sfile

PathLike = Union[str, os.PathLike]
Splits = Sequence[Tuple[int, int, int]]


class _SafetensorsFile:
    """One safetensors file, opened lazily. Complex tensors stored as their real views (listed in the
    file's metadata, ``cube.runtime.safetensors_file``: cube's merged checkpoints) read as complex."""

    def __init__(self, path: Path):
        from safetensors import safe_open
        self.path = path
        self.handle = safe_open(str(path), framework="pt", device="cpu")
        self.complex = sfile.complex_names(self.handle.metadata() or {}, path)

    def shapes(self) -> Dict[str, tuple]:
        out = {}
        for k in self.handle.keys():
            sl = self.handle.get_slice(k)
            shape = tuple(sl.get_shape())
            if k in self.complex:
                dtype = sfile.TORCH_DTYPES.get(sl.get_dtype())
                shape = sfile.as_complex(k, dtype, shape, self.complex[k], self.path)[1]
            out[k] = shape
        return out

    def read(self, key: str, splits: Splits, ndim: int) -> torch.Tensor:
        index = [slice(None)] * ndim
        for dim, start, stop in splits:
            index[dim] = slice(start, stop)
        sl = self.handle.get_slice(key)
        if key in self.complex:   # the real view has one more dim: (real, imaginary)
            return torch.view_as_complex(sl[tuple(index) + (slice(None),)].contiguous())
        return sl[tuple(index)] if ndim else sl[:]


class _TorchFile:
    """A ``torch.save``d state dict, memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            state = torch.load(str(path), map_location="cpu", mmap=True, weights_only=True)
        except Exception as e:  # not a zip-format torch file: say what the loader expected
            raise ValueError(f"cube.load_model(weights={str(path)!r}): the file is neither safetensors nor a "
                             f"torch.save'd state dict ({type(e).__name__}: {e})") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise TypeError(f"cube.load_model(weights={str(path)!r}): the file holds a {type(state).__name__}, "
                            f"not a state dict of tensors; save model.state_dict() with torch.save")
        self.state = state

    def shapes(self) -> Dict[str, tuple]:
        return {k: tuple(v.shape) for k, v in self.state.items()}

    def read(self, key: str, splits: Splits, ndim: int) -> torch.Tensor:
        t = self.state[key]
        for dim, start, stop in splits:
            t = t.narrow(dim, start, stop - start)
        return t


def _open_file(path: Path):
    return _SafetensorsFile(path) if path.suffix == ".safetensors" else _TorchFile(path)


class WeightFiles:
    """Tensors in one or more files, by the model's names (after ``rename``).

    Attributes:
        path: what the user passed.
        shapes: model name -> full shape in the file.
    """

    def __init__(self, path: Path, files: List[Path], rename: Optional[Callable[[str], Optional[str]]] = None,
                 key_files: Optional[Dict[str, Path]] = None):
        self.path = path
        self._files = {f: None for f in files}
        self._where: Dict[str, Tuple[Path, str]] = {}   # model name -> (file, key in the file)
        self.shapes: Dict[str, tuple] = {}
        for f in files:
            for key, shape in self._file(f).shapes().items():
                if key_files is not None and key_files.get(key) != f:
                    continue   # an index maps each key to one shard
                name = rename(key) if rename is not None else key
                if name is None:
                    continue
                if not isinstance(name, str):
                    raise TypeError(f"cube.load_model: rename({key!r}) returned {type(name).__name__}; it must "
                                    f"return the model's name for the file's tensor (a str), or None to skip it")
                if name in self._where:
                    raise ValueError(f"cube.load_model(weights={str(path)!r}): two tensors of the file map to "
                                     f"{name!r} ({self._where[name][1]!r} and {key!r}); fix rename")
                self._where[name] = (f, key)
                self.shapes[name] = shape

    def _file(self, f: Path):
        if self._files[f] is None:
            self._files[f] = _open_file(f)
        return self._files[f]

    def read(self, name: str, splits: Splits) -> torch.Tensor:
        """The piece ``splits`` of tensor ``name`` (a model name)."""
        f, key = self._where[name]
        return self._file(f).read(key, splits, len(self.shapes[name]))


def is_cube_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a directory written by ``cube.save_checkpoint``."""
    p = Path(path)
    return p.is_dir() and (p / "meta.json").is_file() and any(p.glob("rank*.pt"))


def open_weights(path: PathLike, rename: Optional[Callable[[str], Optional[str]]] = None) -> WeightFiles:
    """The weights at ``path`` (a file or a Hugging Face sharded directory; not a cube checkpoint).

    Args:
        path: a safetensors file, a ``torch.save``d state dict, or a directory
            holding ``*.index.json`` or ``*.safetensors`` files.
        rename: maps a name in the file to the model's name (None: skip the tensor).

    Raises:
        ValueError: ``path`` does not exist, or a directory holds no weights.
    """
    p = Path(path)
    if p.is_file():
        return _from_index(p, rename) if p.name.endswith(".index.json") else WeightFiles(p, [p], rename)
    if not p.is_dir():
        raise ValueError(f"cube.load_model(weights={str(path)!r}): no such file or directory")
    indexes = sorted(p.glob("*.index.json"))
    if len(indexes) > 1:
        raise ValueError(f"cube.load_model(weights={str(path)!r}): the directory holds several index files "
                         f"({', '.join(i.name for i in indexes)}); pass the path of one of them")
    if indexes:
        return _from_index(indexes[0], rename)
    shards = sorted(p.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"cube.load_model(weights={str(path)!r}): the directory holds no *.index.json, no "
                         f"*.safetensors and no cube checkpoint (meta.json); pass a weights file or directory")
    return WeightFiles(p, shards, rename)


def _from_index(index: Path, rename) -> WeightFiles:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
        raise ValueError(f"cube.load_model: {str(index)!r} is not a weights index (a JSON object with a "
                         f"'weight_map' of tensor name -> shard file)") from e
    key_files = {k: index.parent / v for k, v in weight_map.items()}
    files = sorted(set(key_files.values()))
    lost = [str(f) for f in files if not f.is_file()]
    if lost:
        raise ValueError(f"cube.load_model: the index {str(index)!r} names shard files that do not exist: "
                         f"{', '.join(lost)}")
    return WeightFiles(index, files, rename, key_files)
