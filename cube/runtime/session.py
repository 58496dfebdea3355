"""Runtime state of compiled programs, which one is active, and the registry of compiles.

What the runtime keeps between calls lives in a :class:`RuntimeState`, never
in module globals, so two compiles in one process (other models, policies and
options, their steps interleaved) never see each other's messages in flight,
stashed values, micro-batch offsets or gradient norm tables.

Who owns it. Each generated module (``CubeModule``: this rank's program of one
compile) makes its own state when it is built; :func:`state_of` finds it. The
state belongs to the program rather than to ``CompiledStep`` because the
program is what uses it, also outside a step: ``cube.clip_grad_norm_(model)``
after the step, the model's forward called on its own, its parameters'
process groups made while ``cube.load_model()`` builds it. A compile's step
runs its model, so the step's state is that model's.

How it is found. Generated code calls module functions
(``runtime.p2p.send(...)``, ``runtime.collectives.all_reduce(x, ranks=...)``,
``runtime.pipeline.run(...)``); they act on :func:`current`, the calling
thread's active state. :func:`activate` (or :func:`running` for a model)
makes a state active for a block: ``CompiledStep.__call__`` enters its model's
for the whole step (the generated ``train_step`` calls ``runtime.p2p.backward``
and ``runtime.p2p.finish`` between the model's calls), and the model's own
entry points (its call, ``setup_communication``, ``reduce_gradients``) enter
it too. A thread outside any program (a script or test calling
``runtime.p2p`` itself) gets a state of its own on first use. The active state
is per thread: the in-process world (``cube.debug``) runs each rank in a
thread, so each rank finds its own. Autograd functions keep the state they
were made under, since backward may run on autograd's device threads, where
no state is active.

Process groups are the exception, deliberately shared: every state of the
process holds the same :class:`Groups` table, keyed by the sorted ranks. The
same ranks give the same group whatever the compile, so a communicator per
set of ranks is made once (not once per compile), every rank creates them in
one order however many compiles it runs, and a gradient hook running on an
autograd thread finds them without an active state. They live as long as the
process group: ``cube.runtime.device`` forgets them at shutdown.

The registry: :func:`register` (``cube.compile`` calls it) and :func:`latest`
(``cube.load_model()`` without arguments, ``cube.runtime.data.part()``), and
:func:`steps`, every compile still alive (a checkpoint finds the user model
of a generated module's plan).
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

Ranks = Tuple[int, ...]


class Groups:
    """Process groups keyed by the sorted tuple of their global ranks."""

    def __init__(self):
        self._groups: Dict[Ranks, Optional[dist.ProcessGroup]] = {}
        self._created_by_all: set = set()

    def create(self, rank_tuples) -> None:
        """Creates groups up front; all ranks, members or not, call it with the same list.

        Args:
            rank_tuples: the groups to create; the world and single ranks are skipped.
        """
        world = tuple(range(dist.get_world_size()))
        for ranks in rank_tuples:
            key = tuple(sorted(ranks))
            if key == world or len(key) < 2 or key in self._created_by_all:
                continue
            # made again even where get() made it already, so new_group calls match across ranks
            self._groups[key] = dist.new_group(list(key))
            self._created_by_all.add(key)

    def get(self, ranks: Sequence[int]) -> Optional[dist.ProcessGroup]:
        """The group of ``ranks``: None (the default group) for the whole world.

        A group not made by :meth:`create` is made here once by its members
        only (``use_local_synchronization=True``), all asking in the same order.

        Args:
            ranks: global ranks, in any order.

        Returns:
            The process group, or None for the world.
        """
        key = tuple(sorted(ranks))
        if key == tuple(range(dist.get_world_size())):
            return None
        if key not in self._groups:
            self._groups[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self._groups[key]

    def clear(self) -> None:
        """Forgets the cached groups (they are not destroyed)."""
        self._groups.clear()
        self._created_by_all.clear()


_PROCESS_GROUPS = Groups()   # this process's groups, shared by every state (see the module docstring)


@dataclass(eq=False)
class P2PState:
    """Point-to-point traffic of one program (``cube.runtime.p2p``).

    Attributes:
        pending: ``(work, buffer)`` of the sends posted this step (waited for at its end).
        markers: send markers made since the last ``take_markers`` (backward also runs from them).
        micro: the micro-batch being run: tags are offset by it.
        posted: ``(src, tag) -> (work, buffer)`` of receives posted ahead.
        recvs: ``(src, tag, shape, dtype, device)`` of the receives made since the last ``recorded``.
        early: post each send's gradient receive when the send is made.
        stashed: ``(tag, "value" or "grad") -> tensor`` waiting for a later stage of this rank.
        mailbox: ``(src, tag) -> tensor``: on ordered channels (``cube.runtime.p2p.ordered``), messages
            read off a peer's channel before the one awaited, kept until asked for.
    """

    pending: List[Tuple[Any, torch.Tensor]] = field(default_factory=list)
    markers: List[torch.Tensor] = field(default_factory=list)
    micro: int = 0
    posted: Dict[Tuple[int, int], Tuple[Any, torch.Tensor]] = field(default_factory=dict)
    recvs: List[tuple] = field(default_factory=list)
    early: bool = False
    stashed: Dict[Tuple[int, str], torch.Tensor] = field(default_factory=dict)
    mailbox: Dict[Tuple[int, int], torch.Tensor] = field(default_factory=dict)


@dataclass(eq=False)
class WeightGradState:
    """Deferred weight gradients of a split backward (``cube.runtime.zb``).

    Attributes:
        sink: the list a running B action collects weight-gradient work in (None: compute at once).
        pending: ``(micro, stage)`` -> the work its B left for its W.
    """

    sink: Optional[list] = None
    pending: Dict[Tuple[int, Optional[int]], list] = field(default_factory=dict)


@dataclass(eq=False)
class NormState:
    """What ``cube.runtime.norm`` learns once per program.

    Attributes:
        owners: local parameter name -> the lowest rank holding an identical piece (None: not asked yet).
        masks: a ZeRO optimizer's chunk -> the 0/1 weights of what this rank counts in it.
    """

    owners: Optional[Dict[str, int]] = None
    masks: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)


class RuntimeState:
    """Everything the runtime keeps between calls for one program (see the module docstring).

    Attributes:
        p2p: point-to-point traffic.
        norm: the gradient norm's ownership tables.
        wgrads: weight gradients deferred from B to W actions of a zero-bubble schedule.
        groups: the process groups (the process's shared table unless given).
        profile: the profiler region open in the program's forward and the profiler recording
            (``cube.runtime.profile``).
    """

    def __init__(self, groups: Optional[Groups] = None):
        self.p2p = P2PState()
        self.norm = NormState()
        self.wgrads = WeightGradState()
        self.groups = groups if groups is not None else _PROCESS_GROUPS
        self.profile: Dict[str, Any] = {"handle": None, "mode": None}
        _STATES.add(self)

    def __reduce__(self):
        # a copy of a program (copy.deepcopy, pickling) starts with nothing in flight
        return (RuntimeState, ())


_STATES: "weakref.WeakSet[RuntimeState]" = weakref.WeakSet()   # every live state, for the shutdown


class _Local(threading.local):
    """Per thread: ``active``, the state activated in this thread; ``own``, its state outside any.
    (Class defaults: a missing attribute would raise and catch an AttributeError on every message.)"""
    active: Optional[RuntimeState] = None
    own: Optional[RuntimeState] = None


_local = _Local()


def current() -> RuntimeState:
    """The calling thread's active state (its own state when none is active)."""
    state = _local.active
    if state is None:
        state = _local.own
        if state is None:
            state = _local.own = RuntimeState()
    return state


@contextmanager
def activate(state: RuntimeState) -> Iterator[RuntimeState]:
    """Makes ``state`` the calling thread's active state inside the block (blocks nest)."""
    previous = _local.active
    _local.active = state
    try:
        yield state
    finally:
        _local.active = previous


def state_of(model) -> RuntimeState:
    """The state of a generated module (``cube.load_model()``'s model).

    Raises:
        TypeError: ``model`` is not a generated module.
    """
    state = getattr(model, "_runtime", None)
    if not isinstance(state, RuntimeState):
        raise TypeError(f"expected the module cube.load_model() returns, got {type(model).__name__}: "
                        f"pass the compiled model, not the original one")
    return state


def running(model):
    """Makes the state of the generated module ``model`` active inside the block."""
    return activate(state_of(model))


def live_states() -> List[RuntimeState]:
    """Every state still in use in this process (for the shutdown: posted sends and stashes)."""
    return list(_STATES)


def process_groups() -> Groups:
    """The process groups every state of this process shares."""
    return _PROCESS_GROUPS


# -------------------------------------------------------------------- the registry of compiles
_LATEST: list = []   # [the most recent compiled step]; the in-process world keeps one per rank thread
_STEPS: List["weakref.ref"] = []   # every compiled step, weakly, oldest first


def register(step) -> None:
    """Records ``step`` as the latest compile (``cube.compile`` calls it)."""
    _LATEST[:] = [step]
    _STEPS[:] = [r for r in _STEPS if r() is not None] + [weakref.ref(step)]


def latest():
    """The most recent compiled step of this process (of this rank, in the in-process world), or None."""
    return _LATEST[0] if _LATEST else None


def steps() -> list:
    """Every compiled step still alive, newest first."""
    return [s for s in (r() for r in reversed(_STEPS)) if s is not None]
