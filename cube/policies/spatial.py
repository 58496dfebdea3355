"""PASSpatial: spatial partitioning (DistDL-like) for convolutional and stencil models.

Every op whose first input is a field ``(batch, channels, H, W, ...)`` (convolutions, pooling,
batch norm, elementwise ops) is split over a grid of devices along its spatial dims; each
device holds one even block of the field. cube exchanges halos between neighbouring blocks
inside the convolutions' and poolings' calls and sums batch-norm statistics over the grid.
Ops that are not fields (a flatten and linear head, the loss) run whole on every device,
reading the field gathered. An op whose split cube would refuse (a block smaller than its
kernel, sizes the grid does not divide) also runs whole, so any model gets an exact plan.
"""
from typing import Sequence, Tuple, Union

from cube.ir import IRGraph
from cube.ir.operator import IRFwOperation
from cube.mesh import DeviceMesh
from cube.toolkit import place

_AXES = {"H": 2, "W": 3, "D": 4}


def _grid(dims: str, grid, ngpus: int) -> Tuple[int, ...]:
    if grid is None:
        if len(dims) == 1:
            return (ngpus,)
        side = int(round(ngpus ** (1 / len(dims))))
        grid = (side,) * len(dims)
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if len(grid) != len(dims):
        raise ValueError(f"PASSpatial: grid={grid} needs one size per split dim of dims={dims!r}")
    n = 1
    for g in grid:
        n *= g
    if n != ngpus:
        raise ValueError(f"PASSpatial: grid {grid} holds {n} devices, the world has {ngpus}; "
                         f"pass grid= whose product is {ngpus}")
    return grid


def _splittable(op: IRFwOperation, axes: Sequence[int], grid: Sequence[int]) -> bool:
    x = op.inputs[0] if op.inputs else None
    if x is None or x.ndim < 2 + len(axes) or op.anno is None:
        return False
    algo = op.algorithms("dim")
    return all(algo.satisfy(0, d, n) for d, n in zip(axes, grid))


def PASSpatial(graph: IRGraph, resource, dims: str = "H", grid: Union[int, Sequence[int], None] = None) -> IRGraph:
    """Splits every field op over a grid of devices along its spatial dims (module docstring).

    Args:
        dims: the spatial dims split, ``"H"``, ``"W"``, ``"HW"`` (``H`` is dim 2 of a field, ``W``
            dim 3, ``D`` dim 4).
        grid: devices per split dim (default: all devices along one dim, or a square grid).

    Raises:
        ValueError: unknown dims, or a grid that does not hold the world's devices.
    """
    if not dims or any(c not in _AXES for c in dims.upper()):
        raise ValueError(f"PASSpatial: dims={dims!r}: give spatial dims among {''.join(_AXES)} (e.g. 'H', 'HW')")
    axes = [_AXES[c] for c in dims.upper()]
    sizes = _grid(dims, grid, resource.ngpus)
    names = [f"s{a}" for a in axes]
    mesh = DeviceMesh(*zip(names, sizes))
    for op in graph.nodes():
        if isinstance(op, IRFwOperation) and _splittable(op, axes, sizes):
            place(graph, op, mesh, **{n: (0, a) for n, a in zip(names, axes)})
        else:
            place(graph, op, mesh)
    return graph
