"""Replaying a pipeline action of one micro-batch from an earlier micro-batch's.

Under a pipeline schedule a rank runs the same actions for every micro-batch
(forward, backward, and the deferred weight gradients of each stage it holds),
and what an action does depends only on what that micro-batch did before on
this rank: its values, their memory (keyed per micro-batch, see
``MicroState``) and the weight-gradient work its backward left. The rank's own
state (parameter gradients, ZeRO buffers, gradient buckets) is the same once
every parameter has a gradient. So the builder (``cube.sim.program``) builds an
action once for real, records its instructions, the memory changes attached to
them (and to the instruction before it) and the micro-batch's state after it,
and replays that for every later micro-batch that reaches the same action
after the same actions: the instructions copied with the micro-batch's message
keys (``((src, dst), tag, micro, way)``) and the collectives numbered on, the
state shared until the micro-batch next runs an action for real. A micro-batch
one of whose actions changed the rank's own state (the first gradients are
taken, later ones added to them) neither records nor replays its later
actions (a W emits what its B decided). An action is
recorded only when it changed nothing of the rank's own state and emitted only
compute, blocking collectives and messages; the programs are the same as
built action by action (``tests/test_cluster_sim.py`` compares them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Tuple

from cube.sim.instructions import Ins
from cube.sim.memory import MemTracker

PORTABLE = ("compute", "coll", "send", "recv")   # instructions a recorded action may hold


@dataclass
class MicroState:
    """One micro-batch's state on a rank: the memory of its values (keys without the micro-batch)
    and, per stage, the weight-gradient work its B left for W. ``shared``: a recorded state that
    replayed actions point to, copied before it changes."""

    mem: MemTracker
    deferred: Dict[Optional[int], list] = field(default_factory=dict)
    shared: bool = False

    def copy(self) -> "MicroState":
        return MicroState(self.mem.copy(), {k: list(v) for k, v in self.deferred.items()})


@dataclass
class _Recording:
    micro: int
    ins: List[Ins]
    before: Dict[str, int]   # memory changes attached to the instruction before the action
    after: MicroState


class Replays:
    """The recorded actions of one rank's builder (see the module docstring).

    Args:
        builder: the ``cube.sim.program.Builder`` (its instructions, memory, micro-batch states
            and collective numbering).
    """

    enabled = True   # False: build every action (the reference the tests compare with)

    def __init__(self, builder):
        self.b = builder
        self.on = self.enabled and builder.held and builder.zero != 3
        self.recorded: Dict[Tuple[str, Optional[int], tuple], _Recording] = {}
        self.done: Dict[int, tuple] = {}   # micro-batch -> the (kind, stage) of its actions so far
        self.unique: set = set()   # micro-batches an action of which changed the rank's own state

    def replay(self, kind: str, micro: int, stage: Optional[int]) -> bool:
        """Appends the recorded action for ``micro``; False when there is none to replay."""
        b = self.b
        past = self.done.get(micro, ())
        rec = self.recorded.get((kind, stage, past)) if self.on and micro not in self.unique else None
        if rec is None or not b.ins or b.mem.pending:
            return False
        out = b.ins
        last = out[-1]
        for k, v in rec.before.items():
            last.mem[k] = last.mem.get(k, 0) + v
        for i in rec.ins:
            if i.op == "coll":
                key = b._key(i.group)
            elif i.op == "compute":
                key = None
            else:
                key = i.key[:2] + (micro,) + i.key[3:]
            out.append(Ins(i.op, i.dur, key, i.group, i.label, i.cat, i.nbytes, dict(i.mem), i.host))
        b.micros[micro] = rec.after
        self.done[micro] = past + ((kind, stage),)
        return True

    def record(self, kind: str, micro: int, stage: Optional[int], run: Callable[[int, Optional[int]], None]) -> None:
        """Runs the action (``run(micro, stage)``) and records it when it can be replayed."""
        b = self.b
        past = self.done.get(micro, ())
        key = (kind, stage, past)
        start, changes = len(b.ins), b.mem.changes
        ok = self.on and key not in self.recorded and start > 0 and not b.mem.pending and micro not in self.unique
        before = dict(b.ins[start - 1].mem) if ok else {}
        run(micro, stage)
        self.done[micro] = past + ((kind, stage),)
        if b.mem.changes != changes:   # its later actions may differ too (a W whose B made the first gradients)
            self.unique.add(micro)
        if not ok or b.mem.changes != changes or b.mem.pending or b.tag:
            return
        ins = b.ins[start:]
        if not all(_portable(i, micro) for i in ins):
            return
        now = b.ins[start - 1].mem
        delta = {k: now.get(k, 0) - before.get(k, 0) for k in set(now) | set(before)}
        after = b.micros[micro].copy()
        after.shared = True
        self.recorded[key] = _Recording(
            micro, [Ins(i.op, i.dur, i.key, i.group, i.label, i.cat, i.nbytes, dict(i.mem), i.host) for i in ins],
            {k: v for k, v in delta.items() if v}, after)


def _portable(i: Ins, micro: int) -> bool:
    """Whether instruction ``i`` of an action of ``micro`` can be replayed for another micro-batch."""
    if i.op not in PORTABLE:
        return False
    if i.op == "coll":
        return isinstance(i.key, tuple) and len(i.key) == 2 and i.key[0] == i.group
    if i.op in ("send", "recv"):
        key: Hashable = i.key
        return isinstance(key, tuple) and len(key) == 4 and key[2] == micro
    return True
