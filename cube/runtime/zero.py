"""ZeRO: optimizer state (1), gradients (2) and parameters (3) sharded over data parallel groups.

The unit of sharding is a gradient bucket of the generated module's reducer: the
parameters whose gradients are summed over the same ranks, packed in gradient
order. Each bucket's parameters are moved into one flat buffer (padded to a
multiple of the group size) and every rank of the group owns one contiguous
chunk of it:

- the optimizer steps only the owned chunks (a ``torch.nn.Parameter`` sharing
  the flat buffer's memory), so its state exists once per group (stage 1);
- after backward each rank keeps only the reduced gradient of its chunk; the
  full gradients are dropped (stage 2; stage 1 keeps them);
- after the step the owners' chunks are all-gathered back into the flat buffer
  (stages 1 and 2), or the flat buffer is freed and only the chunk is kept
  (stage 3). A stage-3 plan's generated forward gathers the buckets at its
  start, asynchronously, and waits for each one right before the first op that
  reads one of its parameters, so gathering overlaps compute; the gathered
  parameters stay until the gradients are reduced (as FSDP with
  ``reshard_after_forward=False``), then are freed.

Parameters not summed over any group (tensor-parallel pieces, pipeline stages
without data parallelism) are stepped whole by the same inner optimizer.

Under the main-parameter recipe (``precision="bf16"``/``"fp16"``, ``cube.runtime.amp``) the flat
buffer holds the low-precision weights and each rank's chunk is a float32 main parameter of its
own: the optimizer state and the main parameters are sharded, the gradients are summed in
float32, and the gather after the step moves the rounded low-precision values (Megatron-LM's
distributed optimizer).
"""
from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Dict, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from cube.runtime.amp import DTYPES, MainOptimizer, MainParams, SkipOnOverflow, main_params
from cube.runtime.collectives import all_gather_single, group, nccl


class _Shard:
    """One bucket's flat parameter buffer and this rank's chunk of it."""

    def __init__(self, bucket, stage: int, low: Optional[torch.dtype] = None):
        self.bucket = bucket
        self.ranks = tuple(sorted(bucket.ranks))
        self.n = len(self.ranks)
        self.index = self.ranks.index(dist.get_rank())
        params = bucket.params
        self.numel = sum(p.numel() for p in params)
        self.chunk = math.ceil(self.numel / self.n)
        self.padded = self.chunk * self.n
        self.stage = stage
        ref = params[0]
        self.dtype, self.device = ref.dtype, ref.device
        self.main = low is not None   # low-precision weights in the flat buffer, a float32 chunk
        self.shapes = [p.shape for p in params]
        flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            off = 0
            for p in params:
                flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
                off += p.numel()
        lo = self.index * self.chunk
        # the optimizer's parameter: this rank's chunk; it shares the flat buffer's memory (stages 1
        # and 2, so the step updates the parameters in place), or has its own (stage 3 frees the buffer)
        own = flat[lo:lo + self.chunk]
        self.param = torch.nn.Parameter(own.clone() if stage == 3 or self.main else own)
        self.flat: Optional[torch.Tensor] = None
        self.work = None
        if self.main:
            flat, self.dtype = flat.to(low), low
        self._attach(flat)

    # ---------------------------------------------------------------- parameter memory
    def _attach(self, flat: torch.Tensor) -> None:
        """Makes the bucket's parameters views of ``flat``."""
        self.flat = flat
        off = 0
        for p, shape in zip(self.bucket.params, self.shapes):
            n = math.prod(shape)
            p.data = flat[off:off + n].view(shape)
            off += n

    def release(self) -> None:
        """Frees the full parameters (stage 3 at rest): they become empty until gathered."""
        self.flat = None
        for p in self.bucket.params:
            p.data = torch.empty(0, dtype=self.dtype, device=self.device)

    def gather_async(self) -> None:
        """Starts gathering every owner's chunk into a new flat buffer."""
        if self.work is not None or (self.flat is not None and self.stage == 3):
            return
        flat = self.flat if self.flat is not None else torch.empty(self.padded, dtype=self.dtype,
                                                                   device=self.device)
        own = self.param.detach().to(self.dtype, copy=True)
        grp = group(self.ranks)
        if nccl(flat, grp):
            self.work = all_gather_single(flat, own, group=grp, async_op=True)
        else:
            self.work = dist.all_gather(list(flat.split(self.chunk)), own, group=grp, async_op=True)
        self._pending = (flat, own)

    def wait(self) -> None:
        """Waits for ``gather_async`` and points the parameters at the gathered buffer."""
        if self.work is None:
            if self.flat is None:
                self.gather_async()
            else:
                return
        self.work.wait()
        flat, _ = self._pending
        self.work, self._pending = None, None
        self._attach(flat)

    # ---------------------------------------------------------------- gradients
    def take_gradient(self, flat_grad: torch.Tensor, keep_full: bool) -> None:
        """Stores this rank's chunk of the reduced bucket gradient (the reducer calls this)."""
        lo = self.index * self.chunk
        if flat_grad.numel() == self.chunk:   # already this rank's chunk (reduce-scatter)
            own = flat_grad
        elif keep_full and lo + self.chunk <= flat_grad.numel():
            own = flat_grad[lo:lo + self.chunk]   # a view: ZeRO-1 keeps the full gradients anyway
        else:
            own = torch.zeros(self.chunk, dtype=flat_grad.dtype, device=flat_grad.device)
            hi = min(lo + self.chunk, flat_grad.numel())
            if hi > lo:
                own[:hi - lo].copy_(flat_grad[lo:hi])
        self.param.grad = own if self.param.grad is None else self.param.grad.add_(own)
        if not keep_full:
            for p in self.bucket.params:
                p.grad = None
                if self.main:
                    p.main_grad = None

    def gather_main(self) -> None:
        """Points the parameters at the float32 main values, all-gathered (checkpoints read them)."""
        flat = torch.empty(self.padded, dtype=torch.float32, device=self.device)
        dist.all_gather(list(flat.split(self.chunk)), self.param.detach().contiguous(), group=group(self.ranks))
        self._attach(flat)


