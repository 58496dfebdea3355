"""Batches of several shapes (``cube.compile(max_shapes=)``): dynamic padding to a few lengths and the
short last batch of an epoch. Each new shape compiles one more plan over the same parameters; every
step equals the plain model's on the same batch (loss and every parameter piece after SGD)."""
import logging

import pytest
import torch

import cube
from tests import zoo
from tests.inprocess import assert_exact, parity

# sequence lengths 16, 12 and 8 (padded buckets), then the epoch's short last batch
SHAPES = [(4, 16), (4, 12), (4, 16), (4, 8), (4, 12), (2, 12)]


def _batches(shapes):
    gen = torch.Generator().manual_seed(3)
    out = []
    for b, s in shapes:
        ids = torch.randint(0, zoo.V, (b, s), generator=gen)
        out.append((ids, ids.clone()))
    return out


def _run(model, batches, policy, world, caplog, **kw):
    """Per rank (loss error, parameter error) of one step per batch, and the plans compiled (rank 0's log)."""
    with caplog.at_level(logging.INFO, logger="cube"):
        errors = parity(model, batches[0], policy, world, steps=len(batches), batches=batches, opt="sgd",
                        param_floor=zoo.PARAM_FLOOR, **kw)
    return errors, 1 + sum("batch shapes" in r.getMessage() for r in caplog.records)


def _zero_sgd(gen):
    return cube.build_optimizer(gen, torch.optim.SGD, lr=1e-2)


@pytest.mark.parametrize("policy,world,options,kw", [
    ("cube.policies.data:PASData", 2, {}, {}),
    ("cube.policies.pipeline:PAS1F1B", 2, {"nmicros": 2}, {}),
    ("cube.policies.megatron:PASMegatronTP", 2, {"recompute": True}, {}),
    ("cube.policies.data:PASData", 2, None, {"zero": 2, "build": _zero_sgd}),
], ids=["data", "pipeline", "tensor-recompute", "data-zero2"])
def test_three_lengths_and_a_short_last_batch_train_exactly(policy, world, options, kw, caplog):
    model, _ = zoo.build("gpt2")
    errors, plans = _run(model, _batches(SHAPES), policy, world, caplog, options=options, max_shapes=4, **kw)
    assert plans == 4, plans   # (4, 16), (4, 12), (4, 8), (2, 12)
    assert_exact(errors)


def test_a_shape_past_max_shapes_is_refused_naming_the_fix(caplog):
    model, _ = zoo.build("gpt2")
    with pytest.raises(RuntimeError, match=r"new shape after 2 \(max_shapes=2\).*bucketing"):
        _run(model, _batches([(4, 16), (4, 12), (4, 8)]), "cube.policies.single:PASSingle", 1, caplog, max_shapes=2)


def test_max_shapes_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="max_shapes must be a positive integer"):
        cube.compile(torch.nn.Linear(2, 2), iter([torch.zeros(1, 2)]), PAS="cube.policies.single:PASSingle",
                     max_shapes=0)
