"""Parity of a plan in the in-process world (``cube.debug.run``): the compiled step on every rank
against the plain model on the same full batches, loss and every parameter piece."""
from __future__ import annotations

import copy
import os
import sys
import tempfile
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

import cube
import cube.debug
from tests.parity import global_batches, rel


# AdamW's update of an entry whose gradient is far below ``eps`` is lr * g / eps: the absolute
# round-off of another summation order (tensor pieces, micro-batches; 1e-10 here) becomes 1e-5 of
# the parameter on AVX-512 and AMX kernels, which round differently from AVX2 ones (tensor and
# sequence parallel GPT reads 1.2e-5 with torch's default 1e-8, under 1e-5 with 1e-6; SGD, whose
# update is linear in the gradient, is not affected). eps=1e-6 keeps the tests' 1e-5 about the plan.
ADAMW = {"eps": 1e-6}


def optimizer(name: str) -> Callable:
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=1e-2)
    if name == "adamw":   # eps: see ADAMW
        return lambda params: torch.optim.AdamW(params, lr=1e-3, **ADAMW)
    raise ValueError(f"unknown optimizer {name!r}")


def eager_reference(model: torch.nn.Module, batches, make: Callable) -> Tuple[list, dict]:
    """One optimizer step (``make(params)``) of a copy of the plain model per global batch: its losses
    and its parameters after the last step, by name."""
    ref = copy.deepcopy(model)
    ref_opt = make(ref.parameters())
    losses = []
    for b in batches:
        loss = ref(*b)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.detach())
    return losses, dict(ref.named_parameters())


class Float32Islands(torch.overrides.TorchFunctionMode):
    """The casts of the low-precision forward, by hand (``cube.passes.precision``): losses read
    float32 inputs (Megatron-LM's ``logits.float()``), on the CPU ``log_softmax`` computes in
    float32 and rounds its output back, and matrix products and attention read every float input
    in ``low`` (a float32 buffer or batch value meeting a bf16 weight)."""

    LOSSES = {F.cross_entropy, F.nll_loss, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.kl_div,
              F.binary_cross_entropy, F.binary_cross_entropy_with_logits}
    LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax}
    LOW = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm,
           F.scaled_dot_product_attention}

    def __init__(self, low: torch.dtype = torch.bfloat16):
        super().__init__()
        self.low = low

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def to(dtype):
            return lambda a: a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
        if func in self.LOSSES or (func in self.LOG_SOFTMAX and args[0].device.type == "cpu"):
            out = func(*map(to(torch.float32), args), **kwargs)
            return out.to(args[0].dtype) if func in self.LOG_SOFTMAX else out
        if func in self.LOW:
            return func(*map(to(self.low), args), **{k: to(self.low)(v) for k, v in kwargs.items()})
        return func(*args, **kwargs)


def main_params_reference(model: torch.nn.Module, batches, make: Callable, shares: int = 1,
                          low: torch.dtype = torch.bfloat16, islands: type = Float32Islands) -> Tuple[list, dict]:
    """Megatron-LM's mixed precision by hand, in one process: a low-precision copy of the model
    runs forward (in its weights' dtype, no autocast, with cube's float32 islands:
    ``Float32Islands``) and backward; float32 main parameters
    (the plain model's values) are stepped by ``make(params)`` on float32 gradients and copied back
    into the copy after each step. Each global batch runs as ``shares`` equal micro-batches along
    dim 0 (a plan's batch pieces: data parallel degree x micro-batches), each micro-batch's
    low-precision gradient added to a float32 main gradient: the recipe at that micro-batch size.
    ``islands``: the torch function mode the forward runs under (``Float32Islands``, or a
    subclass that also runs some products another way, e.g. float8).

    Returns:
        The losses (float32) and the main parameters after the last step, by name.
    """
    work = copy.deepcopy(model)
    named = dict(work.named_parameters())
    mains = {n: p.detach().clone() for n, p in named.items()}
    for p in named.values():
        p.data = p.data.to(low)
    main_opt = make(list(mains.values()))
    losses = []
    for b in batches:
        total = torch.zeros((), dtype=torch.float32)
        grads = {n: None for n in named}
        for micro in zip(*(t.chunk(shares) for t in b)):
            with islands(low):
                loss = work(*micro) / shares
            loss.backward()
            total += loss.detach().float()
            for n, p in named.items():
                if p.grad is not None:
                    grads[n] = p.grad.float() if grads[n] is None else grads[n] + p.grad.float()
                    p.grad = None
        for n, m in mains.items():
            m.grad = grads[n]
        main_opt.step()
        main_opt.zero_grad()
        with torch.no_grad():
            for n, p in named.items():
                p.copy_(mains[n])
        losses.append(total)
    return losses, mains


