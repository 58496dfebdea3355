"""The safetensors file format, read and written one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}``, offsets relative to the end of the header) and the tensors' raw
bytes. The ``safetensors`` package writes a file from a dict of every tensor in
it; checkpoints write the format by hand instead, so a file is produced from a
list of entries whose tensors are made (assembled, copied off a device) one at a
time, written and freed: a writer holds one tensor, never the file. Reads use
plain file reads at the header's offsets (no memory map), so only the tensor
being read is resident.

The format has no complex dtypes. A complex tensor (a rotary ``freqs_cis``
buffer, a complex parameter) is stored as its real view
(``torch.view_as_real``: the same bytes, a float dtype of half the size, and a
last dim of 2 for the real and imaginary parts), and the file's metadata lists
it under ``"cube.complex"``: a JSON object of name -> complex dtype
(``{"freqs": "complex64"}``). ``read_header`` gives such a tensor back as the
complex tensor it was; other readers (the ``safetensors`` package) see its real
view, which ``torch.view_as_complex`` turns back.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
COMPLEX = "cube.complex"   # metadata key: JSON {name: complex dtype} of tensors stored as their real view
REAL_OF = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}
_COMPLEX_NAMES = {str(c).replace("torch.", ""): c for c in REAL_OF}
_ALIGN = 8   # header padded with spaces so the data starts 8-byte aligned, as the safetensors writer does


@dataclass(frozen=True)
class Slot:
    """One tensor in a safetensors file: where its bytes are and what they hold."""
    path: Path
    offset: int   # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: Tuple[int, ...]

    def read(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out

    def read_into(self, dst: torch.Tensor) -> None:
        """Copies the tensor into ``dst`` (its shape); straight from the file when ``dst`` is contiguous."""
        if not dst.is_contiguous():
            dst.copy_(self.read())
            return
        if self.nbytes == 0:
            return
        view = memoryview(dst.reshape(-1).view(torch.uint8).numpy())
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            got = f.readinto(view)
        if got != self.nbytes:
            raise ValueError(f"safetensors file {str(self.path)!r} is cut short: {self.nbytes} bytes expected at "
                             f"offset {self.offset}, {got} read; write it again")


@dataclass(frozen=True)
class Entry:
    """A tensor to write: its name, dtype and shape up front, and a function that makes it."""
    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def write(f: BinaryIO, entries: Sequence[Entry], metadata: Optional[Dict[str, str]] = None) -> None:
    """Writes ``entries`` as one safetensors file to ``f``, one tensor at a time.

    A complex tensor is written as its real view and listed in the metadata
    under ``COMPLEX`` (see the module docstring).

    Raises:
        TypeError: a dtype the format has no name for (and that is not complex).
        ValueError: two entries of one name, or a made tensor whose dtype or shape
            differs from its entry's.
    """
    header: Dict[str, dict] = {"__metadata__": dict(metadata or {"format": "pt"})}
    complex_: Dict[str, str] = {}
    offset = 0
    for e in entries:
        dtype, shape = e.dtype, list(e.shape)
        if dtype in REAL_OF:
            complex_[e.name] = str(dtype).replace("torch.", "")
            dtype, shape = REAL_OF[dtype], shape + [2]
        if dtype not in DTYPES:
            raise TypeError(f"tensor {e.name!r} has dtype {e.dtype}, which safetensors cannot store; convert it "
                            f"to one of {sorted(str(d).replace('torch.', '') for d in DTYPES)} or a complex dtype")
        if e.name in header:
            raise ValueError(f"two tensors are named {e.name!r}; a safetensors file holds each name once")
        header[e.name] = {"dtype": DTYPES[dtype], "shape": shape, "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    if complex_:
        header["__metadata__"][COMPLEX] = json.dumps(complex_, separators=(",", ":"))
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for e in entries:
        t = e.make()
        if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
            raise ValueError(f"tensor {e.name!r} was announced as {e.dtype} {list(e.shape)} but is {t.dtype} "
                             f"{list(t.shape)}")
        t = t.detach().cpu()
        if t.is_complex():   # the same bytes as its real view: real and imaginary parts interleaved
            t = torch.view_as_real(t.resolve_conj())
        t = t.contiguous()
        if t.numel():
            f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        del t


def read_header(path: Union[str, Path]) -> Tuple[Dict[str, Slot], Dict[str, str]]:
    """The tensors of a safetensors file (name -> :class:`Slot`) and its metadata, without reading data.

    Raises:
        ValueError: not a safetensors file, or a header that does not fit the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        try:
            if n < 2 or 8 + n > size:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{str(path)!r} is not a safetensors file ({e}); write it again") from None
    metadata = header.pop("__metadata__", None) or {}
    complex_ = complex_names(metadata, path)
    slots = {}
    for name, h in header.items():
        begin, end = h["data_offsets"]
        if h["dtype"] not in TORCH_DTYPES:
            raise ValueError(f"tensor {name!r} in {str(path)!r} has dtype {h['dtype']}, which cube cannot read")
        dtype, shape = TORCH_DTYPES[h["dtype"]], tuple(h["shape"])
        if name in complex_:
            dtype, shape = as_complex(name, dtype, shape, complex_[name], path)
        slot = Slot(path, 8 + n + begin, end - begin, dtype, shape)
        expected = _itemsize(slot.dtype)
        for s in slot.shape:
            expected *= s
        if expected != slot.nbytes or slot.offset + slot.nbytes > size:
            raise ValueError(f"tensor {name!r} in {str(path)!r} does not fit the file (cut short or corrupt); "
                             f"write it again")
        slots[name] = slot
    return slots, metadata


