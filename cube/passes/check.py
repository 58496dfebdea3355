"""The graph checker: cube's invariants, run after tracing, after the policy and (in tests) after every pass."""
from __future__ import annotations

from fractions import Fraction
from typing import Dict, Optional

from cube import config
from cube.errors import CubeInternalError
from cube.ir.graph import IRGraph
from cube.ir.operator import IRDataOperation, IRFwOperation


def check_graph(graph: IRGraph, placed: bool = False, stage: Optional[str] = None) -> None:
    """Raises when the graph breaks one of cube's own invariants.

    Always: every op is in the graph once; every value is defined before use
    (by the data operation, an attribute or an earlier op); there is a data
    operation; every forward op has a target; the loss is produced; a piece
    points at the traced op it was cut from (not at another piece); the
    sub-parameters of a user's tensor (``cube.trace.fused``) have its shape and
    tile it exactly once, and no attribute stands for the whole of it beside them.

    With ``placed`` (the graph came back from a policy): the pieces of every
    traced op add up to it exactly once (and the op is not left in the graph
    beside its pieces). A partition into ``n`` or a replicate
    ``n`` times turns a piece of weight ``w`` into ``n`` pieces of weight ``w / n``,
    so the weights of an op's pieces sum to 1 unless a piece was lost or made
    twice. Devices are not checked here: ``apply_policy`` reports a policy's
    unplaced ops as a ValueError.

    Args:
        graph: the graph to check.
        placed: also check that the pieces of every op add up to it.
        stage: the compile stage that made the graph, named in the error.

    Raises:
        CubeInternalError: the first broken invariant (a bug in cube, never a user's mistake).
    """
    where = f" (after {stage})" if stage else ""

    def fail(message: str) -> None:
        raise CubeInternalError(f"graph check failed{where}: {message}")

    members = {id(op) for op in graph.ops}
    if len(members) != len(graph.ops):
        seen: set = set()
        twice = next(op for op in graph.ops if id(op) in seen or seen.add(id(op)))
        fail(f"{twice!r} is in the graph more than once")
    defined = {id(t) for t in graph.attrs}
    if not any(isinstance(op, IRDataOperation) for op in graph.ops):
        fail("graph has no data operation")
    shares: Dict[int, Dict[int, int]] = {}   # traced op id -> {parts: pieces of weight 1 / parts}
    roots: Dict[int, object] = {}
    for op in graph.ops:
        for t in op.inputs:
            if id(t) not in defined:
                fail(f"{op!r} reads {t!r} before it is defined")
        defined.update(id(t) for t in op.outputs)
        if isinstance(op, IRFwOperation) and op.target is None:
            fail(f"{op!r} has no target")
        if op.origin is not None and op.origin.origin is not None:
            fail(f"{op!r} was cut from {op.origin!r}, itself a piece of {op.origin.origin!r}")
        if placed and op.origin is not None:   # a whole op weighs 1: only pieces need adding up
            roots[id(op.origin)] = op.origin
            by = shares.setdefault(id(op.origin), {})
            parts = _parts(op)
            by[parts] = by.get(parts, 0) + 1
    if id(graph.loss) not in defined:
        fail(f"the loss {graph.loss!r} is never produced")
    _check_regions(graph.attrs, fail)
    for key, by in shares.items():   # counted per share, so the few fractions stay cheap
        weight = sum((Fraction(k, parts) for parts, k in by.items()), Fraction(0))
        if key in members:
            weight += 1
        if weight != 1:
            pieces = [op for op in graph.ops if op.root is roots[key]]
            fail(f"the pieces of {roots[key]!r} add up to {weight} of it, not once: "
                 + ", ".join(f"splits {list(p.splits)} replicas {list(p.replicas)}" for p in pieces))


def _check_regions(attrs, fail) -> None:
    """Sub-parameters of one user tensor: each its region's shape, inside the tensor, disjoint, and
    together all of it."""
    whole = {t.names[0] for t in attrs if t.region is None and t.names}
    subs: Dict[str, list] = {}
    for t in attrs:
        if t.region is not None:
            subs.setdefault(t.names[0], []).append(t)
    for name, ts in subs.items():
        full = ts[0].full
        volume = 0
        for i, t in enumerate(ts):
            if t.full != full or len(t.region) != len(full) or tuple(e - s for s, e in t.region) != t.shape \
                    or any(not 0 <= s < e <= n for (s, e), n in zip(t.region, full)):
                fail(f"sub-parameter {t!r} has region {t.region} of a tensor of shape {full}")
            for u in ts[:i]:
                if all(s1 < e2 and s2 < e1 for (s1, e1), (s2, e2) in zip(t.region, u.region)):
                    fail(f"sub-parameters of {name!r} overlap: regions {t.region} and {u.region}")
            volume += t.numel()
        n = 1
        for s in full:
            n *= s
        if volume != n or name in whole:
            fail(f"the sub-parameters of {name!r} hold {volume} of its {n} elements"
                 + (", and the whole tensor is an attribute too" if name in whole else ""))


def _parts(op) -> int:
    """Into how many pieces its partitions and replicates cut the traced op: a piece computes
    ``1 / parts`` of it."""
    parts = 1
    for _, _, n in op.splits:
        parts *= n
    for _, n in op.replicas:
        parts *= n
    return parts


def check_stage(graph: IRGraph, stage: str, placed: bool = True) -> None:
    """The graph checker after the compile stage ``stage``, when ``CUBE_CHECK_GRAPHS=1``
    (``cube.config.check_graphs``; the test suite turns it on); nothing otherwise."""
    if config.check_graphs():
        check_graph(graph, placed=placed, stage=stage)
