"""Recompute runs: which calls of a rank's forward run under ``torch.utils.checkpoint``.

A policy marks forward ops with a recompute group (``graph.recompute``); pieces
inherit their op's group. On each rank every maximal stretch of consecutive
calls of one group is a *run*: a method of the generated module (``_recompute_0``)
called as ``torch.utils.checkpoint.checkpoint(self._recompute_0, *inputs,
use_reentrant=False)``. Its inputs are the values it reads that are made before
it (parameters are read through ``self``), its outputs the values it makes that
are read after it. Only the inputs are kept for backward; everything made
inside is made again when backward reaches the run.

What a run holds, and why:

- The op pieces of its group, and the communication steps feeding them: a step
  belongs to the op it feeds, which is a piece of the same logical op on every
  member of the step's process group. As pieces of one op must share one group
  (checked here), all members put a collective inside a run, or all outside.
- Collectives (all-reduce, all-gather, reduce-scatter, all-to-all) inside a
  run run again in backward, and so do op pieces communicating inside their
  call (a halo exchange, a norm's summed statistics: ``Call.inside``). That is
  safe: they block, and every member re-runs the same run at the same point of
  the same backward. A run holding one turns checkpoint's early stop off, so
  the whole run, collectives included, is re-made on every member even where
  the tail of the run saved nothing.
- No collective feeding an op some rank also feeds point to point (``Call.rerun``
  is False, decided for all ranks when planning): a transfer cuts the run on
  the ranks that make it, and the collective would be inside a run on some
  members and outside on others.
- No point-to-point send or receive: a send is posted asynchronously and waited
  for at the end of the step, a receive waits for one message. Re-run, a send
  would post a message no rank receives and a receive would wait for a message
  never sent again. A run is cut at each send/recv instead: the transfer runs
  once, between two runs (the value sent is an output of the run before it, the
  value received an input of the run after it). To cut runs as little as
  possible, :func:`gather_transfers` first moves a receive that would cut a run
  up before it and a send down after it, past local ops only: the rank's
  communication keeps its order, so no wait is added.
- No stash or unstash (a value handed between two pipeline stages of one
  rank, ``cube.passes.stages``): they sit at the edges of a stage and cut runs
  like a send or receive.
- No op that must not run twice (in-place writes, running statistics):
  ``graph.recompute`` rejects those (``cube.ir.blocks.rerun_hazard``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

from cube.ir.graph import IRGraph
from cube.ir.operator import IRFwOperation
from cube.ir.tensor import IRTensor
from cube.passes.adapter import COLLECTIVE_KINDS, STASH_KINDS
from cube.passes.rank_plans import Call

# steps that cut a run: a transfer runs once (grad_to, an identity whose backward sends, may re-run)
_CUTS = ("send", "recv", "gather") + STASH_KINDS


@dataclass
class Run:
    """One checkpointed stretch ``calls[start:stop]`` of a rank's forward.

    Attributes:
        group: the recompute group.
        start, stop: the calls it covers.
        name: the generated method's name.
        inputs: values made before the run that it reads, in order of first read.
        outputs: values made in the run and read after it.
        freed: inputs read for the last time in the run (deleted after the call).
        collective: whether it holds a collective that communicates in forward.
        where: the module path its ops share (for comments).
    """

    group: int
    start: int
    stop: int
    name: str = ""
    inputs: List[IRTensor] = field(default_factory=list)
    outputs: List[IRTensor] = field(default_factory=list)
    freed: List[IRTensor] = field(default_factory=list)
    collective: bool = False
    where: str = ""


def check_recompute(graph: IRGraph) -> None:
    """Checks the recompute marks of a placed graph.

    Raises:
        ValueError: pieces of one op in different recompute groups (their
            collectives would be re-run on some members only).

    Recompute under ZeRO-3 is safe: the gathered parameters stay until the
    gradients are reduced, so a re-run ``zero_wait`` finds them there and waits
    for nothing.
    """
    marks: Dict[int, tuple] = {}
    for op in graph.ops:
        if not isinstance(op, IRFwOperation):
            continue
        lop = op.root
        first = marks.setdefault(id(lop), (op.recompute, op))
        if first[0] != op.recompute:
            raise ValueError(
                f"pieces of op {lop.name!r} ({lop.where()}) are in recompute groups {first[0]} and "
                f"{op.recompute}: every piece of an op must be recomputed alike. Mark the op before "
                f"partitioning it, or pass all the pieces graph.partition/replicate returned to graph.recompute")


def find_runs(calls: List[Call], keep: IRTensor, is_attr: Callable[[IRTensor], bool],
              extra_reads: Optional[Dict[int, IRTensor]] = None) -> List[Run]:
    """The recompute runs of one rank's calls, in order.

    Args:
        calls: the rank's forward calls.
        keep: the value the forward returns (an output of the run making it).
        is_attr: whether a value is a parameter/buffer the module holds (read via self).
        extra_reads: call id -> a value the call reads besides its inputs (a
            mean loss's global count).

    Returns:
        The runs worth checkpointing: each holds an op and returns something.
    """
    extra_reads = extra_reads or {}
    groups = _call_groups(calls)
    last_read: Dict[int, int] = {}
    for k, call in enumerate(calls):
        for t in _reads(call, extra_reads):
            last_read[id(t)] = k
    runs: List[Run] = []
    i = 0
    while i < len(calls):
        g = groups[i]
        j = i + 1
        while j < len(calls) and g is not None and groups[j] == g:
            j += 1
        if g is not None:
            run = _describe(calls, i, j, g, keep, is_attr, extra_reads, last_read)
            if run is not None:
                runs.append(run)
        i = j
    parts: Dict[int, int] = {}
    for run in runs:
        parts[run.group] = parts.get(run.group, 0) + 1
    seen: Dict[int, int] = {}
    for run in runs:
        seen[run.group] = seen.get(run.group, 0) + 1
        run.name = f"_recompute_{run.group}" + (f"_{seen[run.group]}" if parts[run.group] > 1 else "")
    return runs


def gather_transfers(calls: List[Call]) -> List[Call]:
    """The calls with each send/recv that sits inside a stretch of one recompute group moved to
    its edge: a receive up before the stretch, a send down after it.

    They move past op calls of that group only (local computation): the order of
    the rank's communication is unchanged, so moving them adds no wait.
    """
    out = list(calls)
    for i in range(len(out)):   # receives, first to last, up
        if out[i].step is not None and out[i].step.kind == "recv":
            g, j = _group_after(out, i), i
            while g is not None and j > 0 and out[j - 1].op is not None and out[j - 1].op.recompute == g \
                    and not _fed_by_collective(out, j - 1):   # kept beside its collectives: every member
                j -= 1                                         # then re-runs them in the same run
            out.insert(j, out.pop(i))
    for i in range(len(out) - 1, -1, -1):   # sends, last to first, down
        if out[i].step is not None and out[i].step.kind == "send":
            g, j = _group_before(out, i), i
            while g is not None and j + 1 < len(out) and out[j + 1].op is not None and out[j + 1].op.recompute == g:
                j += 1
            out.insert(j, out.pop(i))
    return out


def _fed_by_collective(calls: List[Call], k: int) -> bool:
    """Whether the steps right before op call ``k`` (those feeding it) hold a collective."""
    while k > 0 and calls[k - 1].op is None and calls[k - 1].step.kind not in _CUTS:
        k -= 1
        if calls[k].step.kind in COLLECTIVE_KINDS and len(calls[k].step.ranks) > 1:
            return True
    return False


def _group_after(calls: List[Call], i: int) -> Optional[int]:
    return next((c.op.recompute for c in calls[i + 1:] if c.op is not None), None)


def _group_before(calls: List[Call], i: int) -> Optional[int]:
    return next((c.op.recompute for c in reversed(calls[:i]) if c.op is not None), None)


def _call_groups(calls: List[Call]) -> List[Optional[int]]:
    """Each call's recompute group: an op piece its own, a step the group of the op it feeds
    (the next op piece), a send/recv none."""
    out: List[Optional[int]] = [None] * len(calls)
    feeds: Optional[int] = None
    for i in range(len(calls) - 1, -1, -1):
        call = calls[i]
        if call.op is not None:
            feeds = call.op.recompute
            out[i] = feeds
        elif call.step.kind not in _CUTS and call.rerun:
            out[i] = feeds
    return out


def _describe(calls: List[Call], start: int, stop: int, group: int, keep: IRTensor,
              is_attr: Callable[[IRTensor], bool], extra_reads: Dict[int, IRTensor],
              last_read: Dict[int, int]) -> Optional[Run]:
    """The run ``calls[start:stop]``, or None when it holds no op or returns nothing."""
    inside = calls[start:stop]
    if not any(c.op is not None for c in inside):
        return None
    made = {id(t) for c in inside for t in c.outputs}
    inputs: Dict[int, IRTensor] = {}
    for c in inside:
        for t in _reads(c, extra_reads):
            if id(t) not in made and not is_attr(t):
                inputs.setdefault(id(t), t)

    def read_later(t: IRTensor) -> bool:
        return last_read.get(id(t), -1) >= stop or t is keep

    outputs = [t for c in inside for t in c.outputs if read_later(t)]
    if not outputs:
        return None
    freed = [t for t in inputs.values() if not read_later(t)]
    paths = [c.op.module_path.split(".") for c in inside if c.op is not None and c.op.module_path]
    common = []
    for level in zip(*paths) if paths else ():
        if len(set(level)) != 1:
            break
        common.append(level[0])
    # a piece communicating inside its call (halo exchange, summed statistics) blocks like a
    # collective: every member must re-make it, so checkpoint must not stop early either
    collective = any(c.step is not None and c.step.kind in COLLECTIVE_KINDS and len(c.step.ranks) > 1
                     or c.inside is not None and bool(c.inside.p2p or c.inside.recvs or c.inside.all_reduce
                                                         or c.inside.all_to_all or c.inside.all_gather)
                     for c in inside)
    return Run(group, start, stop, inputs=list(inputs.values()), outputs=outputs,
               freed=freed, collective=collective, where=".".join(common))


def _reads(call: Call, extra_reads: Dict[int, IRTensor]) -> List[IRTensor]:
    extra = extra_reads.get(id(call))
    return list(call.inputs) + ([extra] if extra is not None else [])
