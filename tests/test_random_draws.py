"""Random ops beyond dropout (``cube.passes.rng``, ``docs/random.md``): Gumbel noise
(``empty_like(h).exponential_()``, PhiMoE's router), ``rand_like``, ``randn_like``, ``uniform_``,
``normal_``, ``bernoulli`` of probabilities and of a float, ``random_``.

They split like elementwise ops (a batch, sequence or column split carries through them). Exact
mode (``exact_rng=True``) draws each op's whole output in the single device's order and a piece
keeps its part, so a plan trains exactly like the plain model: data parallel, tensor parallel and
a 2-micro-batch pipeline, two SGD steps. The whole draw is the plain op's output bit for bit on CPU,
laid out as the single device's tensor. Default mode: data-parallel ranks draw other numbers,
tensor-parallel replicas the same.
"""
from __future__ import annotations

import copy
import functools
import threading

import pytest
import torch
import torch.nn as nn

import cube
import cube.debug
from cube.runtime.rng import _draw_whole
from tests.inprocess import assert_exact, parity

SEED = 4321
aten = torch.ops.aten


class Draws(nn.Module):
    """Linear -> random ops of its output's shape (and ``randn`` of one number per sample) -> linear -> a
    random op of a replicated tensor."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)

    def forward(self, x):
        h = self.fc1(x)
        h = h - torch.empty_like(h).exponential_().log()                      # Gumbel noise
        h = h * torch.rand_like(h) + 0.1 * torch.randn_like(h)
        h = h + h.new_empty(h.shape).uniform_(-0.5, 0.5) + torch.empty_like(h).normal_(0.0, 0.1)
        h = h * torch.bernoulli(torch.full_like(h, 0.7)) * torch.empty_like(h).bernoulli_(0.8)
        h = h + torch.empty_like(h.transpose(1, 2)).exponential_(2.0).transpose(1, 2)   # drawn in another layout
        h = h + 0.01 * torch.empty_like(h).random_(5)
        h = h * (1 + torch.randn(h.shape[0], 1, 1))                           # one number per sample (creation)
        out = self.fc2(h)
        return (out * torch.rand_like(out)).pow(2).mean()


def _sample():
    torch.manual_seed(0)
    return Draws(), (torch.randn(4, 6, 16),)


@pytest.mark.parametrize("plan", ["data", "tensor", "pipeline"])
def test_exact_draws_under_every_plan(plan):
    from cube.policies.data import PASData
    from cube.policies.megatron import PASMegatronTP
    from cube.policies.pipeline import PAS1F1B
    policy, nmicros = {"data": (PASData, 1), "tensor": (PASMegatronTP, 1),
                       "pipeline": (functools.partial(PAS1F1B, nmicros=2), 2)}[plan]
    model, sample = _sample()
    assert_exact(parity(model, sample, policy, 2, steps=2, nmicros=nmicros, opt="sgd", seed=SEED,
                        exact_rng=True, strict=True))


@pytest.mark.parametrize("op,make", [
    ("exponential", lambda t: t.exponential_(1.5)),
    ("uniform", lambda t: t.uniform_(-1.0, 2.0)),
    ("normal_", lambda t: t.normal_(0.5, 2.0)),
    ("bernoulli_", lambda t: t.bernoulli_(0.3)),
    ("random", lambda t: t.random_(7)),
    ("rand_like", torch.rand_like),
    ("randn_like", torch.randn_like),
])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_whole_draw_is_the_plain_ops_output(op, make, layout):
    """``_draw_whole`` of a kind ``values`` op on an empty tensor of the single device's layout is what
    the plain op draws from the same generator state, bit for bit, and leaves the generator alike."""
    from cube.passes.rng import VALUES
    shape = (300, 70)
    like = torch.empty(shape) if layout == "contiguous" else torch.empty(shape[::-1]).t()
    strides = None if like.is_contiguous() else like.stride()
    fn, args = {"exponential": (aten.exponential.default, (("lambd", 1.5),)),
                "uniform": (aten.uniform.default, (("from", -1.0), ("to", 2.0))),
                "normal_": (aten.normal_.default, (("mean", 0.5), ("std", 2.0))),
                "bernoulli_": (aten.bernoulli_.float, (("p", 0.3),)),
                "random": (aten.random.to, (("to", 7),)),
                "rand_like": (aten.rand_like.default, ()), "randn_like": (aten.randn_like.default, ())}[op]
    assert fn in VALUES
    torch.manual_seed(7)
    plain = make(torch.empty_like(like))
    after = torch.get_rng_state()
    torch.manual_seed(7)
    whole = _draw_whole("values", shape, torch.float32, 0.0, strides, (fn, args))
    assert torch.equal(whole, plain) and torch.equal(torch.get_rng_state(), after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bernoulli_of_probabilities_is_uniform_below_p(dtype):
    """``bernoulli(p)`` on CPU keeps ``u < p`` of one uniform number per element, in memory order."""
    p = torch.rand(300, 70, generator=torch.Generator().manual_seed(1)).to(dtype)
    torch.manual_seed(7)
    plain = torch.bernoulli(p)
    torch.manual_seed(7)
    u = _draw_whole("bernoulli", tuple(p.shape), dtype, 0.0)
    assert torch.equal((u < p).to(dtype), plain)


def test_exact_refuses_a_draw_that_depends_on_values():
    class Sampled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h = self.lin(x)
            pick = torch.multinomial(h.softmax(-1), 1)
            return h.gather(-1, pick).sum()

    from cube.policies.data import PASData
    with pytest.raises(ValueError, match=r"(?s)exact_rng=True.*'multinomial'.*test_random_draws.py"):
        cube.plan(Sampled(), torch.randn(4, 8), PASData, 2, exact_rng=True)


def _drawn(policy, world: int):
    """Per rank: ``{draw index: (box, output)}`` of every random piece in one step (default mode)."""
    model, sample = _sample()
    seen = {}
    lock = threading.Lock()
    real = cube.runtime.rng.call

    def spy(gen, index, box, fn, *args, **kwargs):
        out = real(gen, index, box, fn, *args, **kwargs)
        with lock:
            seen.setdefault(cube.debug.rank(), {})[index] = (box, out.detach().clone())
        return out

    def body():
        it = iter([sample])

        @cube.compile(copy.deepcopy(model), it, PAS=policy, use_cache=False)
        def train_iter(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss
        train_iter(cube.load_model(), it)
    cube.runtime.rng.call = spy
    try:
        cube.debug.run(body, world)
    finally:
        cube.runtime.rng.call = real
    return seen


def _pieces_differ_replicas_agree(seen) -> tuple:
    """(split, replicated): how many draws ran as pieces of other boxes on the two ranks (each drew its
    own numbers), and as replicas (one box: the same numbers)."""
    split = replicated = 0
    for index, (box0, out0) in seen[0].items():
        box1, out1 = seen[1][index]
        if box0 == box1:   # a tensor whole on both ranks: one draw
            assert torch.equal(out0, out1), f"draw {index}: replicas drew other numbers"
            replicated += 1
        else:   # pieces of one tensor: independent draws
            assert out0.shape == out1.shape and not torch.equal(out0, out1), f"draw {index}: pieces repeat"
            split += 1
    return split, replicated


def test_default_mode_data_parallel_ranks_draw_other_numbers():
    """Every draw of an activation is split along the batch but ``uniform_`` of ``h.new_empty(h.shape)``
    and ``randn(batch, 1, 1)`` (they make the shape they are given, whole: both ranks draw them alike and
    take their rows)."""
    from cube.policies.data import PASData
    seen = _drawn(PASData, 2)
    assert _pieces_differ_replicas_agree(seen) == (9, 2)
    assert all(seen[0][i][0][0] != seen[1][i][0][0] for i in seen[0] if seen[0][i][0] != seen[1][i][0])


def test_default_mode_tensor_parallel_replicas_agree_pieces_differ():
    """The column-parallel linear's output splits 8 draws by columns (``new_empty``'s and ``randn``'s
    stay whole); the replicated output of the row-parallel linear draws one ``rand_like`` alike on both
    ranks."""
    from cube.policies.megatron import PASMegatronTP
    assert _pieces_differ_replicas_agree(_drawn(PASMegatronTP, 2)) == (8, 3)
