"""Run an N-rank plan inside one Python process: one thread per rank.

``python -m cube.debug -n 4 train.py ARGS`` (or :func:`run`) runs the script
once per rank in threads of this process. ``torch.distributed`` is replaced,
for those threads, by an in-process world: collectives and sends/receives meet
in shared memory, with the same semantics (and the same generated code) as the
multi-process run, so results are equal. Breakpoints work: ranks take turns,
only one runs Python at a time, and a rank switches only where it waits for
another (a collective or a receive), so ``breakpoint()`` in a rank's code
stops the whole world at that point.

Known differences from separate processes: the ranks share one random number
generator (a model seeded before it is built gets the same values on every
rank, as ranks build it one after another; the random ops of a compiled step
draw as in separate processes, ``cube.runtime.rng``), and the environment
variables are shared.
"""
from __future__ import annotations

import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from cube import config

_local = threading.local()


class Deadlock(RuntimeError):
    """Every rank of the in-process world waits for another: the program cannot go on."""


class RankFailed(RuntimeError):
    """Raised in ranks waiting for a rank that failed."""


class _Group:
    """A process group of the in-process world: its global ranks."""

    def __init__(self, ranks: Sequence[int]):
        self.ranks = tuple(sorted(ranks))

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(_me())


class _Done:
    """A finished communication (``wait`` returns at once)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Pending:
    """A collective that completes when every member has joined (``wait`` blocks until then)."""

    def __init__(self, world: "World", finish: Callable[[], None]):
        self.world, self.finish = world, finish
        self.done = False

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.finish()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class World:
    """The shared state of the ranks: collectives by (group, sequence number), and mailboxes."""

    def __init__(self, n: int):
        self.n = n
        self.cond = threading.Condition()   # its lock is the baton: the rank holding it runs
        self.slots: Dict[tuple, Dict[int, object]] = {}
        self.seq: Dict[Tuple[int, tuple], int] = {}
        self.mail: Dict[tuple, list] = {}   # (src, dst, tag) -> tensors; strict order: (src, dst) -> (tag, tensor)
        self.recvs_posted: Dict[Tuple[int, int], int] = {}   # strict order: receives posted per (src, dst)
        self.failed: Optional[str] = None
        self.waiting: Dict[int, str] = {}   # rank -> what it waits for
        self.finished = 0                    # ranks whose function returned
        self.progress = 0                    # messages and contributions made so far

    # ---------------------------------------------------------------- waiting
    def wait_until(self, ready: Callable[[], bool], what: str = "") -> None:
        """Gives the baton to the other ranks until ``ready()`` (called holding the baton).

        Raises:
            Deadlock: every rank waits (or has returned) and nothing was sent or contributed for
                three rounds: none can go on. The message says what each waits for.
        """
        if ready():
            return
        me = _me()
        self.waiting[me] = what or "a message"
        try:
            idle = 0
            while not ready():
                if self.failed is not None:
                    raise RankFailed(f"stopping rank {me} because {self.failed}")
                mark = self.progress
                self.cond.wait(timeout=1.0)
                if self.progress == mark and len(self.waiting) + self.finished == self.n and not ready():
                    idle += 1
                    if idle >= 3:
                        raise Deadlock("every rank waits and none can go on: " + "; ".join(
                            f"rank {r} waits for {w}" for r, w in sorted(self.waiting.items())))
                else:
                    idle = 0
        finally:
            del self.waiting[me]

    # ---------------------------------------------------------------- collectives
    def join(self, group, value) -> Tuple[tuple, Dict[int, object]]:
        """Deposits this rank's contribution to its next collective on ``group``; returns the slot."""
        ranks = group.ranks if isinstance(group, _Group) else tuple(range(self.n))
        me = _me()
        k = self.seq.get((me, ranks), 0)
        self.seq[(me, ranks)] = k + 1
        key = (ranks, k)
        slot = self.slots.setdefault(key, {})
        slot[me] = value
        self.progress += 1
        self.cond.notify_all()
        return ranks, slot

    def gathered(self, ranks: tuple, slot: Dict[int, object]) -> List[object]:
        """Every member's contribution in group rank order, once all have joined."""
        self.wait_until(lambda: len(slot) == len(ranks), f"the other ranks of a collective on ranks {list(ranks)}")
        return [slot[r] for r in ranks]

    # ---------------------------------------------------------------- point to point
    def post(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        if config.p2p_strict():   # NCCL's rule: one queue per pair, in posting order
            self.mail.setdefault((_me(), dst), []).append((tag, tensor.detach().clone()))
        else:
            self.mail.setdefault((_me(), dst, tag), []).append(tensor.detach().clone())
        self.progress += 1
        self.cond.notify_all()

    def take(self, src: int, tag: int) -> torch.Tensor:
        if config.p2p_strict():
            return self.take_at(src, tag, self.reserve(src))
        box = self.mail.setdefault((src, _me(), tag), [])
        self.wait_until(lambda: bool(box), f"a message with tag {tag} from rank {src}")
        return box.pop(0)

    def reserve(self, src: int) -> int:
        """Strict order: the place of this rank's next receive from ``src`` among that pair's messages
        (a receive matches the send of the same place, whenever it is waited for)."""
        key = (src, _me())
        k = self.recvs_posted.get(key, 0)
        self.recvs_posted[key] = k + 1
        return k

    def take_at(self, src: int, tag: int, k: int) -> torch.Tensor:
        """Strict order: the ``k``-th message ``src`` sent this rank (the pair's messages stay in sending
        order; each is dropped once taken)."""
        box = self.mail.setdefault((src, _me()), [])
        self.wait_until(lambda: len(box) > k, f"message {k} from rank {src} (its receive of tag {tag})")
        sent, tensor = box[k]
        box[k] = (sent, None)
        if sent != tag:
            from cube.runtime.p2p import order_error
            raise order_error(src, _me(), tag, sent)
        return tensor


def _world() -> Optional[World]:
    return getattr(_local, "world", None)


def _me() -> int:
    return _local.rank


# -------------------------------------------------------------------- torch.distributed stand-ins
def _ranks_of(group) -> tuple:
    return group.ranks if isinstance(group, _Group) else tuple(range(_world().n))


def _collective(group, value, finish: Callable[[List[object]], None], async_op: bool):
    world = _world()
    ranks, slot = world.join(group, value)
    pending = _Pending(world, lambda: finish(world.gathered(ranks, slot)))
    if async_op:
        return pending
    pending.wait()
    return None


def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    def finish(parts):
        if op == dist.ReduceOp.MAX:
            out = torch.stack(parts).amax(0)
        else:
            out = parts[0].clone()
            for p in parts[1:]:   # rank order, as a ring would sum: identical on every rank
                out += p
        tensor.copy_(out)
    return _collective(group, tensor.detach().clone(), finish, async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    def finish(parts):
        for out, p in zip(tensor_list, parts):
            out.copy_(p)
    return _collective(group, tensor.detach().clone(), finish, async_op)


def all_gather_into_tensor(output, input, group=None, async_op=False):
    return all_gather(list(output.chunk(len(_ranks_of(group)))), input, group, async_op)


def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
    def finish(parts):
        me = _ranks_of(group).index(_me())
        out = parts[0][me].clone()
        for p in parts[1:]:
            out += p[me]
        output.copy_(out)
    return _collective(group, [t.detach().clone() for t in input_list], finish, async_op)


def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return reduce_scatter(output, list(input.chunk(len(_ranks_of(group)))), op, group, async_op)


all_gather_single = all_gather_into_tensor    # torch 2.13's names for the two above
reduce_scatter_single = reduce_scatter_tensor


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    def finish(parts):
        me = _ranks_of(group).index(_me())
        for out, p in zip(output_tensor_list, parts):
            out.copy_(p[me])
    return _collective(group, [t.detach().clone() for t in input_tensor_list], finish, async_op)


def broadcast(tensor, src, group=None, async_op=False):
    def finish(parts):
        tensor.copy_(parts[_ranks_of(group).index(src)])
    return _collective(group, tensor.detach().clone(), finish, async_op)


def barrier(group=None, async_op=False, device_ids=None):
    return _collective(group, None, lambda parts: None, async_op)


def all_gather_object(object_list, obj, group=None):
    def finish(parts):
        object_list[:] = parts
    return _collective(group, obj, finish, False)


def isend(tensor, dst, group=None, tag=0):
    _world().post(tensor, dst, tag)
    return _Done()


def send(tensor, dst, group=None, tag=0):
    isend(tensor, dst, group, tag)


def recv(tensor, src=None, group=None, tag=0):
    tensor.copy_(_world().take(src, tag))
    return src


class _Recv(_Done):
    def __init__(self, tensor, src, tag):
        self.tensor, self.src, self.tag, self.done = tensor, src, tag, False
        # strict order: a receive's match is fixed when it is posted, as NCCL's
        self.place = _world().reserve(src) if config.p2p_strict() else None

    def wait(self, timeout=None) -> bool:
        if not self.done:
            if self.place is None:
                recv(self.tensor, self.src, tag=self.tag)
            else:
                self.tensor.copy_(_world().take_at(self.src, self.tag, self.place))
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def irecv(tensor, src=None, group=None, tag=0):
    return _Recv(tensor, src, tag)


class P2POp:
    """torch's ``P2POp`` without its checks: those look the group up in torch's registry of
    process groups, which knows nothing of this world's groups."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    works = []
    for op in p2p_op_list:
        name = getattr(op.op, "__name__", "")
        if "isend" in name:
            works.append(isend(op.tensor, op.peer, tag=op.tag))
        else:
            works.append(irecv(op.tensor, op.peer, tag=op.tag))
    return works


def new_group(ranks=None, *args, **kwargs):
    return _Group(ranks if ranks is not None else range(_world().n))


def get_rank(group=None):
    return _me() if group is None else group.rank()


def get_world_size(group=None):
    return _world().n if group is None else group.size()


def get_backend(group=None):
    return "gloo"


def is_initialized():
    return True


def destroy_process_group(group=None):
    return None


_REPLACED = ["all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
             "all_gather_single", "reduce_scatter_single",
             "all_to_all", "broadcast", "barrier", "all_gather_object", "isend", "send", "recv", "irecv",
             "batch_isend_irecv", "P2POp", "new_group", "get_rank", "get_world_size", "get_backend", "is_initialized",
             "destroy_process_group"]


def _dispatch_to(mine: Callable, original: Callable) -> Callable:
    """``mine`` in rank threads, ``original`` everywhere else."""
    def call(*args, **kwargs):
        return mine(*args, **kwargs) if _world() is not None else original(*args, **kwargs)
    call.__name__ = getattr(original, "__name__", getattr(mine, "__name__", "call"))
    call.__wrapped__ = original
    return call


def _dispatch(name: str, original: Callable) -> Callable:
    return _dispatch_to(globals()[name], original)


def _launch_env() -> dict:
    """What torchrun would set for this rank thread."""
    return {"RANK": _me(), "WORLD_SIZE": _world().n, "LOCAL_RANK": _me()}


def _single_dev_mode() -> bool:
    return False


# -------------------------------------------------------------------- per-rank module state
class _PerRank:
    """Stands in for a module-level list/dict of per-process state: each rank thread has its own.

    Runtime state needs no stand-in: each rank builds its own compiled step and
    model, which own their state, and the active state is per thread.
    """

    def __init__(self, original):
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_mine", {})

    def _get(self):
        rank = getattr(_local, "rank", None)
        if rank is None:
            return self._original
        mine = self._mine
        if rank not in mine:
            mine[rank] = type(self._original)()
            if isinstance(self._original, list) and self._original and not isinstance(self._original[0], (list, dict)):
                mine[rank].extend(self._original)   # a one-element cell such as [0]: start from its value
        return mine[rank]

    def __getattr__(self, name):
        return getattr(self._get(), name)

    def __getitem__(self, k):
        return self._get()[k]

    def __setitem__(self, k, v):
        self._get()[k] = v

    def __delitem__(self, k):
        del self._get()[k]

    def __contains__(self, k):
        return k in self._get()

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())

    def __bool__(self):
        return bool(self._get())


def _state_modules():
    """The module-level state each rank keeps for itself: its latest compile. (What a program
    keeps while it runs is in its runtime state, found per thread: ``cube.runtime.session``.)"""
    from cube.runtime import session
    return [(session, "_LATEST")]


@contextmanager
def _installed():
    """Replaces torch.distributed (for rank threads only) and each rank's latest compile."""
    saved = []
    made: Dict[int, Callable] = {}   # one wrapper per original: torch compares P2POp's op with c10d.isend
    for module in (dist, c10d):
        for name in _REPLACED:
            if hasattr(module, name):
                original = getattr(module, name)
                saved.append((module, name, original))
                base = getattr(original, "__wrapped__", original)
                if id(base) not in made:
                    made[id(base)] = _dispatch(name, base)
                setattr(module, name, made[id(base)])
    for module, name in _state_modules():
        value = getattr(module, name)
        saved.append((module, name, value))
        setattr(module, name, _PerRank(value))
    from cube import config
    for name, mine in (("launch_env", _launch_env), ("single_dev_mode", _single_dev_mode)):
        original = getattr(config, name)
        saved.append((config, name, original))
        setattr(config, name, _dispatch_to(mine, original))
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def run(fn: Callable[[], object], n: int) -> List[object]:
    """Runs ``fn()`` once per rank of an ``n``-rank world, in threads of this process.

    Inside ``fn``, ``cube.init()`` reports the thread's rank and world size
    ``n``, and every collective, send and receive meets the other ranks'.

    Returns:
        Each rank's return value, by rank.

    Raises:
        RuntimeError: a rank raised; the message names the first failed rank
            and its error (the other ranks stop at their next wait).
    """
    if n < 1:
        raise ValueError(f"cube.debug: the world needs at least one rank, got n={n}")
    world = World(n)
    results: List[object] = [None] * n
    errors: Dict[int, str] = {}

    def body(rank: int) -> None:
        _local.world, _local.rank = world, rank
        with world.cond:
            try:
                results[rank] = fn()
            except RankFailed:
                pass
            except BaseException as e:   # the first failure stops every rank at its next wait
                errors[rank] = "".join(traceback.format_exception(type(e), e, e.__traceback__))
                if world.failed is None:
                    world.failed = f"rank {rank} failed: {type(e).__name__}: {e}"
            finally:
                world.finished += 1
                world.cond.notify_all()

    with _installed():
        threads = [threading.Thread(target=body, args=(r,), name=f"cube-rank{r}") for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        first = min(errors)
        raise RuntimeError(f"cube.debug: {world.failed}\n{errors[first]}")
    return results


def rank() -> Optional[int]:
    """The rank of the calling thread in an in-process world (None outside one)."""
    return getattr(_local, "rank", None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m cube.debug -n N script.py [args]``: runs the script once per rank in threads."""
    import argparse
    import runpy
    parser = argparse.ArgumentParser(prog="python -m cube.debug", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--nranks", type=int, required=True, help="ranks of the plan")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    sys.argv = [args.script] + list(args.args)
    run(lambda: runpy.run_path(args.script, run_name="__main__"), args.nranks)
    return 0
