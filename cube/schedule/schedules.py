"""Pipeline schedules as data: per rank, the order of forward and backward micro-steps.

A schedule lists, for every rank, actions ``F(stage, micro)`` and
``B(stage, micro)``. Stage ``s`` of ``nstages`` runs on rank ``s % nranks``
(more stages than ranks are virtual stages, as in interleaved 1F1B) unless the
schedule has a ``placement`` (ZB-V: stages ``i`` and ``2n - 1 - i`` on rank ``i``).
Dependencies: ``F(s, i)`` needs ``F(s-1, i)``; ``B(s, i)`` needs ``F(s, i)`` and
``B(s+1, i)`` (the last stage's backward follows its own forward).

Zero-bubble schedules split the backward: ``B(s, i)`` computes the gradients of
the stage's inputs (what the previous stage waits for) and ``W(s, i)``, which
needs ``B(s, i)``, the deferred weight gradients (of the linear layers: see
``cube.runtime.zb``), run where the rank would otherwise wait.

``validate`` replays a schedule one time step at a time (every action takes
one step; a rank runs its actions in its order); a schedule that cannot make
progress, or that misses or repeats an action, is a ``ValueError`` that shows
the rank x step grid so far and the offending cell. ``Schedule.grid()`` prints
the same grid for a valid schedule.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from cube.errors import CubeInternalError


@dataclass(frozen=True)
class Action:
    """One micro-step: ``kind`` "F", "B" or "W" (deferred weight gradients) of ``stage`` on
    micro-batch ``micro``."""

    kind: str
    stage: int
    micro: int

    def label(self, virtual: bool) -> str:
        return f"{self.kind}{self.micro}" + (f".s{self.stage}" if virtual else "")


@dataclass
class Schedule:
    """Per rank, the actions in the order that rank runs them.

    Attributes:
        nstages: pipeline stages (``> nranks`` means virtual stages).
        nmicros: micro-batches per step.
        ranks: ``ranks[r]`` is rank ``r``'s list of actions.
        name: how the schedule was made (``gpipe``, ``1f1b``, ...).
        placement: ``placement[s]`` is the rank of stage ``s``; None: ``s % nranks``.
    """

    nstages: int
    nmicros: int
    ranks: List[List[Action]]
    name: str = "custom"
    placement: Optional[Tuple[int, ...]] = None

    @property
    def nranks(self) -> int:
        return len(self.ranks)

    @property
    def splits_backward(self) -> bool:
        """Whether backward is split into B (input gradients) and W (weight gradients)."""
        return any(a.kind == "W" for acts in self.ranks for a in acts)

    def rank_of(self, stage: int) -> int:
        return self.placement[stage] if self.placement is not None else stage % self.nranks

    def stages_of(self, rank: int) -> List[int]:
        """The stages rank ``rank`` runs, in order."""
        return [st for st in range(self.nstages) if self.rank_of(st) == rank]

    def __str__(self) -> str:
        virtual = self.nstages > self.nranks
        lines = [f"{self.name}: {self.nstages} stages, {self.nmicros} micro-batches, {self.nranks} ranks"]
        for r, acts in enumerate(self.ranks):
            lines.append(f"rank {r}: " + " ".join(a.label(virtual) for a in acts))
        return "\n".join(lines)

    def grid(self) -> str:
        """The rank x time-step chart (``.`` where a rank waits)."""
        times = validate(self)
        return _grid(self, times, None)

    def steps(self) -> int:
        """Time steps the schedule takes when every action takes one step."""
        times = validate(self)
        return max(times.values()) + 1 if times else 0


def _expected(s: Schedule, r: int) -> List[Action]:
    kinds = "FBW" if s.splits_backward else "FB"
    return [Action(k, st, i) for st in s.stages_of(r) for i in range(s.nmicros) for k in kinds]


def _deps(s: Schedule, a: Action) -> List[Action]:
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action("B", a.stage, a.micro)]
    deps = [Action("F", a.stage, a.micro)]
    if a.stage < s.nstages - 1:
        deps.append(Action("B", a.stage + 1, a.micro))
    return deps


def validate(s: Schedule) -> Dict[Action, int]:
    """Checks ``s`` and returns the time step of each action.

    Raises:
        ValueError: a rank misses or repeats an action, holds another rank's
            stage, or the schedule deadlocks; the message shows the grid.
    """
    if s.nstages < s.nranks or s.nstages % s.nranks:
        raise ValueError(f"schedule {s.name}: {s.nstages} stages on {s.nranks} ranks; use a multiple of the "
                         f"rank count (each rank holds nstages / nranks stages)")
    if s.placement is not None and (len(s.placement) != s.nstages or
                                    sorted(set(s.placement)) != list(range(s.nranks))):
        raise ValueError(f"schedule {s.name}: placement {list(s.placement)} must give each of the {s.nstages} "
                         f"stages a rank in 0..{s.nranks - 1}, every rank at least one stage")
    for r, acts in enumerate(s.ranks):
        want, got = _expected(s, r), list(acts)
        for a in got:
            if a.stage < 0 or a.stage >= s.nstages or s.rank_of(a.stage) != r:
                raise ValueError(f"schedule {s.name}: rank {r} lists {a.label(True)}, but stage {a.stage} runs on "
                                 f"rank {s.rank_of(a.stage) if 0 <= a.stage < s.nstages else '(none)'}")
            if not 0 <= a.micro < s.nmicros:
                raise ValueError(f"schedule {s.name}: rank {r} lists {a.label(True)}, but micro-batches are "
                                 f"0..{s.nmicros - 1}")
        counts = Counter(got)
        dup = sorted({a.label(True) for a, n in counts.items() if n > 1})
        miss = [a.label(True) for a in want if a not in counts]
        if dup or miss:
            raise ValueError(f"schedule {s.name}: rank {r} " + (f"repeats {dup} " if dup else "") +
                             (f"misses {miss}" if miss else "") + f"\n{s}")
    times: Dict[Action, int] = {}
    pos = [0] * s.nranks
    t = 0
    total = sum(len(a) for a in s.ranks)
    while len(times) < total:
        progressed = False
        ready = []
        for r, acts in enumerate(s.ranks):
            if pos[r] < len(acts):
                a = acts[pos[r]]
                if all(d in times and times[d] < t for d in _deps(s, a)):
                    ready.append((r, a))
        for r, a in ready:
            times[a] = t
            pos[r] += 1
            progressed = True
        if not progressed:
            stuck = [(r, acts[pos[r]]) for r, acts in enumerate(s.ranks) if pos[r] < len(acts)]
            r, a = stuck[0]
            waits = [d.label(True) for d in _deps(s, a) if d not in times]
            raise ValueError(
                f"schedule {s.name} deadlocks at step {t}: rank {r}'s next action {a.label(True)} waits for "
                f"{waits}, which never run (every rank waits: "
                f"{', '.join(f'rank {q}: {b.label(True)}' for q, b in stuck)}).\n"
                + _grid(s, times, (r, t)))
        t += 1
    return times


def _grid(s: Schedule, times: Dict[Action, int], mark: Optional[Tuple[int, int]]) -> str:
    virtual = s.nstages > s.nranks
    width = max([len(a.label(virtual)) for acts in s.ranks for a in acts] + [2])
    end = max(times.values()) + 1 if times else 0
    if mark is not None:
        end = max(end, mark[1] + 1)
    header = "step    " + " ".join(f"{t:>{width}}" for t in range(end))
    lines = [header]
    for r, acts in enumerate(s.ranks):
        at = {times[a]: a for a in acts if a in times}
        cells = []
        for t in range(end):
            if mark == (r, t):
                cells.append(f"{'??':>{width}}")
            elif t in at:
                cells.append(f"{at[t].label(virtual):>{width}}")
            else:
                cells.append(f"{'.':>{width}}")
        lines.append(f"rank {r:<3}" + " ".join(cells))
    return "\n".join(lines)


def _check_args(nmicros: int, nstages: int, nranks: Optional[int]) -> int:
    for name, v in (("nmicros", nmicros), ("nstages", nstages)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    nranks = nstages if nranks is None else nranks
    if not isinstance(nranks, int) or nranks < 1 or nstages % nranks:
        raise ValueError(f"nstages ({nstages}) must be a multiple of the number of ranks ({nranks})")
    return nranks


def sched_gpipe(graph, nmicros: int, nstages: int) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards."""
    _check_args(nmicros, nstages, None)
    ranks = [[Action("F", s, i) for i in range(nmicros)] + [Action("B", s, i) for i in range(nmicros)]
             for s in range(nstages)]
    return _attach(graph, Schedule(nstages, nmicros, ranks, "gpipe"))


