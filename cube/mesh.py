"""Devices as a grid with named dimensions, so a policy never computes device numbers.

``DeviceMesh(("pp", 2), ("dp", 2), ("tp", 2))`` numbers its 8 devices row-major,
the last dimension innermost, as Megatron orders ranks (tensor parallel
neighbours differ by 1, pipeline stages by ``dp * tp``)::

    mesh = DeviceMesh(("pp", 2), ("dp", 2), ("tp", 2))
    mesh.device(pp=1, dp=0, tp=1)   # 5
    mesh.select(pp=1).devices       # (4, 5, 6, 7): a ("dp", "tp") mesh
    mesh["tp"].size                 # 2
"""
from __future__ import annotations

import contextlib
import math
from typing import List, Sequence, Tuple, Union


_OBSERVERS: List = []   # functions called with every mesh made (``observe``)


@contextlib.contextmanager
def observe(fn):
    """Calls ``fn(mesh)`` for every ``DeviceMesh`` made inside the block (the simulator learns a
    policy's mesh this way, to plan one rank of each symmetric class)."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)


class MeshDim:
    """One named dimension of a mesh (``mesh["tp"]``): what a split goes over.

    Attributes:
        mesh: the mesh it belongs to.
        name: its name.
        size: how many coordinates it has (the pieces a split over it makes).
    """

    __slots__ = ("mesh", "name", "size")

    def __init__(self, mesh: "DeviceMesh", name: str, size: int):
        self.mesh, self.name, self.size = mesh, name, size

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"MeshDim({self.name!r}, {self.size})"


class DeviceMesh:
    """Devices laid out on named dimensions, numbered row-major (last dimension innermost).

    Args:
        *dims: ``(name, size)`` pairs, outermost first.
        devices: the first device number (the mesh holds ``devices .. devices + size - 1``),
            or the devices themselves in row-major order.

    Raises:
        ValueError: a dimension that is not a ``(name, positive size)`` pair, a name used
            twice, or a device list of the wrong length.
    """

    __slots__ = ("names", "shape", "devices", "_slices")

    def __init__(self, *dims: Tuple[str, int], devices: Union[int, Sequence[int]] = 0):
        for d in dims:
            if not (isinstance(d, tuple) and len(d) == 2 and isinstance(d[0], str) and isinstance(d[1], int)
                    and not isinstance(d[1], bool) and d[1] >= 1):
                raise ValueError(f"DeviceMesh: each dimension is a (name, positive size) pair such as "
                                 f"('tp', 2), got {d!r}")
        names = tuple(d[0] for d in dims)
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceMesh: dimension names must differ, got {list(names)}")
        size = math.prod(d[1] for d in dims)
        if isinstance(devices, int):
            devs = tuple(range(devices, devices + size))
        else:
            devs = tuple(devices)
            if len(devs) != size:
                raise ValueError(f"DeviceMesh{tuple(dims)} holds {size} devices, got {len(devs)}: {list(devs)}")
        self.names: Tuple[str, ...] = names
        self.shape: Tuple[int, ...] = tuple(d[1] for d in dims)
        self.devices: Tuple[int, ...] = devs
        self._slices: dict = {}   # name -> slices(name); a mesh never changes, and policies ask per op
        for observer in _OBSERVERS:
            observer(self)

    @property
    def size(self) -> int:
        """The number of devices."""
        return len(self.devices)

    @property
    def dims(self) -> Tuple[Tuple[str, int], ...]:
        return tuple(zip(self.names, self.shape))

    def __getitem__(self, name: str) -> MeshDim:
        return MeshDim(self, name, self.shape[self._axis(name)])

    def __contains__(self, name: str) -> bool:
        """Whether ``name`` is a dimension of the mesh."""
        return name in self.names

    def _axis(self, name: str) -> int:
        if name not in self.names:
            raise KeyError(f"DeviceMesh{self.dims} has no dimension {name!r}; it has {list(self.names)}")
        return self.names.index(name)

    def select(self, **coords: int) -> "DeviceMesh":
        """The sub-mesh at the given coordinates: those dimensions dropped, the others kept in order.

        ``mesh.select(pp=1)`` of a ``pp x dp x tp`` mesh is stage 1's ``dp x tp`` mesh.

        Raises:
            KeyError: an unknown dimension.
            ValueError: a coordinate out of range.
        """
        strides = [math.prod(self.shape[a + 1:]) for a in range(len(self.shape))]
        base, keep = 0, list(range(len(self.names)))
        for name, k in coords.items():
            axis = self._axis(name)
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < self.shape[axis]:
                raise ValueError(f"DeviceMesh{self.dims}: {name}={k!r} is out of range 0..{self.shape[axis] - 1}")
            base += k * strides[axis]
            keep.remove(axis)
        offsets = [base]
        for a in keep:   # row-major over the dimensions left
            offsets = [o + k * strides[a] for o in offsets for k in range(self.shape[a])]
        devs = [self.devices[o] for o in offsets]
        return DeviceMesh(*[(self.names[a], self.shape[a]) for a in keep], devices=devs)

    def slices(self, name: str) -> List["DeviceMesh"]:
        """One sub-mesh per coordinate of ``name`` (``mesh.slices("pp")``: each stage's devices)."""
        if name not in self._slices:
            self._slices[name] = [self.select(**{name: k}) for k in range(self[name].size)]
        return list(self._slices[name])

    def factor(self, name: str, **parts: int) -> "DeviceMesh":
        """The same devices with dimension ``name`` factored into ``parts`` (outermost first), so
        a split can go over a part of it: ``mesh.factor("dp", edp=2, ep=2)`` of a ``dp = 4``
        mesh has ``edp`` and ``ep`` in its place, ``ep`` innermost (neighbours differ by 1).

        Raises:
            KeyError: an unknown dimension.
            ValueError: the parts' sizes do not multiply to the dimension's size.
        """
        axis = self._axis(name)
        if math.prod(parts.values()) != self.shape[axis]:
            raise ValueError(f"DeviceMesh{self.dims}: {name}={self.shape[axis]} does not factor into "
                             f"{dict(parts)}; the sizes must multiply to {self.shape[axis]}")
        dims = self.dims[:axis] + tuple(parts.items()) + self.dims[axis + 1:]
        return DeviceMesh(*dims, devices=self.devices)

    def device(self, **coords: int) -> int:
        """The device at a full set of coordinates.

        Raises:
            ValueError: not every dimension is given.
        """
        if set(coords) != set(self.names):
            raise ValueError(f"DeviceMesh.device needs every dimension {list(self.names)}, got {sorted(coords)}")
        return self.select(**coords).devices[0]

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and (self.dims, self.devices) == (other.dims, other.devices)

    def __hash__(self) -> int:
        return hash((self.dims, self.devices))

    def __repr__(self) -> str:
        dims = ", ".join(repr(d) for d in self.dims)
        return f"DeviceMesh({dims}{', ' if dims else ''}devices={list(self.devices)})"


def consecutive(sizes: Sequence[int], name: str = "dp") -> List[DeviceMesh]:
    """One 1-D mesh per size, laid out one after another (``[1, 2]``: devices ``(0,)`` and ``(1, 2)``).

    For pipelines whose stages run on different numbers of devices (PipeDream).
    """
    out, first = [], 0
    for n in sizes:
        out.append(DeviceMesh((name, n), devices=first))
        first += n
    return out
