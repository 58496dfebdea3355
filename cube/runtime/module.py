"""What generated modules derive from, and what their train steps call."""
from __future__ import annotations

import threading
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist

from cube.runtime import amp, collectives, session
from cube.runtime.compiled import outside_graph
from cube.runtime.reducer import Reducer


_building_over = threading.local()   # set while ``CubeModule.over`` builds a module (per rank thread)


class CubeModule(torch.nn.Module):
    """Base of a generated per-rank module.

    Subclasses declare ``PARAMS``/``BUFFERS``/``CONSTS``: local attribute name ->
    (names in the user's model, this rank's piece as ``[(dim, start, stop)]``;
    buffers are registered persistent or not as in the user's model, constants
    as non-persistent buffers);
    ``REDUCE``: ``(local parameter name, ranks)`` whose gradients are summed over
    ``ranks`` after backward; ``GROUPS``: every process group of the plan.

    Each instance owns the runtime state of its program (``cube.runtime.session``):
    its call, ``setup_communication`` and ``reduce_gradients`` make it the active
    state, as the compiled step does for the whole step.
    """

    PARAMS: Dict[str, Tuple[List[str], list]] = {}
    BUFFERS: Dict[str, Tuple[List[str], list]] = {}
    CONSTS: Dict[str, Tuple[List[str], list]] = {}
    REDUCE: List[Tuple[str, Tuple[int, ...]]] = []
    GROUPS: List[Tuple[int, ...]] = []
    ZERO: int = 0   # 3: the plan's forward gathers ZeRO-3 sharded parameters (zero_begin / zero_wait)
    # "bf16" / "fp16": low-precision weights, float32 main parameters in cube.build_optimizer, the
    # forward in the weights' dtype with the casts the generated code prints (cube.passes.precision);
    # "bf16-autocast" / "fp16-autocast": float32 parameters, forward under torch.autocast
    PRECISION = None
    BACKEND = None   # the torch.compile backend its compute runs under (cube.compile(backend=); set at load)

    def __init__(self, device):
        super().__init__()
        self._runtime = session.RuntimeState()
        self.device = torch.device(device)
        self._reducer = None
        self._zero = None   # a ZeRO optimizer (cube.runtime.zero); stage 3 gathers the parameters
        self._main = None   # float32 main parameters stepped whole (cube.runtime.amp.MainOptimizer)
        self._lowered = False   # the weights are low precision, their main parameters made (build_optimizer)
        self.loss_scale = amp.LossScale() if amp.is_fp16(self.PRECISION) else None

    def __call__(self, *args, **kwargs):
        with session.activate(self._runtime):
            if self.PRECISION is None or amp.main_params(self.PRECISION):
                return super().__call__(*args, **kwargs)
            with torch.autocast(self.device.type, dtype=amp.DTYPES[self.PRECISION]):
                return super().__call__(*args, **kwargs)

    def gradients(self) -> List[torch.Tensor]:
        """Every gradient this rank holds, each memory once: the parameters' (their float32 main
        gradients under the main-parameter recipe) and a ZeRO optimizer's chunks (stage 1's chunks
        are views of the parameters' gradients)."""
        grads = [amp.grad_of(p) for p in self.parameters() if amp.grad_of(p) is not None]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        if self._zero is not None:
            grads += [s.param.grad for s in self._zero.shards
                      if s.param.grad is not None and s.param.grad.untyped_storage().data_ptr() not in storages]
        return grads

    @outside_graph
    def zero_begin(self) -> None:
        """Start of forward in a ZeRO-3 plan: starts gathering the sharded parameters."""
        if self._zero is not None:
            self._zero.begin_forward()

    @outside_graph
    def zero_wait(self, *params: torch.nn.Parameter) -> None:
        """Before the first op reading ``params`` in a ZeRO-3 plan: waits until they are gathered."""
        if self._zero is not None:
            for p in params:
                self._zero.wait_param(p)

    @classmethod
    def over(cls, base: "CubeModule", consts: Dict[str, torch.Tensor]) -> "CubeModule":
        """This plan's module over ``base``'s parameters and buffers (the same objects): the plan of
        another batch shape of the same model (``cube.compile(max_shapes=)``), whose tables of pieces
        equal ``base``'s. Gradients land in ``base``'s parameters and are summed by ``base``'s reducer
        (one set of gradient hooks); its constants are its own (they may depend on the shape)."""
        _building_over.active = True
        try:
            m = cls(torch.device("meta"))   # no storage: every tensor is replaced below
        finally:
            _building_over.active = False
        m.device = base.device
        for name in cls.PARAMS:
            m._parameters[name] = base._parameters[name]
        for name in cls.BUFFERS:
            m._buffers[name] = base._buffers[name]
        with torch.no_grad():
            for local, (names, splits) in cls.CONSTS.items():
                m._buffers[local] = piece(consts[names[0]], splits).to(base.device).clone()
        m.base = base
        return m

    def follow_base(self) -> None:
        """Takes ``base``'s gradient reducer, ZeRO optimizer and loss scale (made or replaced after
        this module was: ``cube.build_optimizer(base)``)."""
        self._reducer, self._zero, self.loss_scale = self.base._reducer, self.base._zero, self.base.loss_scale
        self._main, self._lowered = self.base._main, self.base._lowered
        self.zero_stage = getattr(self.base, "zero_stage", 0)
        self.__dict__["_rng_steps"] = self.base.__dict__.get("_rng_steps", 0)   # (cube.runtime.rng's step count)

    def setup_communication(self) -> None:
        """Creates the plan's process groups (on every rank, same order) and the gradient reducer."""
        if getattr(_building_over, "active", False):   # ``over``: the base module's groups and reducer serve
            return
        if not self.GROUPS and not self.REDUCE:
            return
        if not dist.is_initialized():
            raise ValueError(f"{type(self).__name__} is a plan for several ranks, but torch.distributed is not "
                             f"initialized: launch with torchrun --nproc_per_node=N (N = the plan's world size)")
        with session.activate(self._runtime):
            collectives.create_groups(self.GROUPS)
        # the buckets share the groups of the step's collectives: separate groups measured
        # slower on CPU (more gloo threads than cores), and collectives stay in one order
        after = set(getattr(self, "REDUCE_AFTER", ()))
        self._reducer = Reducer([(getattr(self, name), tuple(ranks)) for name, ranks in self.REDUCE],
                                after=[getattr(self, name) for name in after])

    def reduce_gradients(self) -> None:
        """Sums the gradients of parameters shared by several ranks (waits for the overlapped buckets)."""
        with session.activate(self._runtime):
            if self._reducer is not None:
                self._reducer.finish()
            if self.loss_scale is not None:
                amp.unscale(self, self.gradients())
            if self._zero is not None:
                self._zero.after_reduce()

    @torch.no_grad()
    def load_from(self, model: torch.nn.Module, consts: Dict[str, torch.Tensor]) -> None:
        """Copies this rank's pieces of the user's parameters, buffers and constants."""
        state = dict(model.named_parameters(remove_duplicate=False))
        state.update(dict(model.named_buffers(remove_duplicate=False)))
        for table, source in ((self.PARAMS, state), (self.BUFFERS, state), (self.CONSTS, consts)):
            for local, (names, splits) in table.items():
                if names[0] not in source:
                    raise ValueError(f"the model has no tensor {names[0]!r} that the generated code expects; "
                                     f"the cached plan is stale: clear the cube cache directory")
                full = source[names[0]]
                getattr(self, local).copy_(piece(full, splits))

    def state_tensors(self) -> List[Tuple[str, str, List[str], list]]:
        """``(kind, local name, the user's names, piece)`` of what the user's ``state_dict()`` holds.

        ``kind`` is ``"param"`` or ``"buffer"``. Buffers the user registered with
        ``persistent=False`` are registered so here too and left out, as
        ``state_dict()`` leaves them out: checkpoints neither save nor expect them.
        """
        out = [("param", local, names, splits) for local, (names, splits) in self.PARAMS.items()]
        out += [("buffer", local, names, splits) for local, (names, splits) in self.BUFFERS.items()
                if local not in self._non_persistent_buffers_set]
        return out

    def full_names(self) -> Dict[str, List[str]]:
        """Local parameter/buffer name -> the user's names for it."""
        out = {k: v[0] for k, v in self.PARAMS.items()}
        out.update({k: v[0] for k, v in self.BUFFERS.items()})
        return out


