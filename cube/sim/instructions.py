"""Instructions of a rank's program, and the writer that emits them (see ``cube.sim.program``).

Instructions (``Ins.op``): ``compute`` (busy for ``dur``), ``coll`` (a blocking
collective), ``launch`` / ``wait`` (an asynchronous collective on the
communication stream), ``send`` (posted, never blocks), ``recv`` (blocks until
the message is there), ``flush`` (waits until this rank's sends are out).
Collectives are matched across ranks by their group and their order in it.
A ``compute`` may carry ``host``: the seconds the host spends issuing it
(dispatch), which the engine runs on a clock of its own per rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Tuple

from cube.sim.buckets import Bucket
from cube.sim.memory import MemTracker

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass
class Ins:
    """One instruction of a rank's program (see the module docstring)."""

    op: str
    dur: float = 0.0
    key: Hashable = None
    group: Tuple[int, ...] = ()
    label: str = ""
    cat: str = ""
    nbytes: int = 0
    mem: Dict[str, int] = field(default_factory=dict)
    host: float = 0.0   # compute: the host's seconds issuing it (a GPU's queue runs behind the host)


@dataclass
class Program:
    """A rank's instructions, its memory at the start of the step and its buckets."""

    rank: int
    ins: List[Ins]
    base: Dict[str, int]
    buckets: List[Bucket]


def nbytes_of(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize



class Writer:
    """Emits instructions for one rank, with the memory changes since the last one attached.

    Args:
        costs: the compute cost model (``op_cost``, ``optimizer_cost``, ``copy_cost``).
        comm: the communication model (``cost(kind, nbytes, n)``).
    """

    def __init__(self, costs, comm):
        self.costs, self.comm = costs, comm
        self._host_of = getattr(costs, "host_seconds", None)
        self._host: Dict[str, float] = {}   # category -> the host's seconds per compute
        self.mem = MemTracker()
        self.ins: List[Ins] = []
        self.seq: Dict[tuple, int] = {}

    def emit(self, op: str, **kw) -> Ins:
        ins = Ins(op, **kw)
        self.ins.append(ins)
        return ins

    def settle(self) -> None:
        """Attaches the memory changes since the last instruction to it."""
        if not self.mem.pending:
            return
        delta = self.mem.take()
        if delta and self.ins:
            for k, v in delta.items():
                self.ins[-1].mem[k] = self.ins[-1].mem.get(k, 0) + v

    def compute(self, dur: float, label: str, cat: str, host: bool = True) -> None:
        """A compute instruction; ``host``: the host issues it as an op of its own (False: its
        dispatch is counted in the op it belongs to)."""
        if not host or dur <= 0 or self._host_of is None:
            host = 0.0
        else:
            host = self._host.get(cat)
            if host is None:
                host = self._host[cat] = self._host_of(cat)
        self.ins.append(Ins("compute", dur, None, (), label, cat, 0, {}, host))

    def _key(self, ranks) -> tuple:
        group = tuple(sorted(ranks))
        n = self.seq.get(group, 0)
        self.seq[group] = n + 1
        return group, n

    def coll(self, kind: str, ranks, nbytes: int, cat: str, blocking: bool = True) -> Optional[Hashable]:
        if len(ranks) < 2:
            return None
        key = self._key(ranks)
        self.emit("coll" if blocking else "launch", dur=self.comm.cost(kind, nbytes, key[0]), key=key,
                  group=key[0], label=f"{kind} {nbytes / 2**20:.2f} MiB", cat=cat, nbytes=nbytes)
        return key

    def wait(self, key, label: str) -> None:
        if key is not None:
            self.emit("wait", key=key, label=label, cat="wait")

    def send(self, key, nbytes: int, cat: str) -> None:
        pair = message_pair(key) or 2   # the ranks, where the key names them
        self.emit("send", dur=self.comm.cost("p2p", nbytes, pair), key=key, label=f"send {nbytes / 2**20:.2f} MiB",
                  cat=cat, nbytes=nbytes)

    def recv(self, key, cat: str) -> None:
        self.emit("recv", key=key, label="recv", cat=cat)




def message_pair(key) -> Optional[Tuple[int, int]]:
    """The (producer, consumer) ranks a point-to-point message's key starts with (``cube.sim.program``
    keys a value's transfer ``((src, dst), tag, micro, "f" or "b")``), else None."""
    if isinstance(key, tuple) and key and isinstance(key[0], tuple) and len(key[0]) == 2 \
            and all(isinstance(r, int) for r in key[0]):
        return key[0]
    return None
