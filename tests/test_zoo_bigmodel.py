"""The big-model recipe on Hugging Face decoders as shipped (``use_cache`` on): built on the meta
device, ``cube.load_model(init=model._init_weights)``, tensor parallel 2 x pipeline 2 with two
micro-batches of one sample each, four in-process ranks.

The reference is the single-device procedure from the same seed (``to_empty``, ``apply(init)``),
trained on the same global batches with SGD; every rank's pieces equal it right after loading, and
the losses, the first step's gradients and the parameters after the steps within 1e-5.
"""
import functools
import tempfile

import pytest
import torch

import cube
import cube.debug
from cube.runtime import piece
from cube.policies.megatron3d import PASMegatron
from tests import zoo
from tests.tiers import tiered
from tests.workers.bigmodel_worker import single_device

SEED, STEPS, LR = 7, 2, 1e-2
PLAN = functools.partial(PASMegatron, tp=2, pp=2, nmicros=2)


def _meta(name: str):
    with torch.device("meta"):
        return zoo._TEXT[name]()


def _batches(nmicros: int = 2, micro: int = 1):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, zoo.V, (nmicros * micro, zoo.S), generator=gen)
        out.append((ids, ids.clone()))
    return out


def _reference(name: str) -> dict:
    return single_device(_meta(name), _batches(), lambda p: torch.optim.SGD(p, lr=LR), SEED)


def _err(a, b) -> float:   # tests.inprocess.parity's floor: a bias initialized to zero holds round-off
    return (a.detach().double() - b.double()).norm().item() / max(b.double().norm().item(),
                                                                   zoo.PARAM_FLOOR * b.numel() ** 0.5)


def _rank(name: str, ref: dict, cache: str) -> dict:
    model = _meta(name)
    loader = iter(_batches())

    @cube.compile(model, loader, PAS=PLAN, cache_dir=cache)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss

    torch.manual_seed(SEED)
    gen = cube.load_model(init=model.model._init_weights)
    tables = {**gen.PARAMS, **gen.BUFFERS}
    unequal = [tables[k][0][0] for k, t in list(gen.named_parameters()) + list(gen.named_buffers())
               if not torch.equal(t, piece(ref["initial"][tables[k][0][0]], tables[k][1]))]
    opt = torch.optim.SGD(gen.parameters(), lr=LR)
    losses, grad_err = [], 0.0
    for i in range(STEPS):
        losses.append(train_iter(gen, loader).item())
        if i == 0:
            for k, p in gen.named_parameters():
                names, splits = gen.PARAMS[k]
                grad_err = max(grad_err, _err(p.grad, piece(ref["grads"][names[0]], splits)))
        opt.step()
        opt.zero_grad()
    param_err = max(_err(p, piece(ref["final"][gen.PARAMS[k][0][0]], gen.PARAMS[k][1]))
                    for k, p in gen.named_parameters())
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    return {"unequal": unequal, "loss_err": loss_err, "grad_err": grad_err, "param_err": param_err,
            "meta": all(t.is_meta for t in model.parameters())}


# llama in the default tier; the other families (same build path, their own attention variants and
# the ops test_zoo.py's plans already cover) in the slow one
@pytest.mark.parametrize("name", tiered([("llama",), ("mistral",), ("qwen2",), ("qwen3",)],
                                        ["llama", "mistral", "qwen2", "qwen3"], slow={"mistral", "qwen2", "qwen3"}))
def test_meta_build_tp2_pp2_one_sample_micro_batches_is_exact(name):
    assert _meta(name).model.config.use_cache   # as shipped
    ref = _reference(name)
    results = cube.debug.run(lambda: _rank(name, ref, tempfile.mkdtemp(prefix="cube-zoo-big-")), 4)
    for r in results:
        assert r["unequal"] == [] and r["meta"], r
        assert r["loss_err"] <= 1e-5 and r["grad_err"] <= 1e-5 and r["param_err"] <= 1e-5, r