class ZeroOptimizer:
    """An optimizer whose state, gradients and (stage 3) parameters are sharded.

    Build it with :func:`build_optimizer`. ``step``/``zero_grad``/``state_dict``
    behave as the inner optimizer's; ``consolidated_state`` returns the state a
    plain optimizer over ``model.parameters()`` would hold (collective over the
    data parallel groups), for checkpoints.
    """

    def __init__(self, model, optimizer_cls: Type[torch.optim.Optimizer], stage: int,
                 accumulate: str = "fp32", **kwargs):
        reducer = getattr(model, "_reducer", None)
        self.model = model
        self.stage = stage
        self.shards: List[_Shard] = []
        precision = getattr(model, "PRECISION", None)
        low = DTYPES[precision] if main_params(precision) else None
        if reducer is not None:
            for b in reducer.buckets:
                if len(b.ranks) > 1:
                    shard = _Shard(b, stage, low)
                    b.shard = shard
                    b.keep_full = stage == 1
                    self.shards.append(shard)
        if not self.shards:
            raise ValueError(f"cube.build_optimizer(zero={stage}): this plan has no data parallelism (no "
                             f"parameter is replicated over several ranks), so there is nothing to shard. "
                             f"Use a policy with data parallelism (PASData, PASHybrid) or zero=0.")
        sharded = {id(p) for s in self.shards for p in s.bucket.params}
        self.whole = [p for p in model.parameters() if id(p) not in sharded and p.requires_grad]
        self.main: Optional[MainParams] = None   # the whole parameters' float32 main values (main recipe)
        stepped = self.whole
        if low is not None:
            trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
            self.main = MainParams(model, [p for p in self.whole if p.is_floating_point()], trainable,
                                   accumulate)
            stepped = [self.main.main_of.get(id(p), p) for p in self.whole]
        self.inner = optimizer_cls([s.param for s in self.shards] + stepped, **kwargs)
        self._shard_of = {id(p): s for s in self.shards for p in s.bucket.params}
        model._zero = self
        model._lowered = low is not None
        if stage == 3:
            for s in self.shards:
                s.release()

    # ---------------------------------------------------------------- torch.optim interface
    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def step(self, closure=None):
        if self.model.loss_scale is not None and self.model.loss_scale.found_inf:
            return None   # fp16 overflow: this step's gradients are not used
        if self.main is not None:
            self.main.load_grads()
        out = self.inner.step(closure)
        if self.main is not None:
            self.main.copy_back()
        if self.stage < 3:
            for s in self.shards:
                s.gather_async()
            for s in self.shards:
                s.wait()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for s in self.shards:
            for p in s.bucket.params:
                p.grad = None
                p.main_grad = None
        if self.main is not None:
            self.main.zero_grad()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)

    # ---------------------------------------------------------------- stage 3 hooks for generated code
    def begin_forward(self) -> None:
        """Starts gathering every bucket (in forward order: the reverse of gradient order)."""
        if self.stage < 3:
            return
        for s in reversed(self.shards):
            s.gather_async()

    def wait_param(self, p: torch.nn.Parameter) -> None:
        if self.stage < 3:
            return
        s = self._shard_of.get(id(p))
        if s is not None:
            s.wait()

    def after_reduce(self) -> None:
        """Frees the gathered parameters once their gradients are reduced (stage 3)."""
        if self.stage == 3:
            for s in self.shards:
                s.release()

    @contextmanager
    def gathered(self, write: bool = False) -> Iterator[None]:
        """Within the block every parameter is whole (stage 3 frees them again after).

        Args:
            write: the block writes the parameters (loading a checkpoint): each
                rank's chunk is taken from them on the way out.
        """
        if self.main is not None or any(s.main for s in self.shards):
            with self._main_values(write):
                yield
            return
        if self.stage < 3:   # the parameters are always whole, and the chunks are views of them
            yield
            return
        for s in self.shards:
            s.gather_async()
        for s in self.shards:
            s.wait()
        try:
            yield
        finally:
            if write:
                with torch.no_grad():
                    for s in self.shards:
                        lo = s.index * s.chunk
                        s.param.copy_(s.flat[lo:lo + s.chunk])
            self.after_reduce()

    @contextmanager
    def _main_values(self, write: bool) -> Iterator[None]:
        """``gathered`` under the main-parameter recipe: the parameters hold the float32 main values
        (all-gathered chunks) inside the block; after it, the low-precision weights (rounded again
        from the main values, which a ``write`` block took from the parameters)."""
        for s in self.shards:
            s.gather_main()
        try:
            with self.main.swapped(write) if self.main is not None else nullcontext():
                yield
        finally:
            with torch.no_grad():
                for s in self.shards:
                    if write:
                        lo = s.index * s.chunk
                        s.param.copy_(s.flat[lo:lo + s.chunk])
                    if self.stage == 3:
                        s.release()
                    else:
                        s._attach(s.flat.to(s.dtype))

    # ---------------------------------------------------------------- checkpoints
    def _stepped(self, p: torch.nn.Parameter) -> torch.nn.Parameter:
        """What the inner optimizer steps for a parameter held whole: its main parameter, or itself."""
        return self.main.main_of.get(id(p), p) if self.main is not None else p

    def consolidated_state(self) -> Tuple[Dict[torch.nn.Parameter, Dict[str, torch.Tensor]], list]:
        """The state a plain optimizer over ``model.parameters()`` would hold (collective).

        Every tensor state of a chunk is all-gathered over its group and cut back
        into per-parameter tensors; scalar state (such as ``step``) is copied.
        """
        state: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]] = {}
        for s in self.shards:
            own = self.inner.state.get(s.param, {})
            keys = sorted(own)
            for p in s.bucket.params:
                state[p] = {}
            for key in keys:
                v = own[key]
                if not (torch.is_tensor(v) and v.shape == s.param.shape):
                    for p in s.bucket.params:
                        state[p][key] = v.clone() if torch.is_tensor(v) else v
                    continue
                parts = [torch.empty_like(v) for _ in range(s.n)]
                dist.all_gather(parts, v.contiguous(), group=group(s.ranks))
                flat = torch.cat(parts)
                off = 0
                for p, shape in zip(s.bucket.params, s.shapes):
                    n = math.prod(shape)
                    state[p][key] = flat[off:off + n].view(shape).clone()
                    off += n
        for p in self.whole:
            key = self._stepped(p)
            if key in self.inner.state:
                state[p] = dict(self.inner.state[key])
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]
        return state, groups

    def load_consolidated_state(self, state: Dict[torch.nn.Parameter, Dict[str, torch.Tensor]],
                                param_groups: Optional[list] = None) -> None:
        """Loads per-parameter state (as ``consolidated_state`` returns it): each rank keeps its chunks."""
        for s in self.shards:
            per = [state.get(p, {}) for p in s.bucket.params]
            keys = set().union(*per) if per else set()
            if not keys:
                continue
            target = {}
            lo = s.index * s.chunk
            for key in keys:
                vals = [d.get(key) for d in per]
                if all(torch.is_tensor(v) and v.shape == shape for v, shape in zip(vals, s.shapes)):
                    flat = torch.zeros(s.padded, dtype=vals[0].dtype, device=s.device)
                    off = 0
                    for v in vals:
                        flat[off:off + v.numel()].copy_(v.reshape(-1))
                        off += v.numel()
                    target[key] = flat[lo:lo + s.chunk].clone()
                else:
                    v = next(x for x in vals if x is not None)
                    target[key] = v.clone() if torch.is_tensor(v) else v
            self.inner.state[s.param] = target
        for p in self.whole:
            if p in state:
                self.inner.state[self._stepped(p)] = {k: (v.to(p.device) if torch.is_tensor(v) and v.dim() else v)
                                                      for k, v in state[p].items()}
        if param_groups:
            for g, saved in zip(self.inner.param_groups, param_groups):
                g.update({k: v for k, v in saved.items() if k != "params"})


