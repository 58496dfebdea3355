"""Megatron's vocabulary parallelism (issue 18): the LM head, its cross entropy and the input
embedding split over the vocabulary across tensor-parallel ranks.

``cross_entropy_loss`` splits its classes (``c~``) and ``embedding`` its table's rows (``v~``), each
piece communicating inside its call (``cube.runtime.vocab``); ``PASMegatron`` (``vocab_parallel``,
on by default) keeps the logits split from the LM head to the loss. The runtime functions equal
torch's (every reduction, ignore_index, label smoothing, a padding row); the plans train exactly
like the single-device model (losses and updated parameters, rel <= 1e-5, SGD and AdamW): GPT with
its tied LM head and untied, tp2, tp2 x dp2 and tp2 x pp2, with ignored targets in the batch and made
in forward, sequence parallel, Hugging Face Llama tp2.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
import cube.debug
from cube.runtime import vocab
from cube.policies.megatron3d import PASMegatron
from tests.inprocess import assert_exact, parity
from tests.models import build
from tests.parity import global_batches, rel


# ------------------------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("shape,reduction,smoothing,dtype", [
    ((12, 10), 1, 0.0, torch.float32), ((12, 10), 2, 0.1, torch.float32), ((12, 10), 0, 0.0, torch.float32),
    ((3, 10, 4), 1, 0.2, torch.float32), ((3, 10, 4), 0, 0.1, torch.float32), ((12, 10), 1, 0.1, torch.float64),
])
def test_vocab_cross_entropy_equals_torch(shape, reduction, smoothing, dtype):
    """Two ranks, five classes each: the loss and the logits' gradient, put together, equal
    ``F.cross_entropy`` on the whole logits (a quarter of the targets ignored); float64 logits to float64's
    precision (the statistics are float32 at least, not at most)."""
    torch.manual_seed(0)
    n, classes = 2, shape[1]
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    logits = torch.randn(shape, dtype=dtype, requires_grad=True)
    target = torch.randint(0, classes, shape[:1] + shape[2:])
    target[torch.rand(target.shape) < 0.25] = -100
    name = {0: "none", 1: "mean", 2: "sum"}[reduction]
    want = F.cross_entropy(logits, target, reduction=name, label_smoothing=smoothing)
    grad_out = torch.randn(want.shape, dtype=dtype)
    want_grad, = torch.autograd.grad(want, logits, grad_out)

    def body():
        r = cube.debug.rank()
        x = logits.detach().chunk(n, dim=1)[r].clone().requires_grad_()
        out = vocab.cross_entropy(x, target, None, reduction, -100, smoothing, ranks=tuple(range(n)),
                                  start=r * classes // n, classes=classes)
        return out.detach(), torch.autograd.grad(out, x, grad_out)[0]
    got = cube.debug.run(body, n)
    for loss, _ in got:
        assert loss.dtype == dtype and rel(loss, want) <= tol, (loss.dtype, rel(loss, want))
    assert rel(torch.cat([g for _, g in got], dim=1), want_grad) <= tol


def test_vocab_embedding_equals_torch():
    """Each rank its half of the rows (the padding row on rank 1): the output on every rank and the
    table's gradient, put together, equal ``F.embedding`` on the whole table."""
    torch.manual_seed(0)
    table = torch.randn(8, 3, requires_grad=True)
    ids = torch.tensor([[0, 5, 7, 5], [3, 4, 1, 6]])
    want = F.embedding(ids, table, padding_idx=5)
    grad_out = torch.randn(want.shape)
    want_grad, = torch.autograd.grad(want, table, grad_out)

    def body():
        r = cube.debug.rank()
        w = table.detach().chunk(2)[r].clone().requires_grad_()
        out = vocab.embedding(w, ids, 5, ranks=(0, 1), start=4 * r)
        return out.detach(), torch.autograd.grad(out, w, grad_out)[0]
    got = cube.debug.run(body, 2)
    assert all(rel(out, want) <= 1e-7 for out, _ in got)
    assert rel(torch.cat([g for _, g in got]), want_grad) <= 1e-7


# ---------------------------------------------------------------------------------------------- plan
def test_megatron_splits_the_vocabulary():
    """Under PASMegatron tp2 every rank holds half of the tied table, looks its ids up with the
    vocabulary-parallel embedding and computes the loss on its half of the logits (nothing gathered);
    each piece all-reduces b*s*h floats (the lookup) or 3 floats per row (the loss) in forward only."""
    model, sample = build("gpt_nobias")
    cfg, (B, T) = model.config, sample[0].shape
    plan = cube.plan(model, sample, functools.partial(PASMegatron, tp=2, pp=1, nmicros=1), 2)
    for r in range(2):
        src = plan.source(r)
        assert "runtime.vocab.embedding(self.wte_weight, idx, ranks=(0, 1)" in src
        assert "runtime.vocab.cross_entropy(" in src and "all_gather(" not in src
        assert f"'wte_weight': (['wte.weight', 'lm_head.weight'], [(0, {64 * r}, {64 * (r + 1)})])" in src
        inside = {c.op.name: c.inside for c in plan.program[r].plan.calls if c.inside is not None}
        assert inside["embedding"].all_reduce == B * T * cfg.n_embd * 4 and inside["embedding"].bw_all_reduce == 0
        assert inside["cross_entropy_loss"].all_reduce == B * T * 3 * 4 and inside["cross_entropy_loss"].counts
    whole = cube.plan(model, sample, functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, vocab_parallel=False), 2)
    assert "runtime.vocab" not in whole.source(0) and "torch.empty((128, 32)" in whole.source(0)