def sched_1f1b(graph, nmicros: int, nstages: int) -> Schedule:
    """1F1B (PipeDream-flush): ``nstages - s - 1`` warm-up forwards on stage ``s``, then one
    forward and one backward in turn, then the remaining backwards."""
    _check_args(nmicros, nstages, None)
    ranks = []
    for s in range(nstages):
        warm = min(nstages - s - 1, nmicros)
        acts = [Action("F", s, i) for i in range(warm)]
        f, b = warm, 0
        while f < nmicros:
            acts.append(Action("F", s, f))
            f += 1
            acts.append(Action("B", s, b))
            b += 1
        acts += [Action("B", s, i) for i in range(b, nmicros)]
        ranks.append(acts)
    return _attach(graph, Schedule(nstages, nmicros, ranks, "1f1b"))


def sched_1f1b_interleaved(graph, nmicros: int, nranks: int, nvirtual: int) -> Schedule:
    """Interleaved 1F1B: each rank holds ``nvirtual`` stages (rank ``r`` holds stages
    ``r, r + nranks, ...``); micro-batches go through a rank's stages in groups of ``nranks``.
    ``nmicros`` must be a multiple of ``nranks``."""
    nstages = nranks * nvirtual
    _check_args(nmicros, nstages, nranks)
    if nmicros % nranks:
        raise ValueError(f"interleaved 1F1B needs nmicros ({nmicros}) to be a multiple of nranks ({nranks}): "
                         f"micro-batches go through a rank's stages in groups of nranks; use a multiple of "
                         f"{nranks} micro-batches (CUBE_MICROS for the shipped policies)")
    total = nmicros * nvirtual

    def chunk(k: int, forward: bool) -> int:   # the virtual stage of the k-th action of its kind
        v = (k // nranks) % nvirtual
        return v if forward else nvirtual - 1 - v

    def micro(k: int) -> int:
        return (k // (nranks * nvirtual)) * nranks + k % nranks

    ranks = []
    for r in range(nranks):
        warm = min((nranks - r - 1) * 2 + (nvirtual - 1) * nranks, total)
        acts: List[Action] = []
        f = b = 0
        for _ in range(warm):
            acts.append(Action("F", chunk(f, True) * nranks + r, micro(f)))
            f += 1
        while f < total:
            acts.append(Action("F", chunk(f, True) * nranks + r, micro(f)))
            f += 1
            acts.append(Action("B", chunk(b, False) * nranks + r, micro(b)))
            b += 1
        while b < total:
            acts.append(Action("B", chunk(b, False) * nranks + r, micro(b)))
            b += 1
        ranks.append(acts)
    return _attach(graph, Schedule(nstages, nmicros, ranks, "1f1b-interleaved"))


def sched_zb_h1(graph, nmicros: int, nstages: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B with the backward
    split into B (input gradients) and W (weight gradients). Stage ``s`` runs 1F1B's warm-up
    forwards, then F, B pairs, each followed by a W once ``s`` pairs have passed, and its
    remaining W's last, where 1F1B's drain leaves it waiting. At most ``nstages`` micro-batches
    are between their F and their W on any rank, as 1F1B holds at most ``nstages`` between F and B
    on the first: the same peak activation memory; the bubble shrinks from ``(p - 1)(F + B + W)``
    to ``(p - 1)(F + B - W)``."""
    _check_args(nmicros, nstages, None)
    ranks = []
    for s in range(nstages):
        warm = min(nstages - s - 1, nmicros)
        acts = [Action("F", s, i) for i in range(warm)]
        f, b, w = warm, 0, 0
        while b < nmicros:
            if f < nmicros:
                acts.append(Action("F", s, f))
                f += 1
            acts.append(Action("B", s, b))
            b += 1
            if b > s:   # the W's of stage s trail its B's by s micro-batches
                acts.append(Action("W", s, w))
                w += 1
        acts += [Action("W", s, i) for i in range(w, nmicros)]
        ranks.append(acts)
    return _attach(graph, Schedule(nstages, nmicros, ranks, "zb-h1"))


def sched_zbv(graph, nmicros: int, nstages: int) -> Schedule:
    """ZB-V (Qi et al., ICLR 2024): ``nstages = 2 x ranks``, stages ``i`` and ``nstages - 1 - i``
    on rank ``i`` (the model goes down the ranks and back up, so the last stage, with the loss,
    sits on rank 0 beside the first), backward split into B and W.

    The order comes from a list-scheduling pass with unit-time F, B and W (the paper's setting):
    each rank runs a ready B first (it unblocks the previous stage), else a ready F while fewer
    than ``nstages`` of its stage-micro-batches are between F and W (1F1B's activation memory:
    ``ranks`` micro-batches of a whole rank's layers), else a pending W, else waits."""
    _check_args(nmicros, nstages, None)
    if nstages % 2:
        raise ValueError(f"ZB-V places two stages on each rank: nstages ({nstages}) must be even "
                         f"(2 x the number of ranks)")
    placement = v_placement(nstages)
    return _attach(graph, Schedule(nstages, nmicros, _list_schedule(nstages, nmicros, placement, nstages),
                                   "zbv", placement))


def sched_dualpipev(graph, nmicros: int, nstages: int) -> Schedule:
    """DualPipeV (DeepSeek-V3's DualPipe cut to a V, as ``torch.distributed.pipelining`` ships it):
    ``nstages = 2 x ranks`` in ZB-V's V placement, ``nmicros >= nstages``. Each rank runs the
    forward of one micro-batch beside the backward of another (``F`` then ``B``, ``W`` of the same
    stage: one issued pair, whose messages overlap the other's compute) in its steady phase, the
    backward split into ``B`` and a deferred ``W`` (zero bubble) where the pipeline fills and drains.

    Rank ``r`` of ``n``, stages ``s0 = r`` (down the V) and ``s1 = 2n - 1 - r`` (back up), in eight
    phases: ``2(n - r - 1)`` forwards of ``s0``; ``r + 1`` pairs of forwards ``s0, s1``;
    ``n - r - 1`` times a split backward of ``s1``, a pending ``W``, a forward of ``s1``; the main
    phase, ``nmicros - 2n + r + 1`` times forward ``s0`` with backward ``s1``, then forward ``s1`` with
    backward ``s0``; ``n - r - 1`` times backward ``s1``, forward ``s1`` with backward ``s0``; ``r + 1``
    backwards of ``s1`` and ``s0`` (split from the middle on, odd ranks one earlier); ``n - r - 1``
    times a pending ``W`` and a backward of ``s0``; the remaining ``W``'s."""
    _check_args(nmicros, nstages, None)
    if nstages % 2:
        raise ValueError(f"DualPipeV places two stages on each rank: nstages ({nstages}) must be even "
                         f"(2 x the number of ranks)")
    if nmicros < nstages:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as stages: nmicros ({nmicros}) < "
                         f"nstages ({nstages}); use nmicros >= {nstages} (CUBE_MICROS for the shipped policies)")
    n = nstages // 2
    ranks = [_dualpipev_rank(r, n, nmicros) for r in range(n)]
    return _attach(graph, Schedule(nstages, nmicros, ranks, "dualpipev", v_placement(nstages)))


def _dualpipev_rank(r: int, n: int, nmicros: int) -> List[Action]:
    s0, s1 = r, 2 * n - 1 - r
    acts: List[Action] = []
    nxt = {("F", s0): 0, ("F", s1): 0, ("B", s0): 0, ("B", s1): 0}
    waiting: List[Action] = []   # W's of split backwards, oldest first

    def forward(st: int) -> None:
        acts.append(Action("F", st, nxt[("F", st)]))
        nxt[("F", st)] += 1

    def backward(st: int, split: bool) -> None:
        i = nxt[("B", st)]
        nxt[("B", st)] += 1
        acts.append(Action("B", st, i))
        if split:
            waiting.append(Action("W", st, i))
        else:   # a full backward: its weight gradients at once
            acts.append(Action("W", st, i))

    def pending_w() -> None:
        if waiting:
            acts.append(waiting.pop(0))

    for _ in range(2 * (n - r - 1)):
        forward(s0)
    for _ in range(r + 1):
        forward(s0)
        forward(s1)
    for _ in range(n - r - 1):
        backward(s1, split=True)
        pending_w()
        forward(s1)
    for _ in range(nmicros - 2 * n + r + 1):
        forward(s0)
        backward(s1, split=False)
        forward(s1)
        backward(s0, split=False)
    for _ in range(n - r - 1):
        backward(s1, split=False)
        forward(s1)
        backward(s0, split=False)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        backward(s1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        backward(s0, split)
    for _ in range(n - r - 1):
        pending_w()
        backward(s0, split)
    while waiting:
        pending_w()
    return acts


def v_placement(nstages: int) -> Tuple[int, ...]:
    """ZB-V's stage -> pipeline rank map: stages ``k`` and ``nstages - 1 - k`` on rank ``k``."""
    return tuple(min(k, nstages - 1 - k) for k in range(nstages))


def _list_schedule(nstages: int, nmicros: int, placement: Tuple[int, ...], limit: int) -> List[List[Action]]:
    """Greedy list scheduling of F/B/W at unit time (see ``sched_zbv``)."""
    nranks = max(placement) + 1
    stages = [[st for st in range(nstages) if placement[st] == r] for r in range(nranks)]
    done: Dict[Action, int] = {}
    nxt = {k: [0] * nstages for k in "FBW"}
    ranks: List[List[Action]] = [[] for _ in range(nranks)]
    total, t = 3 * nstages * nmicros, 0

    def ready(a: Action) -> bool:
        if a.kind == "F":
            deps = [Action("F", a.stage - 1, a.micro)] if a.stage > 0 else []
        elif a.kind == "B":
            deps = [Action("F", a.stage, a.micro)] + (
                [Action("B", a.stage + 1, a.micro)] if a.stage < nstages - 1 else [])
        else:
            deps = [Action("B", a.stage, a.micro)]
        return all(done.get(d, t) < t for d in deps)

    while len(done) < total:
        for r in range(nranks):
            held = sum(nxt["F"][st] - nxt["W"][st] for st in stages[r])
            pick = None
            for kind in "BFW":
                for st in sorted(stages[r], reverse=True):   # the deeper stage first
                    i = nxt[kind][st]
                    if i >= nmicros or (kind == "F" and held >= limit):
                        continue
                    a = Action(kind, st, i)
                    if ready(a):
                        pick = a
                        break
                if pick is not None:
                    break
            if pick is not None:
                done[pick] = t
                nxt[pick.kind][pick.stage] += 1
                ranks[r].append(pick)
        t += 1
        if t > 4 * total + 4:
            raise CubeInternalError(f"ZB-V list scheduling made no progress ({nstages} stages, {nmicros} micros)")
    return ranks


def custom(graph, nmicros: int, nstages: int, ranks: Sequence[Sequence[str]]) -> Schedule:
    """A hand-written schedule: ``ranks[r]`` like ``["F0", "F1", "B0", ...]`` (``F0.s2`` names
    virtual stage 2; without it, the rank's only stage)."""
    _check_args(nmicros, nstages, len(ranks))
    out = []
    for r, items in enumerate(ranks):
        acts = []
        for text in items:
            kind, rest = text[:1], text[1:]
            stage = r
            if ".s" in rest:
                rest, st = rest.split(".s", 1)
                stage = int(st)
            if kind not in ("F", "B", "W") or not rest.isdigit():
                raise ValueError(f"schedule entry {text!r} on rank {r}: write F<micro>, B<micro> or W<micro> "
                                 f"(W: the deferred weight gradients, splitting backward), optionally .s<stage>")
            acts.append(Action(kind, stage, int(rest)))
        out.append(acts)
    return _attach(graph, Schedule(nstages, nmicros, out))


def _attach(graph, schedule: Schedule) -> Schedule:
    validate(schedule)
    if graph is not None:
        graph.schedule = schedule
    return schedule