def planned_stage(model) -> Optional[int]:
    """The ZeRO stage ``model``'s plan was compiled with (``cube.compile(..., zero=)``), or None
    when the module does not say (built outside ``cube.load_model``)."""
    stage = getattr(model, "zero_stage", None)
    if stage is None and getattr(model, "ZERO", 0) == 3:
        stage = 3
    return stage


def build_optimizer(model, optimizer_cls: Type[torch.optim.Optimizer] = torch.optim.AdamW,
                    zero: Optional[int] = None, main_grads: str = "fp32", **kwargs):
    """The optimizer for a generated module, with ZeRO sharding over its data parallel groups.

    The ZeRO stage is said once, in ``cube.compile(..., zero=)``: without ``zero``
    the optimizer follows the plan. A plan compiled with ``zero=0`` (the default)
    still takes stage 1 or 2 here, as those need nothing at compile time.

    On a plan compiled with ``precision="bf16"``/``"fp16"`` the optimizer steps float32 main
    parameters (the module's float32 values at this call) and the module's weights become their
    low-precision copies, refreshed after each step; gradients accumulate in float32
    (``param.main_grad``). See ``cube.runtime.amp`` and docs/precision.md.

    Args:
        model: the module from ``cube.load_model()``.
        optimizer_cls: a ``torch.optim.Optimizer`` class (AdamW, SGD, ...).
        zero: None (the plan's stage), or 0 (a plain optimizer), 1 (shard optimizer
            state), 2 (and gradients), 3 (and parameters; the plan must be compiled
            with ``zero=3``); a stage the plan was not compiled with is refused.
        main_grads: under ``precision="bf16"``/``"fp16"``, how gradients accumulate: ``"fp32"``
            (default; Megatron-LM's float32 main-gradient buffer) or ``"bf16"`` (in the weights'
            dtype, summed over ranks in float32, as torchtitan; kept for measurement,
            docs/precision.md).
        **kwargs: the optimizer's hyperparameters (lr, weight_decay, ...).

    Raises:
        ValueError: an unknown stage, a stage contradicting the compiled plan's, or
            a plan without data parallelism.
    """
    if zero is not None and zero not in (0, 1, 2, 3):
        raise ValueError(f"cube.build_optimizer: zero must be 0, 1, 2 or 3 (or left out to follow the plan), "
                         f"got {zero!r}")
    if not isinstance(optimizer_cls, type) or not issubclass(optimizer_cls, torch.optim.Optimizer):
        raise TypeError(f"cube.build_optimizer: optimizer_cls must be a torch.optim.Optimizer class such as "
                        f"torch.optim.AdamW, got {optimizer_cls!r}")
    planned = planned_stage(model)
    if zero is None:
        zero = planned or 0
    elif zero == 3 and planned != 3:
        raise ValueError("cube.build_optimizer(zero=3): the plan was not compiled for ZeRO-3, whose forward "
                         "gathers the sharded parameters; compile with @cube.compile(..., zero=3) (then "
                         "cube.build_optimizer needs no zero=)")
    elif planned and zero != planned:
        raise ValueError(f"cube.build_optimizer(zero={zero}): the plan was compiled with zero={planned}; "
                         f"leave zero= out (the optimizer follows the plan) or compile with zero={zero}")
    precision = getattr(model, "PRECISION", None)
    if main_params(precision) and (getattr(model, "_main", None) is not None
                                   or getattr(model, "_zero", None) is not None):
        raise ValueError("cube.build_optimizer: this model already has an optimizer over its float32 main "
                         "parameters; build one per model")
    if zero == 0 and main_params(precision):
        return MainOptimizer(model, optimizer_cls, main_grads, **kwargs)
    if zero == 0:
        plain = optimizer_cls(model.parameters(), **kwargs)
        return SkipOnOverflow(plain, model) if getattr(model, "loss_scale", None) is not None else plain
    if getattr(model, "_zero", None) is not None:
        raise ValueError("cube.build_optimizer: this model already has a ZeRO optimizer; build one per model")
    return ZeroOptimizer(model, optimizer_cls, zero, accumulate=main_grads, **kwargs)


def whole_parameters(model, write: bool = False):
    """A context in which ``model``'s parameters are whole, also under ZeRO-3 (see ``gathered``), and
    hold their float32 main values under the main-parameter recipe (``cube.runtime.amp``)."""
    zero = getattr(model, "_zero", None)
    if zero is not None:
        return zero.gathered(write)
    main = getattr(model, "_main", None)
    return main.swapped(write) if main is not None else nullcontext()
