"""Random numbers of a compiled step: what generated code calls at each random op piece.

Every random op piece (dropout, attention with dropout, ``rand``, ``exponential``...) is called as
``runtime.rng.call(self, index, box, op, *args)``: ``index`` is the op's position
among the step's draws in the single device's order (``cube.passes.rng``),
``box`` the piece's ``(start, stop)`` per dim of its output in the full tensor
(of the micro-batch, in a pipeline plan). The step is bracketed by
:func:`step`. Two modes (the generated module's ``RNG["exact"]``):

Default (``cube.compile(...)``), as Megatron-LM's RNG tracker: the piece runs
its own op on its own tensors, with the device's default generator seeded for
that call only (then put back) from::

    seed = blake2b(torch.initial_seed(), step, index, micro-batch, box) -> 63 bits

``torch.initial_seed()`` is the user's seed (``torch.manual_seed``; every rank
must seed alike, as one process would), ``step`` counts this model's steps,
``micro-batch`` is the pipeline micro-batch (0 without one). Replicas of a
tensor have equal boxes, so they draw the same mask; the pieces of a split
tensor (and data-parallel ranks, pieces along the batch) have other boxes and
draw independent masks; each step and micro-batch draws new ones. Recompute
calls the piece again with the same key, so it redraws the same mask. The
user's generator is left where it was: the step draws nothing from it.

Exact (``cube.compile(..., exact_rng=True)``, CPU): at the start of the step
every rank draws the *whole* output of every random op of the step (its mask,
for dropout), in the single device's order, with the default generator starting
from the state it has when the step starts, by calling the same ATen op at the
op's full shape, dtype and memory layout: exactly the numbers the plain model
draws (``cube.passes.rng`` lists the ops):

- ``dropout``, ``native_dropout``: the op on a tensor of ones (``dropout``
  returns its scaled mask, ``native_dropout`` its boolean one); the dropout of
  ``scaled_dot_product_attention`` is the ``dropout`` of its attention weights;
- the ops whose output depends only on their input's shape, dtype and layout
  (``exponential``, ``uniform``, ``normal_``, ``bernoulli`` of a float ``p``,
  ``random``, ``rand_like``, ``randn_like``, ``randint_like``, ``geometric``,
  ``log_normal``, ``cauchy``): the op on an empty tensor;
- ``bernoulli`` of a tensor of probabilities: ``uniform`` on an empty tensor
  (the CPU kernel draws one uniform number per element and keeps ``u < p``);
- ``rand``, ``randn``, ``randint``: the op with its arguments.

A piece takes its slice (a pipeline micro-batch its rows of the global batch)
and computes the op the way the single device does (``x * mask``, the numbers
themselves, ``u < p``), so its values are the single device's values.
Masks are kept for the step (recompute reads them again); at the end of the
step the default generator is set to the state the plain model leaves, so the
next step continues the same stream. The draws use the default generator with
its state swapped in and out under a lock (``aten.dropout`` takes no
generator), so ranks sharing one process (``cube.debug``) do not disturb one
another.
"""
from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from cube.errors import CubeInternalError
from cube.runtime import session
from cube.runtime.compiled import outside_graph

aten = torch.ops.aten
_LOCK = threading.RLock()   # default generators are shared by the ranks of an in-process world


@dataclass(eq=False)
class StepRng:
    """The random state of one step of one generated module.

    Attributes:
        exact: exact mode (see the module docstring).
        base: the user's seed (default mode).
        step: the step's number (default mode).
        masks: exact mode: draw index -> the whole mask drawn for it (only the draws this rank runs).
        end: exact mode: the default generator's state after the step's last draw.
    """

    exact: bool
    base: int = 0
    step: int = 0
    masks: Dict[int, torch.Tensor] = field(default_factory=dict)
    end: Optional[torch.Tensor] = None


def _table(model) -> dict:
    table = getattr(type(model), "RNG", None)
    if table is None:
        raise CubeInternalError(f"{type(model).__name__} calls runtime.rng without an RNG table")
    return table


