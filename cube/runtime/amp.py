"""Mixed precision: bf16/fp16 compute over float32 parameters, and loss scaling for fp16.

A plan compiled with ``precision="bf16"`` or ``"fp16"`` runs its forward under
``torch.autocast``: parameters, gradients and optimizer state stay float32 (the
master weights), matrix products run in the low precision. Under fp16 the
generated forward multiplies the loss's gradient by a dynamic loss scale; after
the gradient reduction ``unscale`` divides it out, checks every rank's
gradients for inf/NaN (one all-reduce), and halves the scale on overflow or
doubles it after ``growth_interval`` clean steps. The optimizer from
``cube.build_optimizer`` skips the step of an overflowed step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from cube.runtime.compiled import outside_graph

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
