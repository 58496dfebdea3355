"""A cross entropy of logits flattened over batch and sequence keeps a sequence split
(``cube.trace.rows.unflatten_loss``), and a cross entropy of ``(batch, classes, sequence)`` logits
splits along the sequence (its rule sums those rows as it sums the batch's)."""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.context import PASContext
from tests.inprocess import parity

V, E, B, T = 40, 16, 2, 8


class LM(nn.Module):
    """A tiny language model whose loss reads its logits as ``form`` says."""

    def __init__(self, form: str, reduction: str = "mean"):
        super().__init__()
        self.form, self.reduction = form, reduction
        self.embed, self.mid, self.head = nn.Embedding(V, E), nn.Linear(E, E), nn.Linear(E, V)

    def forward(self, x, y):
        logits = self.head(torch.relu(self.mid(self.embed(x))))
        if self.form == "flat":   # torchtitan's, Hugging Face's: rows of (batch * sequence)
            return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten().to(logits.device),
                                   reduction=self.reduction)
        if self.form == "classes_first":
            return F.cross_entropy(logits.permute(0, 2, 1), y, reduction=self.reduction)
        per_token = F.cross_entropy(logits.view(-1, V), y.view(-1), reduction="none")   # "none"
        return per_token.mean()


def batch():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen)
    y[0, :3] = -100   # ignored targets: the mean divides by the valid ones of the whole batch
    return x, y


def _losses(graph):
    return [op for op in graph.ops if getattr(op, "name", "") == "cross_entropy_loss"]


def test_flat_loss_is_computed_on_batch_classes_sequence():
    torch.manual_seed(0)
    graph = cube.trace_model(LM("flat"), batch()).graph
    (loss,) = _losses(graph)
    assert loss.inputs[0].shape == (B, V, T) and loss.inputs[1].shape == (B, T)
    assert not [op for op in graph.ops if op.name in ("view", "flatten", "reshape", "_unsafe_view")]


def test_per_token_loss_keeps_its_rows():
    torch.manual_seed(0)
    graph = cube.trace_model(LM("none"), batch()).graph
    (loss,) = _losses(graph)
    assert loss.inputs[0].shape == (B * T, V)


@pytest.mark.parametrize("form,reduction", [("flat", "mean"), ("flat", "sum"), ("classes_first", "mean")])
def test_loss_stays_sequence_split_under_context_parallel(form, reduction):
    """Exact against the plain model, and no op runs whole: strict=True refuses a lost split (the
    classes-first loss was an internal error before its rule summed the sequence rows)."""
    torch.manual_seed(0)
    model = LM(form, reduction)
    policy = functools.partial(PASContext, cp=2)
    plan = cube.plan(model, batch(), policy, 2, strict=True)
    for op in _losses(plan.graph):
        assert op.splits and op.splits[0][2] == 2   # each rank's block of the sequence
    for r in range(2):
        assert "all_gather(" not in plan.source(r) and "all_to_all(" not in plan.source(r)
    errors = parity(model, batch(), policy, 2, steps=2, opt="sgd", strict=True)
    assert max(max(e) for e in errors) <= 1e-5, errors