def test_class_weights_keep_the_classes_whole():
    """A cross entropy with class weights cannot split its classes: the annotation freezes them, the
    LM head stays whole, and splitting them by hand is a ValueError naming the op."""
    class Weighted(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 16, bias=False)
            self.register_buffer("w", torch.rand(16))

        def forward(self, x, y):
            return F.cross_entropy(self.head(x), y, weight=self.w)
    model, sample = Weighted(), (torch.randn(4, 8), torch.randint(0, 16, (4,)))
    assert "runtime.vocab" not in cube.plan(model, sample, functools.partial(PASMegatron, tp=2, pp=1, nmicros=1),
                                            2).source(0)
    graph = cube.trace_model(model, sample).graph
    loss = graph.select(name="cross_entropy_loss")[0]
    with pytest.raises(ValueError, match=r"cross_entropy_loss.*test_vocab_parallel.py:\d+.*may not be split"):
        graph.partition(loss, "c", num=2)


def test_simulator_counts_the_forward_all_reduces():
    from cube.sim.api import simulate_policy
    from cube.sim.comm import CommModel, default_backend
    from cube.sim.costs import Estimator
    model, sample = build("gpt_nobias")
    res = simulate_policy(model, sample, functools.partial(PASMegatron, tp=2, pp=1, nmicros=1), 2,
                          costs=Estimator(), comm=CommModel(default_backend()))
    assert res.step_time > 0


# -------------------------------------------------------------------------------------------- parity
def _untied(model):
    model.lm_head.weight = nn.Parameter(model.wte.weight.detach().clone())
    return model


class MaskedTargets(nn.Module):
    """GPT whose targets below 40 are ignored, the mask made in forward (so the valid targets of a
    batch piece are summed over the data parallel ranks, not counted on the batch)."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, idx, targets):
        return self.gpt(idx, targets.masked_fill(targets < 40, -100))


def _ignoring(sample, steps, nmicros):
    """Global batches whose targets are a third ignored (-100), in the batch itself."""
    out = []
    for i, (idx, tgt) in enumerate(global_batches(sample, steps, nmicros)):
        gen = torch.Generator().manual_seed(i)
        out.append((idx, tgt.masked_fill(torch.rand(tgt.shape, generator=gen) < 1 / 3, -100)))
    return out


@pytest.mark.parametrize("model_of,tp,pp,world,opt,data", [
    ("tied", 2, 1, 2, "sgd", None),
    ("tied", 2, 2, 4, "adamw", None),
    ("untied", 2, 1, 4, "adamw", None),
    ("untied", 2, 2, 4, "sgd", None),
    ("tied", 2, 1, 4, "adamw", "ignore"),
    ("untied", 2, 2, 4, "adamw", "ignore"),
    ("masked", 2, 1, 4, "sgd", None),
], ids=["tied-tp2", "tied-tp2xpp2", "untied-tp2xdp2", "untied-tp2xpp2", "ignore-tp2xdp2", "ignore-tp2xpp2",
        "masked-tp2xdp2"])
def test_gpt_trains_like_eager(model_of, tp, pp, world, opt, data):
    model, sample = build("gpt_nobias")
    model = {"tied": lambda m: m, "untied": _untied, "masked": MaskedTargets}[model_of](model)
    nmicros = 2 if pp > 1 else 1
    policy = functools.partial(PASMegatron, tp=tp, pp=pp, nmicros=nmicros)
    batches = _ignoring(sample, 2, nmicros) if data == "ignore" else None
    assert_exact(parity(model, sample, policy, world, steps=2, nmicros=nmicros, opt=opt, batches=batches), 1e-5)


def test_sequence_parallel_with_the_vocabulary_split():
    """Sequence parallel still splits the ops between the regions, the first layer's too (the lookup's
    whole output is cut into sequence pieces locally)."""
    model, sample = build("gpt_nobias")
    policy = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1, sp=True)
    src = cube.plan(model, sample, policy, 2).source(0)
    assert "runtime.vocab.embedding(" in src and "reduce_scatter(" in src
    assert_exact(parity(model, sample, policy, 2, steps=2, opt="adamw"), 1e-5)


def test_hf_llama_trains_like_eager():
    """Hugging Face Llama: untied embedding and LM head, float32 upcast of the logits and its shifted
    labels (ignore_index) before the loss."""
    pytest.importorskip("transformers")
    model, sample = build("hf_llama")
    policy = functools.partial(PASMegatron, tp=2, pp=1, nmicros=1)
    src = cube.plan(copy.deepcopy(model), sample, policy, 2).source(1)
    assert "runtime.vocab.embedding(" in src and "runtime.vocab.cross_entropy(" in src
    assert_exact(parity(model, sample, policy, 2, steps=2, opt="adamw"), 1e-5)
