"""Batches of several shapes (``cube.compile(max_shapes=)``): dynamic padding to a few lengths and the
short last batch of an epoch. Each new shape compiles one more plan over the same parameters; every
step equals the plain model's on the same batch (loss and every parameter piece after SGD)."""
import copy
import tempfile

import pytest
import torch

import cube
import cube.debug
from tests import zoo
from tests.inprocess import eager_reference, optimizer
from tests.parity import rel

# sequence lengths 16, 12 and 8 (padded buckets), then the epoch's short last batch
SHAPES = [(4, 16), (4, 12), (4, 16), (4, 8), (4, 12), (2, 12)]


def _batches(shapes):
    gen = torch.Generator().manual_seed(3)
    out = []
    for b, s in shapes:
        ids = torch.randint(0, zoo.V, (b, s), generator=gen)
        out.append((ids, ids.clone()))
    return out


def _run(model, batches, policy, world, build=None, **compile_kw):
    """Per rank: (loss error, parameter error, plans compiled) of training on ``batches`` one step each."""
    make = optimizer("sgd")
    ref_losses, ref_params = eager_reference(model, batches, make)
    cache = tempfile.mkdtemp(prefix="cube-shapes-")

    def body():
        it = iter(batches)

        @cube.compile(copy.deepcopy(model), it, PAS=policy, cache_dir=cache, **compile_kw)
        def train_iter(model, dataloader):
            data = next(dataloader)
            loss = model(*data)
            loss.backward()
            return loss
        gen = cube.load_model()
        opt = build(gen) if build is not None else make(gen.parameters())
        losses = []
        for _ in batches:
            losses.append(train_iter(gen, it).detach())
            opt.step()
            opt.zero_grad()
        loss_err = max(rel(a, b) for a, b in zip(losses, ref_losses))
        param_err = 0.0
        for n, p in gen.named_parameters():
            ref = cube.runtime.piece(ref_params[gen.PARAMS[n][0][0]], gen.PARAMS[n][1]).detach().double()
            # against at least zoo.PARAM_FLOOR: a bias initialized to zero whose gradient is zero by construction
            floor = max(ref.norm().item(), zoo.PARAM_FLOOR * ref.numel() ** 0.5)
            param_err = max(param_err, (p.detach().double() - ref).norm().item() / floor)
        return loss_err, param_err, 1 + len(train_iter._others)
    return cube.debug.run(body, world)


def _zero_sgd(gen):
    return cube.build_optimizer(gen, torch.optim.SGD, lr=1e-2)


@pytest.mark.parametrize("policy,world,options,kw", [
    ("policies.data:PASData", 2, {}, {}),
    ("policies.pipeline:PAS1F1B", 2, {"nmicros": 2}, {}),
    ("policies.megatron:PASMegatronTP", 2, {"recompute": True}, {}),
    ("policies.data:PASData", 2, {}, {"zero": 2, "build": _zero_sgd}),
], ids=["data", "pipeline", "tensor-recompute", "data-zero2"])
def test_three_lengths_and_a_short_last_batch_train_exactly(policy, world, options, kw):
    model, _ = zoo.build("gpt2")
    results = _run(model, _batches(SHAPES), policy, world, options=options, max_shapes=4, **kw)
    for loss_err, param_err, plans in results:
        assert plans == 4, results   # (4, 16), (4, 12), (4, 8), (2, 12)
        assert loss_err <= 1e-5 and param_err <= 1e-5, results


def test_a_shape_past_max_shapes_is_refused_naming_the_fix():
    model, _ = zoo.build("gpt2")
    with pytest.raises(RuntimeError, match=r"new shape after 2 \(max_shapes=2\).*bucketing"):
        _run(model, _batches([(4, 16), (4, 12), (4, 8)]), "policies.single:PASSingle", 1, max_shapes=2)


def test_max_shapes_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="max_shapes must be a positive integer"):
        cube.compile(torch.nn.Linear(2, 2), iter([torch.zeros(1, 2)]), PAS="policies.single:PASSingle",
                     max_shapes=0)