def _begin(model) -> StepRng:
    table = _table(model)
    count = model.__dict__.get("_rng_steps", 0)
    model.__dict__["_rng_steps"] = count + 1
    if not table["exact"]:
        return StepRng(False, base=torch.initial_seed(), step=count)
    if model.device.type != "cpu":
        raise ValueError(f"exact_rng=True reproduces the CPU generator's stream only so far; this rank runs on "
                         f"{model.device}. Compile without exact_rng on GPUs.")
    st = StepRng(True)
    gen = torch.default_generator
    with _LOCK:
        start = gen.get_state()
        try:
            for index, (kind, shape, dtype, p, _rows, strides, call) in enumerate(table["draws"]):
                mask = _draw_whole(kind, shape, dtype, p, strides, call)
                if index in table["mine"]:
                    st.masks[index] = mask
            st.end = gen.get_state()
        finally:   # the other ranks of an in-process world start from the same state
            gen.set_state(start)
    return st


def _draw_whole(kind: str, shape, dtype, p: float, strides=None, call=None) -> torch.Tensor:
    """The whole draw of one random op from the default generator, as the single device draws it: a
    dropout's mask on ones laid out as the single device's input (dropout draws in its input's memory
    order); the output of an op drawing numbers of its input's shape, on an empty tensor laid out as
    the single device's output; the uniform numbers a ``bernoulli`` of probabilities compares them with;
    a creation op's output."""
    if kind == "rand":   # rand, randn, randint: the arguments say it all
        fn, args = call
        return fn(**dict(args), dtype=dtype)
    if kind == "bernoulli":   # bernoulli_distribution<float> (<double> for float64 probabilities) per element
        dtype = torch.float64 if dtype == torch.float64 else torch.float32
    if strides is None:
        empty = torch.empty(shape, dtype=dtype)
    else:
        empty = torch.empty_strided(shape, strides, dtype=dtype)
    if kind == "values":
        fn, args = call
        return fn(empty, **dict(args))
    if kind == "bernoulli":
        return aten.uniform.default(empty, 0.0, 1.0)
    ones = empty.fill_(1)
    if kind in ("dropout", "sdpa"):   # dropout(1) is the mask already scaled by 1 / (1 - p)
        return aten.dropout.default(ones, p, True)
    if kind == "native_dropout":
        return aten.native_dropout.default(ones, p, True)[1]
    raise CubeInternalError(f"exact_rng: a draw of kind {kind!r} reached the runtime (check_exact refuses it)")


@contextmanager
def step(model):
    """Brackets one step of ``model``: the draws of the step, and (exact mode) the default generator
    left where the plain model leaves it."""
    st = _begin(model)
    model.__dict__["_rng_step"] = st
    try:
        yield st
    finally:
        model.__dict__["_rng_step"] = None
    if st.exact:
        with _LOCK:
            torch.default_generator.set_state(st.end)


@outside_graph   # reads the step's state and swaps generator states: never baked into a compiled graph
def call(model, index: int, box, fn, *args, **kwargs):
    """Runs the random op piece ``fn(*args, **kwargs)`` of draw ``index`` holding ``box`` (module docstring)."""
    st = model.__dict__.get("_rng_step")
    if st is None:   # the forward called outside the compiled step
        if _table(model)["exact"]:
            raise ValueError("exact_rng=True: the model's random numbers are drawn per step; run it through the "
                             "compiled step (train_iter(model, dataloader)), not model(...) on its own")
        st = StepRng(False, base=torch.initial_seed(), step=model.__dict__.get("_rng_steps", 0))
    micro = session.state_of(model).p2p.micro
    if st.exact:
        return _exact(model, st, index, box, micro, fn, args, kwargs)
    gen = _generator(model.device)
    with _LOCK:
        saved = gen.get_state()
        gen.manual_seed(seed(st.base, st.step, index, micro, box))
        try:
            return fn(*args, **kwargs)
        finally:
            gen.set_state(saved)


def seed(base: int, step: int, index: int, micro: int, box) -> int:
    """The seed of a piece in default mode: equal boxes (replicas) agree, others differ."""
    key = repr((int(base), int(step), int(index), int(micro), tuple(tuple(map(int, iv)) for iv in box)))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise ValueError(f"cube draws random numbers on cpu and cuda devices, not {device}")


