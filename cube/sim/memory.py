"""Memory accounting for a rank's program: which tensors are alive after each instruction.

Memory is counted per *storage*: a view shares its base's storage, and a
storage is freed when nothing holds it any more. Holders are the generated
code's local variables (until their last use, as the ``del`` lines do),
autograd (tensors an op saved for backward, until that op's backward), a
checkpointed run (its inputs, until its backward) and the step's bookkeeping
(gradients, buckets, gathered ZeRO-3 parameters).

Each change is reported as a per-kind delta (``params``, ``grads``,
``optimizer``, ``activations``, ``comm``) that the program builder attaches to
the instruction that causes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Set, Tuple

KINDS = ("params", "grads", "optimizer", "activations", "comm")


@dataclass
class _Storage:
    nbytes: int
    kind: str
    holders: Set[Hashable] = field(default_factory=set)


class MemTracker:
    """Storages, their holders, and the pending per-kind change since the last ``take``.

    Args:
        pending: the dict of pending changes, when several trackers (a rank's and one per
            micro-batch) report into one.
    """

    def __init__(self, pending: Optional[Dict[str, int]] = None):
        self.holding: Dict[Hashable, Set[Hashable]] = {}   # holder (not a variable) -> storage keys
        self.storages: Dict[Hashable, _Storage] = {}
        self.sizes: Dict[Hashable, int] = {}          # storage key -> bytes, also after it is freed
        self.root: Dict[Hashable, Hashable] = {}     # value key -> storage key
        self.pending: Dict[str, int] = {} if pending is None else pending
        self.changes = 0   # how many times a change was reported

    def _delta(self, kind: str, nbytes: int) -> None:
        self.pending[kind] = self.pending.get(kind, 0) + nbytes
        self.changes += 1

    def take(self) -> Dict[str, int]:
        """The change since the last call (and forget it)."""
        out = {k: v for k, v in self.pending.items() if v}
        self.pending.clear()
        return out

    def copy(self) -> "MemTracker":
        """An independent tracker in the same state, reporting into the same pending changes."""
        out = MemTracker(self.pending)
        out.holding = {h: set(keys) for h, keys in self.holding.items()}
        out.storages = {k: _Storage(st.nbytes, st.kind, set(st.holders)) for k, st in self.storages.items()}
        out.sizes, out.root = dict(self.sizes), dict(self.root)
        return out

    # ------------------------------------------------------------------ values
    def alloc(self, key: Hashable, nbytes: int, kind: str = "activations", holder: Hashable = None) -> None:
        """A new storage for value ``key``, held by ``holder`` (default: the variable ``("py", key)``)."""
        if key in self.root:
            self.release(key)
        self.storages[key] = _Storage(int(nbytes), kind, {holder if holder is not None else ("py", key)})
        if holder is not None:
            self.holding.setdefault(holder, set()).add(key)
        self.root[key] = key
        self.sizes[key] = int(nbytes)
        self._delta(kind, int(nbytes))

    def alias(self, key: Hashable, base: Hashable) -> None:
        """Value ``key`` is a view of value ``base`` (no new memory), held by its variable ``("py", key)``."""
        root = self.root.get(base)
        if root is None or root not in self.storages:
            return
        self.root[key] = root
        self.storages[root].holders.add(("py", key))

    def hold(self, key: Hashable, holder: Hashable) -> bool:
        """Adds a holder to the storage of value ``key``; False if the value is unknown or freed."""
        root = self.root.get(key)
        if root is None or root not in self.storages:
            return False
        self.storages[root].holders.add(holder)
        self.holding.setdefault(holder, set()).add(root)
        return True

    def release(self, key: Hashable, holder: Hashable = None) -> None:
        """Drops ``holder`` (default: the variable ``("py", key)``) of value ``key``'s storage; frees the
        storage when nothing holds it any more."""
        root = self.root.get(key)
        st = self.storages.get(root) if root is not None else None
        if st is None:
            return
        st.holders.discard(holder if holder is not None else ("py", key))
        if not st.holders:
            self._delta(st.kind, -st.nbytes)
            del self.storages[root]

    def release_all(self, holder: Hashable) -> None:
        """Drops ``holder`` from every storage it holds."""
        for root in self.holding.pop(holder, ()):
            st = self.storages.get(root)
            if st is not None and holder in st.holders:
                st.holders.discard(holder)
                if not st.holders:
                    self._delta(st.kind, -st.nbytes)
                    del self.storages[root]

    def nbytes(self, key: Hashable) -> int:
        root = self.root.get(key)
        st = self.storages.get(root) if root is not None else None
        return st.nbytes if st is not None else 0

    def root_of(self, key: Hashable) -> Optional[Hashable]:
        return self.root.get(key)

    def alive(self, key: Hashable) -> bool:
        root = self.root.get(key)
        return root is not None and root in self.storages

    # ------------------------------------------------------------------ anonymous bookkeeping
    def add(self, kind: str, nbytes: int) -> None:
        """Bytes of ``kind`` that are tracked as a sum only (static memory, buckets)."""
        self._delta(kind, int(nbytes))


def peak(base: Dict[str, int], deltas: List[Dict[str, int]]) -> Tuple[int, Dict[str, int], List[int]]:
    """Walks per-instruction deltas from ``base``.

    Returns:
        ``(peak bytes, the per-kind bytes at the peak, the total after each instruction)``.
    """
    cur = {k: base.get(k, 0) for k in KINDS}
    best, at = sum(cur.values()), dict(cur)
    totals = []
    total = best
    for d in deltas:
        for k, v in d.items():
            cur[k] = cur.get(k, 0) + v
            total += v
        totals.append(total)
        if total > best:
            best, at = total, dict(cur)
    return best, at, totals
