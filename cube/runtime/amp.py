"""Mixed precision: half-precision weights with float32 main parameters, or autocast over float32
weights; loss scaling for fp16.

The recipes (``cube.compile(precision=)``; docs/precision.md):

- ``"bf16"`` / ``"fp16"``, Megatron-LM's: each rank holds its weight pieces in the low precision
  for compute; ``cube.build_optimizer`` keeps float32 *main parameters* and the optimizer state
  over them (``MainParams``; sharded under ZeRO), copies the stepped values back into the
  low-precision weights after each step, and accumulates every gradient in a float32 *main
  gradient* (``param.main_grad``: each micro-batch's low-precision gradient is added to it as
  soon as autograd makes it, and the data parallel sums run on it, in float32). Checkpoints and
  ``cube.runtime.zero.whole_parameters`` see the float32 main parameters.
- ``"fp8"``: ``"bf16"``'s, the linear layers' three matrix products in float8 with dynamic
  tensorwise scales (torchao's float8 training; ``cube.passes.float8``, ``cube.runtime.float8``).
- ``"bf16-autocast"`` / ``"fp16-autocast"``: float32 parameters, gradients and optimizer state;
  matrix products run in the low precision under ``torch.autocast``, which casts the weights at
  every forward.

The first runs the forward in the weights' dtype without autocast, with the float32 islands
``cube.passes.precision`` prints as casts (losses read float32; norms and softmax keep float32
statistics inside their kernels); the second runs it under ``torch.autocast``, so losses,
normalizations and softmax compute in float32 (autocast's float32 list). Under fp16 the generated forward
multiplies the loss's gradient by a dynamic loss scale; after the gradient reduction ``unscale``
divides it out, checks every rank's gradients for inf/NaN (one all-reduce), and halves the scale
on overflow or doubles it after ``growth_interval`` clean steps. The optimizer from
``cube.build_optimizer`` skips the step of an overflowed step.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist

from cube.errors import CubeInternalError
from cube.runtime.compiled import outside_graph

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16,
          "bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}
PRECISIONS = (None, "bf16", "fp16", "fp8", "bf16-autocast", "fp16-autocast")


def check_precision(precision, where: str = "cube.compile") -> None:
    """Raises a ``ValueError`` naming the choices for an unknown ``precision``."""
    if precision == "fp8":
        check_fp8(where)
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: precision must be None, 'bf16', 'fp16' (half-precision weights, float32 "
                         f"main parameters in cube.build_optimizer), 'fp8' ('bf16' with the linear layers' "
                         f"matrix products in float8) or 'bf16-autocast', 'fp16-autocast' "
                         f"(torch.autocast over float32 weights), got {precision!r}")


def check_tp_reduce_dtype(dtype, precision, where: str = "cube.compile") -> None:
    """Refuses a ``tp_reduce_dtype`` other than None and ``torch.float32``, or one without a
    main-parameter precision (whose partial products are low precision)."""
    if dtype is None:
        return
    if dtype != torch.float32:
        raise ValueError(f"{where}: tp_reduce_dtype must be None (partial sums in the weights' dtype) or "
                         f"torch.float32, got {dtype!r}")
    if not main_params(precision):
        raise ValueError(f"{where}: tp_reduce_dtype=torch.float32 widens the low-precision partial products of "
                         f"precision='bf16', 'fp16' or 'fp8'; precision={precision!r} has none (float32 plans sum "
                         f"in float32 already, autocast plans in autocast's dtype). Drop tp_reduce_dtype")


def main_params(precision) -> bool:
    """Whether ``precision`` is the recipe with low-precision weights and float32 main parameters
    (``"fp8"`` is ``"bf16"``'s, its linear layers' products in float8)."""
    return precision in ("bf16", "fp16", "fp8")


def is_fp16(precision) -> bool:
    """Whether ``precision`` computes in float16 (and so scales the loss)."""
    return precision in ("fp16", "fp16-autocast")


def grad_of(p: torch.Tensor):
    """The gradient the optimizer steps ``p`` with: its float32 main gradient under the main-parameter
    recipe (``MainParams``), else ``p.grad``."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