def piece(full: torch.Tensor, splits: Sequence[Tuple[int, int, int]]) -> torch.Tensor:
    """The piece of ``full`` given as ``[(dim, start, stop), ...]``."""
    t = full
    for dim, start, stop in splits:
        t = t.narrow(dim, start, stop - start)
    return t


class _DropGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return None


def drop_grad(x: torch.Tensor) -> torch.Tensor:
    """``x`` whose gradient stops here (another rank keeps that copy of it): what is made from
    it still needs a gradient, as on the ranks that keep theirs, so every rank runs the same
    backward; only the copy is not added to ``x``'s gradient."""
    return _DropGrad.apply(x) if x.requires_grad and torch.is_grad_enabled() else x


def narrow(x: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    """A local part of ``x`` that no other rank's part complements (gradient zero elsewhere)."""
    return x.narrow(dim, start, stop - start)


def take(dataloader: Iterator):
    """The dataloader's next batch.

    Raises:
        ValueError: the dataloader is exhausted.
    """
    try:
        return next(dataloader)
    except StopIteration:
        raise ValueError("the dataloader is exhausted: the compiled step needs one more batch. "
                         "Use an endless iterator or stop the loop before the data runs out.") from None


def next_batch(dataloader: Iterator, device: torch.device, shapes: Sequence[tuple], structure: str):
    """Takes the next batch and checks it against the traced one.

    Raises:
        ValueError: the dataloader is exhausted, or the batch differs in structure
            or shape from the one the step was compiled for.
    """
    batch = take(dataloader)
    items = [batch] if structure == "tensor" else batch
    if structure == "tensor" and not isinstance(batch, torch.Tensor) or (
            structure == "tuple" and not isinstance(batch, (tuple, list))) or len(items) != len(shapes):
        raise ValueError(f"the dataloader yielded {_describe(batch)}, but the step was compiled for "
                         f"{'one tensor' if structure == 'tensor' else f'{len(shapes)} tensors'} of shapes "
                         f"{[list(s) for s in shapes]}. Keep every batch the same structure.")
    out = []
    for i, (t, shape) in enumerate(zip(items, shapes)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
            raise ValueError(f"batch item {i} is {_describe(t)} but the step was compiled for shape "
                             f"{list(shape)}: cube compiles for static shapes. Keep batch shapes fixed "
                             f"(drop_last=True, padding to a fixed length), or let the step compile a plan "
                             f"per shape: cube.compile(..., max_shapes=N).")
        out.append(t.to(device, non_blocking=True))
    return out[0] if structure == "tensor" else out


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)} ({', '.join(_describe(y) for y in x)})"
    return f"a {type(x).__name__}"