def _rows(model, rows: int, micro: int, start: int, stop: int) -> torch.Tensor:
    """Rows of the global batch that rows ``[start, stop)`` of micro-batch ``micro`` are.

    A step cuts the global batch into ``interleave`` parts and micro-batch ``i`` is the ``i``-th
    slice of each part (``cube.runtime.pipeline.micro_batches``)."""
    table = _table(model)
    nmicros, parts = table["nmicros"], table["interleave"]
    per = rows // parts   # rows of one part in a micro-batch
    r = torch.arange(start, stop)
    return (r // per) * (nmicros * per) + micro * per + r % per


def _piece(model, st: StepRng, index: int, box, micro: int) -> torch.Tensor:
    kind, shape, _dtype, _p, rows, _strides, _call = _table(model)["draws"][index]
    mask = st.masks.get(index)
    if mask is None:
        raise CubeInternalError(f"draw {index} runs on this rank but was not drawn for it")
    box = list(box)[:3] + [(0, shape[3])] if kind == "sdpa" else list(box)
    if len(box) != mask.ndim:
        raise CubeInternalError(f"draw {index}: box {box} for a mask of shape {list(mask.shape)}")
    if rows is not None:   # a micro-batch's rows of the global batch's mask
        mask = mask.index_select(0, _rows(model, rows, micro, *box[0]))
        box[0] = (0, mask.shape[0])
    for dim, (start, stop) in enumerate(box):
        if (start, stop) != (0, mask.shape[dim]):
            mask = mask.narrow(dim, start, stop - start)
    return mask


def _exact(model, st: StepRng, index: int, box, micro: int, fn, args, kwargs):
    kind, _shape, dtype, p, _rows, _strides, _call = _table(model)["draws"][index]
    mask = _piece(model, st, index, box, micro)
    if kind == "rand":   # the piece's numbers are the op's output
        device = kwargs.get("device")
        return mask.to(device) if device is not None else mask.clone()
    x = args[0]
    got = (kwargs.get("dtype") or x.dtype) if kind == "values" else x.dtype
    if got != dtype:
        raise ValueError(f"exact_rng=True: a random op draws in {dtype} on one device but runs in {got} here "
                         f"(autocast?); compile without exact_rng")
    mask = mask.to(x.device)
    if kind == "values":   # the piece's part of the op's output
        return mask.clone()
    if kind == "bernoulli":   # as the CPU kernel: 1 where the uniform number is below the probability
        return (mask < x).to(x.dtype)
    if kind == "dropout":   # aten.dropout on CPU: input * (noise / (1 - p))
        return x * mask
    if kind == "native_dropout":   # input.mul(mask).mul_(scale), as native_dropout on CPU
        return x.mul(mask).mul(0.0 if p == 1 else 1.0 / (1.0 - p)), mask
    if kind == "sdpa":
        return _attention(fn, args, kwargs, mask)
    raise CubeInternalError(f"exact_rng: draw {index} of kind {kind!r}")


def _attention(fn, args, kwargs, mask: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention`` with dropout as the single device computes it on CPU (its
    math kernel: softmax weights, ``dropout``, then the product with the values), with the
    dropout's scaled mask given."""
    names = [a.name for a in fn._schema.arguments]
    a = dict(zip(names, args), **kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    attn_mask, causal, scale = a.get("attn_mask"), bool(a.get("is_causal", False)), a.get("scale")
    choice = torch._fused_sdp_choice(q, k, v, attn_mask, a["dropout_p"], causal, scale=scale)
    if choice != 0:   # 0: the math kernel, the one whose dropout cube reproduces
        raise ValueError(f"exact_rng=True: scaled_dot_product_attention with dropout runs kernel {choice} here, "
                         f"not the math kernel whose dropout cube reproduces; compile without exact_rng")
    if attn_mask is not None and attn_mask.dtype == torch.bool:   # as the op converts a boolean mask
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    _, weights = aten._scaled_dot_product_attention_math.default(q, k, v, attn_mask, 0.0, causal, scale=scale)
    return torch.matmul(weights * mask, v)