class LossScale:
    """The dynamic loss scale of an fp16 plan (one per generated module)."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000):
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.clean_steps = 0
        self.found_inf = False

    def update(self, found_inf: bool) -> None:
        self.found_inf = found_inf
        if found_inf:
            self.scale /= 2.0
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:
                self.scale *= 2.0
                self.clean_steps = 0


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss, scale):
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@outside_graph
def scale_loss_grad(loss: torch.Tensor, model) -> torch.Tensor:
    """The loss unchanged; its gradient multiplied by the module's loss scale (fp16 plans)."""
    return _ScaleGrad.apply(loss, model.loss_scale.scale)


@torch.no_grad()
def unscale(model, grads) -> None:
    """Divides ``grads`` by the loss scale and records (on every rank alike) whether any overflowed."""
    ls = model.loss_scale
    inv = 1.0 / ls.scale
    bad = torch.zeros((), dtype=torch.float32, device=model.device)
    for g in grads:
        g.mul_(inv)
        bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    ls.update(bool(bad.item()))


class SkipOnOverflow:
    """A plain optimizer that skips the step when the fp16 loss scale overflowed."""

    def __init__(self, optimizer: torch.optim.Optimizer, model):
        self.inner = optimizer
        self.model = model

    param_groups = property(lambda self: self.inner.param_groups)
    state = property(lambda self: self.inner.state)

    def step(self, closure=None):
        if self.model.loss_scale.found_inf:
            return None
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


def check_fp8(where: str = "cube.compile") -> None:
    """Refuses ``precision="fp8"`` on a CUDA GPU without float8 matrix products (compute capability
    below 8.9: Ada is 8.9, Hopper 9.0). On the CPU ``torch._scaled_mm`` emulates them (slowly):
    allowed, for tests and checks."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        cc = ".".join(map(str, torch.cuda.get_device_capability()))
        raise ValueError(f"{where}: precision='fp8' runs the linear layers' matrix products in float8 "
                         f"(torch._scaled_mm), which needs a GPU of compute capability 8.9 or newer (Ada, "
                         f"Hopper: H100, H200, L4, L40S); {torch.cuda.get_device_name()} has {cc}. "
                         f"Use precision='bf16' here")


# ---------------------------------------------------------------------------- main parameters
ACCUMULATE = ("fp32", "bf16")


class MainParams:
    """Float32 main parameters of the module's low-precision weights that an optimizer steps whole
    (those no ZeRO shard holds), and the float32 gradient accumulation of every weight.

    Made by ``cube.build_optimizer`` on a plan compiled with ``precision="bf16"``/``"fp16"``: each
    parameter's float32 values become its main parameter (no copy: the storage moves) and the
    module's parameter a low-precision copy of them.

    Args:
        model: the generated module.
        params: the trainable floating parameters stepped whole (the rest are in ZeRO shards).
        hooked: every trainable floating parameter of the module (gradients of all of them go to
            ``main_grad``).
        accumulate: ``"fp32"`` (Megatron-LM's main-gradient buffer: each low-precision gradient
            autograd makes is added to ``param.main_grad`` at once and freed) or ``"bf16"``
            (torchtitan's: gradients accumulate over micro-batches in the weights' dtype and are
            summed over data parallel ranks in float32, then become the main gradients).
    """

    def __init__(self, model, params, hooked, accumulate: str = "fp32"):
        if accumulate not in ACCUMULATE:
            raise ValueError(f"cube.build_optimizer: main_grads must be one of {ACCUMULATE}, got {accumulate!r}")
        self.model = model
        self.low = DTYPES[model.PRECISION]
        self.accumulate = accumulate
        self.params = list(params)
        self.mains: List[torch.nn.Parameter] = []
        with torch.no_grad():
            for p in self.params:
                if p.dtype != torch.float32:
                    raise CubeInternalError(f"main parameters are made from float32 parameters, got {p.dtype}")
                self.mains.append(torch.nn.Parameter(p.data, requires_grad=False))   # takes the storage
                p.data = p.data.to(self.low)
        self.main_of: Dict[int, torch.nn.Parameter] = {id(p): m for p, m in zip(self.params, self.mains)}
        model._lowered = True   # the compiled step trains it (cube.compiler.CompiledStep)
        reducer = getattr(model, "_reducer", None)
        if reducer is not None:
            reducer.main = True
        if accumulate == "fp32":
            through_reducer = reducer.hooked() if reducer is not None else set()
            if reducer is not None:
                reducer.on_grad = accumulate_main_grad
            for p in hooked:
                if id(p) not in through_reducer:
                    p.register_post_accumulate_grad_hook(accumulate_main_grad)

    def load_grads(self) -> None:
        """Hands the main gradients to the main parameters (before the optimizer's step)."""
        for p, m in zip(self.params, self.mains):
            if getattr(p, "main_grad", None) is None and p.grad is not None:   # "bf16": not summed by a reducer
                p.main_grad, p.grad = p.grad.float(), None
            m.grad = getattr(p, "main_grad", None)

    @torch.no_grad()
    def copy_back(self) -> None:
        """The stepped main parameters rounded into the module's weights."""
        for p, m in zip(self.params, self.mains):
            p.copy_(m)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.mains):
            p.grad, m.grad = None, None
            p.main_grad = None

    @contextmanager
    def swapped(self, write: bool = False) -> Iterator[None]:
        """Within the block the module's parameters hold their float32 main values (checkpoints read
        and write those); on the way out the weights are the low-precision copies again."""
        for p, m in zip(self.params, self.mains):
            p.data = m.data
        try:
            yield
        finally:
            with torch.no_grad():
                for p, m in zip(self.params, self.mains):
                    p.data = m.data.to(self.low)


