"""Runs a model eagerly and through cube on the same batches and compares."""
from __future__ import annotations

import copy

import torch

import cube


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a tensor, ||a - b|| / ||b||, in double precision on the CPU.

    (The largest elementwise deviation is not used for parameters: AdamW divides
    each gradient by its own running magnitude, so an element whose gradient is
    near zero turns round-off from a different summation order into an update
    of size lr; that is the optimizer's sensitivity, not a wrong result.)
    """
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.is_complex() or b.is_complex():   # both parts
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def batches_like(sample, count: int, seed: int = 1):
    """``count`` random batches shaped like ``sample`` (integer tensors below the sample's maximum + 1)."""
    gen = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(t.shape, generator=gen) if t.dtype.is_floating_point
                  else torch.randint(0, int(t.max()) + 1, t.shape, generator=gen) for t in sample)
            for _ in range(count)]


def global_batches(sample, steps: int, nmicros: int = 1, seed: int = 1):
    """``steps`` random global batches of ``nmicros`` times the sample's batch size (each the
    ``nmicros`` batches shaped like ``sample`` that ``batches_like`` draws, joined along dim 0): what
    a pipeline plan's loader yields, one batch per step."""
    parts = batches_like(sample, steps * nmicros, seed=seed)
    return [tuple(torch.cat(ts) for ts in zip(*parts[i * nmicros:(i + 1) * nmicros])) for i in range(steps)]


def _optimizer(opt: str, params, lr: float):
    if opt not in ("adamw", "sgd"):
        raise ValueError(f"unknown optimizer {opt!r}: adamw or sgd")
    return torch.optim.AdamW(params, lr=lr) if opt == "adamw" else torch.optim.SGD(params, lr=lr)


def eager_run(model, batches, steps, lr=1e-3, opt="adamw"):
    """Plain single-device steps (AdamW, or SGD); returns (losses, parameters, buffers) by name."""
    opt = _optimizer(opt, model.parameters(), lr)
    losses = []
    for i in range(steps):
        loss = model(*batches[i])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, dict(model.named_parameters()), dict(model.named_buffers())


def compile_step(model, loader, policy, cache_dir, tensor_batch: bool = False, zero: int = 0, precision=None,
                 backend=None):
    """``cube.compile`` of the standard step (``model(data)`` when ``tensor_batch``; ``backend``: a
    ``torch.compile`` backend for the generated compute)."""
    @cube.compile(model, loader, PAS=policy, cache_dir=cache_dir, zero=zero, precision=precision, backend=backend)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(data) if tensor_batch else model(*data)
        loss.backward()
        return loss
    return train_iter


def cube_run(model, batches, steps, policy, cache_dir, lr=1e-3, opt="adamw"):
    """The same through ``cube.compile``; returns (losses, parameters, buffers, step)."""
    it = iter(batches)
    train_iter = compile_step(model, it, policy, cache_dir)
    gen = cube.load_model()
    opt = _optimizer(opt, gen.parameters(), lr)
    losses = []
    for _ in range(steps):
        loss = train_iter(gen, it)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    names = gen.full_names()
    # each user tensor put together from its pieces (a fused weight is held as one piece per block)
    params = {}
    for local, p in gen.named_parameters():
        name, splits = gen.PARAMS[local][0][0], gen.PARAMS[local][1]
        if name not in params:
            params[name] = torch.full(gen.FULL_SHAPES[name], float("nan"), dtype=p.dtype)
        cube.runtime.piece(params[name], splits).copy_(p.detach())
    buffers = {names[k][0]: v for k, v in gen.named_buffers() if k in names}
    return losses, params, buffers, train_iter


def assert_close(a, b, rtol, what):
    a, b = a.detach().float(), b.detach().float()
    err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    assert err <= rtol, f"{what}: relative error {err:.3e} > {rtol:.0e}"


def check_parity(model, batches, steps, policy, cache_dir, rtol=1e-6, opt="adamw"):
    """Asserts cube and eager give the same losses and parameters each run (``opt``: ``"adamw"`` or
    ``"sgd"``, on both sides)."""
    ref = copy.deepcopy(model)
    ref_losses, ref_params, ref_buffers = eager_run(ref, batches, steps, opt=opt)
    losses, params, buffers, step = cube_run(model, batches, steps, policy, cache_dir, opt=opt)
    assert len(losses) == steps
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_close(a, b, rtol, f"loss at step {i}")
    assert set(params) <= set(ref_params), set(params) - set(ref_params)
    assert len(params) == len(ref_params), (sorted(params), sorted(ref_params))
    for name, p in params.items():
        assert_close(p, ref_params[name], rtol, f"parameter {name}")
    assert len(buffers) == len(ref_buffers), (sorted(buffers), sorted(ref_buffers))
    for name, b in buffers.items():
        assert_close(b, ref_buffers[name], rtol, f"buffer {name}")
    return step