def complex_names(metadata: Dict[str, str], path: Union[str, Path]) -> Dict[str, torch.dtype]:
    """Name -> complex dtype of the tensors a file stores as their real views (its ``COMPLEX`` metadata).

    Raises:
        ValueError: the metadata entry is not a JSON object of names to complex dtype names.
    """
    text = metadata.get(COMPLEX)
    if text is None:
        return {}
    try:
        names = json.loads(text)
        return {k: _COMPLEX_NAMES[v] for k, v in names.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{str(path)!r} has a corrupt {COMPLEX!r} metadata entry ({text[:80]!r}; a JSON object of "
                         f"tensor name -> one of {sorted(_COMPLEX_NAMES)} was expected); write it again") from None


def as_complex(name: str, dtype: Optional[torch.dtype], shape: Tuple[int, ...], complex_dtype: torch.dtype,
               path: Union[str, Path]) -> Tuple[torch.dtype, Tuple[int, ...]]:
    """The complex dtype and shape of a tensor stored as its real view ``(dtype, shape)``.

    Raises:
        ValueError: the stored tensor is not the real view of ``complex_dtype`` (wrong dtype, or a last
            dim other than 2).
    """
    if REAL_OF[complex_dtype] != dtype or not shape or shape[-1] != 2:
        raise ValueError(f"tensor {name!r} in {str(path)!r} is listed as {complex_dtype} but stored as {dtype} "
                         f"{list(shape)}, not its real view ({REAL_OF[complex_dtype]} [..., 2]); write it again")
    return complex_dtype, shape[:-1]


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from ``2_000_000_000``, ``"2GB"`` (10**9) or ``"2GiB"`` (2**30), as Hugging Face reads them.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size), re.IGNORECASE)
        if m is None:
            raise ValueError(f"max_shard_size={size!r} is not a size; pass bytes (an int) or a string such as "
                             f"'2GB' or '500MB'")
        value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r} must be positive")
    return value


def plan_shards(entries: Sequence[Entry], max_bytes: int) -> List[List[Entry]]:
    """Consecutive entries grouped into shards of at most ``max_bytes`` (a larger tensor: a shard of its own)."""
    shards: List[List[Entry]] = []
    size = 0
    for e in entries:
        if not shards or (size + e.nbytes > max_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += e.nbytes
    return shards
