"""What a rank holds: parameter, gradient and optimizer-state bytes, and activation bytes.

``report`` counts the tensors a generated module and its optimizer hold now
(each storage once, so views such as gradient buckets are not counted twice);
``SavedActivations`` counts the bytes autograd saves for backward while it is
active (``torch.autograd.graph.saved_tensors_hooks``), the activation memory a
step keeps alive between its forward and its backward.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

import torch


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def report(model: torch.nn.Module, optimizer=None) -> Dict[str, int]:
    """Bytes this rank holds now: ``params``, ``main_params``, ``grads``, ``optimizer`` (state) and
    ``total``.

    A ZeRO optimizer's chunks count with the parameters and gradients they hold, or, under the
    main-parameter recipe (``cube.runtime.amp``), with the float32 main parameters; gradients
    include the float32 main gradients (``param.main_grad``).
    """
    params = list(model.parameters())
    grads = [p.grad for p in params] + [getattr(p, "main_grad", None) for p in params]
    shards = getattr(optimizer, "shards", []) if optimizer is not None else []
    mains = [s.param for s in shards if getattr(s, "main", False)]
    params += [s.param for s in shards if not getattr(s, "main", False)]
    grads += [s.param.grad for s in shards]
    main = getattr(optimizer, "main", None) if optimizer is not None else None
    if main is not None:
        mains += main.mains
        grads += [m.grad for m in main.mains]
    state = []
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += [v for v in per_param.values() if torch.is_tensor(v)]
    out = {"params": _bytes(params), "main_params": _bytes(mains), "grads": _bytes(grads),
           "optimizer": _bytes(state)}
    out["total"] = sum(out.values())
    return out


class SavedActivations:
    """Counts the bytes autograd saves for backward inside a ``with`` block.

    Parameters and tensors saved more than once count once.

    Example:
        >>> with SavedActivations() as saved:
        ...     loss = model(*batch)
        >>> saved.bytes
    """

    def __init__(self, exclude: Optional[Iterable[torch.Tensor]] = None):
        self._exclude = {t.untyped_storage().data_ptr() for t in (exclude or ()) if t.numel()}
        self._seen: set = set()
        self.bytes = 0
        self._hooks = None

    def _pack(self, t: torch.Tensor):
        if t.numel():
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._exclude and ptr not in self._seen:
                self._seen.add(ptr)
                self.bytes += storage.nbytes()
        return t

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