def accumulate_main_grad(p: torch.Tensor) -> None:
    """Adds the low-precision gradient autograd just accumulated into ``p.grad`` to ``p.main_grad``
    (float32) and frees it: a post-accumulate-grad hook, so each micro-batch's gradient is added in
    float32, as Megatron-LM's main-gradient buffer."""
    g = p.grad
    if g is None:
        return
    p.grad = None
    main = getattr(p, "main_grad", None)
    if main is None:
        p.main_grad = g.to(torch.float32)
    else:
        main.add_(g)


class MainOptimizer:
    """The optimizer of a main-parameter plan without ZeRO: ``optimizer_cls`` over float32 main
    parameters, whose values are copied into the module's low-precision weights after each step.
    ``state_dict`` is the inner optimizer's; checkpoints take ``consolidated_state`` (keyed by the
    module's parameters, as a plain optimizer over ``model.parameters()`` would be)."""

    def __init__(self, model, optimizer_cls, accumulate: str = "fp32", **kwargs):
        trainable = [p for p in model.parameters() if p.requires_grad and p.is_floating_point()]
        self.model = model
        self.main = MainParams(model, trainable, trainable, accumulate)
        self.inner = optimizer_cls(self.main.mains, **kwargs)
        model._main = self.main

    param_groups = property(lambda self: self.inner.param_groups)
    state = property(lambda self: self.inner.state)

    def step(self, closure=None):
        if self.model.loss_scale is not None and self.model.loss_scale.found_inf:
            return None   # fp16 overflow: this step's gradients are not used
        self.main.load_grads()
        out = self.inner.step(closure)
        self.main.copy_back()
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=True)
        self.main.zero_grad()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)

    def gathered(self, write: bool = False):
        return self.main.swapped(write)

    def consolidated_state(self):
        state = {p: dict(self.inner.state[m]) for p, m in zip(self.main.params, self.main.mains)
                 if m in self.inner.state}
        return state, [{k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups]

    def load_consolidated_state(self, state, param_groups=None) -> None:
        for p, m in zip(self.main.params, self.main.mains):
            if p in state:
                self.inner.state[m] = {k: (v.to(m.device) if torch.is_tensor(v) and v.dim() else v)
                                       for k, v in state[p].items()}
        if param_groups:
            for g, saved in zip(self.inner.param_groups, param_groups):
                g.update({k: v for k, v in saved.items() if k != "params"})
