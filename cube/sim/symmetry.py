"""Simulating thousands of ranks by simulating one rank of each symmetric class.

Ranks that run the same program up to renaming are simulated once. Two folds,
both read from the policy's ``DeviceMesh`` (its dimensions named ``dp`` and
``tp``; a policy without a mesh is simulated rank by rank):

- **Data parallel folded to 2.** A plan on ``dp`` replicas is traced and
  planned with 2 (the batch cut to ``2/dp`` of it, so each replica keeps its
  part): every replica runs the same program, and the second one is there so
  the program holds the gradient all-reduces. A plan that cuts ``dp`` into
  groups of ``k`` neighbours (context parallel's ``cp``, expert parallel's
  ``ep``) folds to 2 such groups, each kept whole (``Fold.inner``). Their cost is that of the real
  group: a collective over the folded ``dp`` coordinates is costed over all
  ``dp`` of them, on the real ranks (node placement included).
- **One rank per class.** Only ranks at coordinate 0 of ``dp`` and ``tp`` (and
  any rank they receive point to point from) get programs; a collective waits
  for its simulated members only, the others being copies that arrive at the
  same time.

- **Micro-batches.** A pipeline of ``pp`` stages given more micro-batches
  (``options["nmicros"]``) than it needs to reach its steady state is simulated
  with ``pp + 1`` of them (``3 pp`` when interleaved or DualPipeV), the batch cut to match,
  each micro-batch as large as in the real step. In the steady state each
  further micro-batch adds the slowest pipeline rank's per-micro-batch work
  (forward, backward, recompute and the collectives they wait on; the gradient
  accumulation that the first micro-batch skips counted as the others pay it),
  so the step time grows by that for each micro-batch not simulated. The memory peak is a
  steady state's (every gradient made, at most ``pp`` micro-batches in flight),
  which the simulated micro-batches reach. Expert parallel plans fold the same
  way (their all-to-alls are collectives of that work); context parallel plans
  are simulated with every micro-batch (the messages of their ring attention
  are not in the per-micro-batch work: extrapolated, a step came out 2.5% short).

ZeRO folds too (stages 1 to 3): each gradient bucket's shard is cut over the
real ``dp`` ranks (``MappedComm.group_size``), so a rank's optimizer state,
ZeRO-2's gradients and ZeRO-3's parameter chunks, and the reduce-scatters and
all-gathers (ZeRO-3's gathers of every bucket before the forward), are the
real ones. What is not folded: meshes whose ``dp`` does not divide the batch;
those plans are simulated in full.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

from cube.mesh import DeviceMesh, observe

SYMMETRIC = ("dp", "tp")


class _Seen(Exception):
    def __init__(self, mesh: DeviceMesh):
        super().__init__("mesh seen")
        self.mesh = mesh


def policy_mesh(run_policy, world: int) -> Optional[DeviceMesh]:
    """The first mesh over devices ``0..world-1`` that ``run_policy()`` makes; the policy is stopped
    there (before it partitions anything). None when it makes none."""
    def seen(mesh: DeviceMesh) -> None:
        if mesh.devices == tuple(range(world)):
            raise _Seen(mesh)
    try:
        with observe(seen):
            run_policy()
    except _Seen as s:
        return s.mesh
    return None


def _unravel(r: int, shape: Sequence[int]) -> Tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(r % s)
        r //= s
    return tuple(reversed(out))


def _ravel(coords: Sequence[int], shape: Sequence[int]) -> int:
    r = 0
    for c, s in zip(coords, shape):
        r = r * s + c
    return r


@dataclass(frozen=True)
class Fold:
    """The folded world and how its ranks map to the real ones.

    Attributes:
        names: the mesh's dimension names.
        shape: its folded shape (``dp`` at most 2); ``real``: the real one.
        batch: ``(num, den)``: the folded global batch is ``batch * num / den`` samples.
    """
    names: Tuple[str, ...]
    shape: Tuple[int, ...]
    real: Tuple[int, ...]
    inner: int = 1   # groups of this many neighbours inside ``dp`` (context or expert parallel) kept whole

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def real_world(self) -> int:
        return math.prod(self.real)

    @property
    def batch(self) -> Tuple[int, int]:
        return self.world, self.real_world

    @property
    def folded(self) -> bool:
        return self.shape != self.real

    def real_rank(self, r: int) -> int:
        return _ravel(_unravel(r, self.shape), self.real)

    def real_group(self, ranks: Iterable[int]) -> Tuple[int, ...]:
        """The real ranks a collective over folded ``ranks`` joins: a group covering every folded
        ``dp`` coordinate covers every real one."""
        coords = {_unravel(r, self.shape) for r in ranks}
        k = self.inner   # a folded coordinate is (outer, inner): only the outer one is folded
        for axis, (n, size) in enumerate(zip(self.shape, self.real)):
            if n != size and {c[axis] // k for c in coords} == set(range(n // k)):
                coords = {c[:axis] + (d * k + c[axis] % k,) + c[axis + 1:] for c in coords for d in range(size // k)}
        return tuple(sorted(_ravel(c, self.real) for c in coords))

    def representatives(self) -> Tuple[int, ...]:
        """Folded ranks at coordinate 0 of every symmetric dimension."""
        axes = [a for a, n in enumerate(self.names) if n in SYMMETRIC]
        return tuple(r for r in range(self.world) if all(_unravel(r, self.shape)[a] == 0 for a in axes))


def fold_for(mesh: Optional[DeviceMesh], world: int, batch_size: Optional[int], zero: int = 0,
             inner: int = 1) -> Fold:
    """How to fold ``world`` ranks planned on ``mesh`` with a global batch of ``batch_size``.

    ``inner``: the policy cuts ``dp`` into groups of this many neighbours (context parallel's
    ``cp``, expert parallel's ``ep``): ``dp`` folds to 2 such groups, each kept whole."""
    if mesh is None:
        return Fold(("rank",), (world,), (world,))
    names, real = mesh.names, mesh.shape
    shape = list(real)
    inner = max(int(inner), 1)
    if "dp" in names and batch_size:
        axis = names.index("dp")
        dp = real[axis]
        if dp > 2 * inner and dp % (2 * inner) == 0 and batch_size % dp == 0:
            shape[axis] = 2 * inner
    return Fold(names, tuple(shape), tuple(real), inner if tuple(shape) != tuple(real) else 1)


class MappedComm:
    """A communication model costing each collective over the real ranks of a folded group."""

    def __init__(self, inner, fold: Fold):
        self.inner, self.fold = inner, fold
        self._memo: dict = {}   # every micro-batch asks the same collectives again

    def cost(self, kind: str, nbytes: int, ranks) -> float:
        if isinstance(ranks, int):
            return self.inner.cost(kind, nbytes, ranks)
        key = (kind, nbytes, tuple(ranks))
        got = self._memo.get(key)
        if got is None:
            got = self._memo[key] = self.inner.cost(kind, nbytes, self.fold.real_group(ranks))
        return got

    def group_size(self, ranks: Sequence[int]) -> int:
        """Ranks of the real group a collective over folded ``ranks`` joins (ZeRO cuts its shards over
        them)."""
        return len(self.fold.real_group(ranks))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def micro_fold(mesh: Optional[DeviceMesh], fold: Fold, batch_size: Optional[int], options: Optional[dict]):
    """``(simulated, real)`` micro-batch counts when a pipeline's micro-batches fold, else None."""
    nmicros = (options or {}).get("nmicros")
    if mesh is None or "pp" not in mesh.names or not isinstance(nmicros, int) or not batch_size:
        return None
    if ((options or {}).get("cp") or 1) != 1:
        # context parallel: every micro-batch simulated. Its ring attention's messages are not in the
        # per-micro-batch work the extrapolation adds (2.5% short on tests/test_cluster_sim.py's plan)
        return None
    pp = mesh.shape[mesh.names.index("pp")]
    # 1F1B reaches its steady state (every gradient made, pp micro-batches in flight) at micro-batch
    # pp + 1; interleaved stages take rounds of pp, and a longer warm-up: three rounds; DualPipeV needs
    # 2 pp micro-batches at least and reaches its main phase (a forward beside a backward on every
    # rank) from micro-batch 2 pp on: three rounds too
    virtual = (options or {}).get("nvirtual", 1) not in (None, 1)
    simulated = 3 * pp if virtual or (options or {}).get("schedule_name") == "dualpipev" else pp + 1
    num, den = fold.batch
    folded = batch_size * num // den
    if pp < 2 or nmicros <= simulated or (folded * simulated) % nmicros:
        return None
    return simulated, nmicros


def extrapolate(result, simulated: int, real: int) -> None:
    """Grows a step simulated with ``simulated`` micro-batches to ``real`` (see the module docstring)."""
    def first_free(s) -> float:   # the accumulation every micro-batch but the first pays, once more
        return s.repeat_accumulate / (simulated - 1)
    slope = max(s.pipeline + first_free(s) for s in result.ranks.values()) / simulated
    extra = (real - simulated) * slope
    for s in result.ranks.values():
        s.compute += (real - simulated) * (s.repeat_compute + first_free(s)) / simulated
        s.comm += (real - simulated) * s.repeat_comm / simulated
        s.end += extra
    result.step_time += extra
    result.micro = (simulated, real)