def parity(model: torch.nn.Module, sample, policy, world: int, steps: int = 3, nmicros: int = 1,
           opt: str = "sgd", build: Optional[Callable] = None, batches: Optional[list] = None,
           param_floor: float = 0.0, seed: Optional[int] = None, reference: Optional[Callable] = None,
           **compile_kw) -> List[Tuple[float, float]]:
    """Runs ``steps`` steps through cube on ``world`` in-process ranks and eagerly, each on one global
    batch of ``nmicros`` times the sample's batch size (a pipeline plan cuts it into ``nmicros``
    micro-batches; the plain model trains on it whole).

    Args:
        opt: ``"sgd"`` or ``"adamw"``, on both sides.
        build: makes the compiled module's optimizer (e.g. with ``cube.build_optimizer``); it must
            step like ``opt`` (default: ``opt`` on the module's parameters).
        batches: the ``steps`` global batches to train on (default: random ones shaped like ``sample``).
        param_floor: a parameter whose root-mean-square is below it is compared against it instead
            of its own norm (a bias a model initializes to zero whose gradient is zero by
            construction, e.g. a key projection's, holds only round-off after an SGD step).
        seed: seeds the default generator right before the plain model's first step and before
            the compiled one's (random ops: both start from the same state; ``exact_rng``).
        reference: ``(model, batches, make) -> (losses, parameters by name)``, the single process
            to compare with (default: ``eager_reference``, the plain model).
        compile_kw: passed to ``cube.compile`` (``zero=``, ``precision=``, ...).

    Returns:
        Per rank: (largest relative loss error, largest relative parameter-piece error).
    """
    batches = batches if batches is not None else global_batches(sample, steps, nmicros)
    make = optimizer(opt)
    if seed is not None:
        torch.manual_seed(seed)
    ref_losses, ref_params = (reference or eager_reference)(model, batches, make)
    cache = tempfile.mkdtemp(prefix="cube-parity-")

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy, cache_dir=cache, **compile_kw)
        def train_iter(model, dataloader):
            data = next(dataloader)
            loss = model(*data)
            loss.backward()
            return loss
        gen = cube.load_model()
        gen_opt = build(gen) if build is not None else make(gen.parameters())
        losses = []
        if seed is not None:   # each rank: ranks of the in-process world share the generator (cube.runtime.rng)
            torch.manual_seed(seed)
        for _ in range(steps):
            losses.append(train_iter(gen, it).detach())
            gen_opt.step()
            gen_opt.zero_grad()
        loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
        param_err = 0.0
        with cube.runtime.zero.whole_parameters(gen):   # ZeRO-3 holds only chunks at rest
            for local, p in gen.named_parameters():
                names, splits = gen.PARAMS[local]
                ref = cube.runtime.piece(ref_params[names[0]], splits)
                err = rel(p, ref) if not param_floor else \
                    (p.detach().double() - ref.detach().double()).norm().item() / \
                    max(ref.detach().double().norm().item(), param_floor * ref.numel() ** 0.5)
                if err > 1e-5 and os.environ.get("CUBE_DEBUG_PARITY"):
                    print(f"rank {cube.debug.rank()}: {names[0]} {splits} rel {err:.2e}", file=sys.stderr)
                param_err = max(param_err, err)
        return loss_err, param_err
    return cube.debug.run(body, world)


def assert_exact(errors: List[Tuple[float, float]], tol: float = 1e-5) -> None:
    worst = max(max(e) for e in errors)
    assert worst <= tol, f"relative errors per rank (loss, parameters): {errors}"
