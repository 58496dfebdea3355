"""Exact resume: a run stopped after step k and resumed from its checkpoint in fresh objects ends
bit-identical to an uninterrupted run (losses and every parameter piece), with dropout on and a
shuffling loader.

The model is Hugging Face GPT-2 as shipped (dropout 0.1 on embeddings, attention and residuals);
the data a ``cube.runtime.data.ShuffledBatches`` over a small token set, reshuffled every epoch (the
run crosses an epoch). Each run is a ``cube.debug.run`` world of fresh compiled steps, models,
optimizers and loaders; the resumed one seeds torch with another seed before it compiles, so only
the checkpoint's generator states can give it the uninterrupted run's masks. A data, a tensor and a
pipeline plan, in cube's default random mode (masks keyed by the seed and cube's step count) and,
for the data plan, under ``exact_rng=True`` (the single device's masks, from torch's generator).
The unit tests check the loader's state around compile's first read and the errors.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch

import cube
import cube.debug
from cube.runtime.data import ShuffledBatches
from tests.parity import compile_step
from tests.zoo import PARAM_FLOOR, PLANS, S, V

transformers = pytest.importorskip("transformers")
SEED, STEPS, STOP = 1234, 4, 2
SAMPLES = 12   # with a global batch of 4 an epoch is 3 steps: the resumed run crosses into epoch 1


def _gpt2():
    from tests.zoo import LM
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    assert cfg.resid_pdrop == cfg.attn_pdrop == cfg.embd_pdrop == 0.1   # as shipped
    ids = torch.randint(0, V, (SAMPLES, S), generator=torch.Generator().manual_seed(1))
    return LM(transformers.GPT2LMHeadModel(cfg)), (ids, ids.clone())


def _pieces(gen) -> dict:
    return {local: p.detach().clone() for local, p in gen.named_parameters()}


def _run(model, data, plan, cache, steps, seed, save=None, load=None, loader_state=True, world=None, sgd=False,
         **kw):
    """One world of the plan (``world`` ranks: the plan's by default): ``steps`` steps from the start or
    from ``load``; per rank (losses, pieces)."""
    p = PLANS[plan]
    if world is not None:
        p = dataclasses.replace(p, world=world)

    def body():
        loader = ShuffledBatches(data, p.micro * p.nmicros, seed=7)
        torch.manual_seed(seed)

        @cube.compile(copy.deepcopy(model), loader, PAS=p.make(), cache_dir=cache, **kw)
        def step(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        opt = torch.optim.SGD(gen.parameters(), lr=0.1) if sgd else torch.optim.AdamW(gen.parameters(), lr=1e-3)
        start = 0
        if load is not None:
            start = cube.load_checkpoint(load, gen, opt, dataloader=loader if loader_state else None)["step"]
        losses = []
        for i in range(start, start + steps):
            losses.append(step(gen, loader).detach())
            opt.step()
            opt.zero_grad()
            if save is not None and i + 1 == STOP:
                cube.save_checkpoint(save, gen, opt, extra={"step": i + 1}, dataloader=loader)
        return losses, _pieces(gen)
    return cube.debug.run(body, p.world)


def _resume(plan, tmp_path, **kw):
    model, data = _gpt2()
    cache = tmp_path / "cache"
    plain = _run(model, data, plan, cache, STEPS, SEED, **kw)
    first = _run(model, data, plan, cache, STOP, SEED, save=tmp_path / "ckpt", **kw)
    resumed = _run(model, data, plan, cache, STEPS - STOP, 999, load=tmp_path / "ckpt", **kw)
    return model, data, cache, plain, first, resumed


def _assert_identical(plain, first, resumed):
    for rank, ((losses, pieces), (head, _), (tail, got)) in enumerate(zip(plain, first, resumed)):
        assert [x.item() for x in head + tail] == [x.item() for x in losses], (rank, head + tail, losses)
        for local, p in pieces.items():
            assert torch.equal(got[local], p), (rank, local, (got[local] - p).abs().max())


@pytest.mark.multirank
@pytest.mark.parametrize("plan", ["data", "tensor", "pipeline"])
def test_resume_is_bit_identical(plan, tmp_path):
    _, _, _, plain, first, resumed = _resume(plan, tmp_path)
    _assert_identical(plain, first, resumed)
    losses = [x.item() for x in plain[0][0]]
    assert len(set(losses)) == len(losses)


@pytest.mark.multirank
def test_resume_is_bit_identical_with_exact_rng(tmp_path):
    _, _, _, plain, first, resumed = _resume("data", tmp_path, exact_rng=True)
    _assert_identical(plain, first, resumed)


@pytest.mark.multirank
def test_elastic_resume_from_4_to_2_ranks(tmp_path):
    """A job restarted on fewer ranks plans for them and continues from the checkpoint (resharded):
    under ``exact_rng`` the masks are the single device's whatever the world, so with dropout on the
    run stays within round-off of the uninterrupted 4-rank run (other summation orders; SGD, as the
    parity tests: AdamW magnifies the round-off of gradients far below its eps)."""
    model, data = _gpt2()
    cache = tmp_path / "cache"
    kw = dict(exact_rng=True, sgd=True)
    plain = _run(model, data, "data", cache, STEPS, SEED, world=4, **kw)
    _run(model, data, "data", cache, STOP, SEED, save=tmp_path / "ckpt", world=4, **kw)
    resumed = _run(model, data, "data", cache, STEPS - STOP, 999, load=tmp_path / "ckpt", world=2, **kw)
    for (tail, got) in resumed:
        for a, b in zip(tail, plain[0][0][STOP:]):
            assert abs(a.item() - b.item()) <= 1e-5 * abs(b.item()), (tail, plain[0][0])
        for local, p in plain[0][1].items():   # data parallel: every rank holds every parameter whole
            # (a bias whose gradient is zero by construction holds only round-off: PARAM_FLOOR)
            assert (got[local] - p).norm() <= 1e-5 * max(p.norm(), PARAM_FLOOR * p.numel() ** 0.5), local


@pytest.mark.multirank
def test_without_the_loader_state_the_resume_differs(tmp_path):
    """The check above can fail: resumed without the loader's position, the batches (so the losses) differ."""
    model, data, cache, plain, first, _ = _resume("data", tmp_path)
    other = _run(model, data, "data", cache, STEPS - STOP, 999, load=tmp_path / "ckpt", loader_state=False)
    assert other[0][0][0].item() != plain[0][0][STOP].item()


# ---------------------------------------------------------------------- one process
class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(torch.nn.functional.dropout(self.fc(x), 0.5), y)


def _single(tmp_path):
    from cube.policies.single import PASSingle
    torch.manual_seed(0)
    model = _Linear()
    data = (torch.randn(10, 4), torch.randn(10, 4))
    loader = ShuffledBatches(data, 2, seed=3)
    step = compile_step(model, loader, PASSingle, tmp_path / "cache")
    gen = cube.load_model()
    return step, gen, loader, data


def test_a_save_before_the_first_step_resumes_at_the_first_batch(tmp_path):
    """compile read batch 0 to trace; a save before step 1 records the loader before that read."""
    step, gen, loader, data = _single(tmp_path)
    assert loader.state_dict()["index"] == 2   # compile's read
    cube.save_checkpoint(tmp_path / "ckpt", gen, dataloader=loader)
    fresh = ShuffledBatches(data, 2, seed=3)
    next(fresh), next(fresh)
    cube.load_checkpoint(tmp_path / "ckpt", gen, dataloader=fresh)
    assert fresh.state_dict()["index"] == 0
    assert torch.equal(next(fresh)[0], next(ShuffledBatches(data, 2, seed=3))[0])


def test_restored_loader_drops_compiles_batch(tmp_path):
    """Loading into the loader compile read from: the step's next batch follows the saved position."""
    step, gen, loader, data = _single(tmp_path)
    for _ in range(3):
        step(gen, loader)
    cube.save_checkpoint(tmp_path / "ckpt", gen, dataloader=loader)   # after 3 batches
    ref = ShuffledBatches(data, 2, seed=3)
    for _ in range(3):
        next(ref)
    want = next(ref)

    seen = []
    step2 = compile_step(_Linear(), _Spy(ShuffledBatches(data, 2, seed=3), seen), _policy(), tmp_path / "cache")
    gen2 = cube.load_model()
    spy = step2.batches.source
    cube.load_checkpoint(tmp_path / "ckpt", gen2, dataloader=spy)
    seen.clear()
    step2(gen2, spy)
    assert len(seen) == 1 and torch.equal(seen[0][0], want[0])


def _policy():
    from cube.policies.single import PASSingle
    return PASSingle


class _Spy:
    """A stateful loader that records what it hands out."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.inner)
        self.seen.append(b)
        return b

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


def test_generators_and_step_count_are_restored(tmp_path):
    import random
    step, gen, loader, _ = _single(tmp_path)
    step(gen, loader)
    torch.manual_seed(5)
    random.seed(5)
    cube.save_checkpoint(tmp_path / "ckpt", gen)
    want = (torch.rand(3), random.random(), gen.__dict__["_rng_steps"])
    torch.manual_seed(6)
    random.seed(6)
    gen.__dict__["_rng_steps"] = 0
    cube.load_checkpoint(tmp_path / "ckpt", gen)
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]
    assert gen.__dict__["_rng_steps"] == want[2] == 1


def test_loader_errors(tmp_path):
    step, gen, loader, data = _single(tmp_path)
    with pytest.raises(TypeError, match="state_dict\\(\\) and load_state_dict\\(\\)"):
        cube.save_checkpoint(tmp_path / "a", gen, dataloader=iter([1, 2]))
    cube.save_checkpoint(tmp_path / "a", gen)
    with pytest.raises(ValueError, match="holds no data loader state"):
        cube.load_checkpoint(tmp_path / "a", gen, dataloader=loader)
    with pytest.raises(ValueError, match="plain Python values"):
        cube.save_checkpoint(tmp_path / "b", gen, extra={"f": functools.partial(print)})
    cube.save_checkpoint(tmp_path / "c", gen, dataloader=loader)
    with pytest.raises(ValueError, match="build the loader as the saved run did"):
        cube.load_checkpoint(tmp_path / "c", gen, dataloader=ShuffledBatches(data, 5, seed=3))


def test_shuffled_batches_reshuffle_every_epoch():
    x = torch.arange(6)
    loader = ShuffledBatches(x, 3, seed=0)
    e0 = torch.cat([next(loader), next(loader)])
    e1 = torch.cat([next(loader), next(loader)])
    assert sorted(e0.tolist()) == sorted(e1.tolist()) == list(range(6)) and not torch.equal(e0, e1)
    assert loader.state_dict()["epoch"] == 1
    with pytest.raises(ValueError, match="batch_size"):
        ShuffledBatches(x, 7)


def test_a_rank_that_read_no_batches_takes_a_reading_ranks_loader_state():
    """A middle pipeline stage never takes a batch: its loader's saved state is not the run's."""
    from cube.runtime import resume
    records = [{"data": {"state": {"epoch": 0, "index": 6}, "reads": True}},
               {"data": {"state": {"epoch": 0, "index": 2}, "reads": False}},
               {"data": {"state": {"epoch": 0, "index": 6}, "reads": True}}]
    got = []

    class Loader:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            got.append(state["index"])
    for rank, same in ((1, True), (2, True), (0, False), (3, False)):
        resume.restore_loader(Loader(), records, rank, same, "ckpt")
    assert got == [6, 6, 6, 6]


@pytest.mark.multirank
def test_resume_with_torchdatas_stateful_dataloader(tmp_path):
    """torchdata's StatefulDataLoader, shuffling with its own generator: the step is given an iterator
    of it (``iter(loader)``); after ``load_checkpoint(..., dataloader=loader)`` a new ``iter(loader)``
    continues where the saved run was, and the run ends bit-identical."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    model, (ids, labels) = _gpt2()
    data = torch.utils.data.TensorDataset(torch.cat([ids, ids.flip(0)]), torch.cat([labels, labels.flip(0)]))
    p = PLANS["data"]

    def run(steps, seed, save=None, load=None):
        def body():
            loader = stateful.StatefulDataLoader(data, batch_size=p.micro, shuffle=True,
                                                 generator=torch.Generator().manual_seed(seed))
            it = iter(loader)
            torch.manual_seed(seed)

            @cube.compile(copy.deepcopy(model), it, PAS=p.make(), cache_dir=tmp_path / "cache")
            def step(model, dataloader):
                loss = model(*next(dataloader))
                loss.backward()
                return loss
            gen = cube.load_model()
            opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
            if load is not None:
                cube.load_checkpoint(load, gen, opt, dataloader=loader)
                it = iter(loader)   # StatefulDataLoader resumes in its next iterator
            losses = []
            for i in range(steps):
                losses.append(step(gen, it).detach())
                opt.step()
                opt.zero_grad()
                if save is not None and i + 1 == STOP:
                    cube.save_checkpoint(save, gen, opt, dataloader=loader)
            return losses, _pieces(gen)
        return cube.debug.run(body, p.world)
    plain = run(STEPS, SEED)
    first = run(STOP, SEED, save=tmp_path / "ckpt")
    resumed = run(STEPS - STOP, 999, load=tmp_path / "ckpt")
    _assert_identical(plain, first, resumed)
