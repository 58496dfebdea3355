"""Vector norms (``x.norm(...)``, ``torch.linalg.vector_norm``, ``aten.norm``) split like the reductions
they are: over ``dim`` (the argument after the order), every other dim free. ConvNeXt V2's global
response norm (a norm over the pixels of each sample) trains exactly with its batch split, on
micro-batches of one sample too."""
import functools

import pytest
import torch
import torch.nn as nn

import cube
from cube.policies.context import PASContext
from cube.policies.data import PASData
from cube.policies.megatron import PASMegatronTP
from cube.policies.pipeline import PAS1F1B
from tests.inprocess import assert_exact, parity


class Norms(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):   # (B, S, 8)
        h = self.a(x)
        g = torch.linalg.vector_norm(h, ord=2, dim=1, keepdim=True)   # each sample's norm over its positions
        h = h * (g / (g.mean(dim=-1, keepdim=True) + 1e-6)) + h
        h = h / (h.norm(p=3, dim=-1, keepdim=True) + 1.0)
        q = h.unflatten(-1, (4, 4))   # (B, S, 4, 4)
        h = h / (torch.ops.aten.norm(q, 2, [1], True).sum(-1).amax(-1, keepdim=True) + 1.0)
        return self.b(h).pow(2).mean()


def _sample(batch=2):
    return (torch.randn(batch, 6, 8, generator=torch.Generator().manual_seed(0)),)


def test_the_reduced_dims_are_the_ones_after_the_order():
    ops = [op for op in cube.trace_model(Norms(), _sample()).graph.ops[1:]
           if op.name in ("linalg_vector_norm", "norm")]
    reduced = [(op.name, [k for k, g in enumerate(str(op.anno).split(" -> ")[0].split()) if g.endswith("^")])
               for op in ops]
    # the norm over the positions (dim 1), over the features (dim 2); aten.norm(q, p=2, dim=[1]): dim 1 of
    # the 4-D value, not dim 2 (the order)
    assert reduced == [("linalg_vector_norm", [1]), ("linalg_vector_norm", [2]), ("norm", [1])], reduced
    for op in ops:
        ins = str(op.anno).split(" -> ")[0].split()
        assert not ins[0].endswith("^"), f"{op.name} keeps the batch whole: {op.anno}"


@pytest.mark.parametrize("policy,batch,nmicros,strict", [
    (PASData, 2, 1, True), (functools.partial(PAS1F1B, nmicros=2), 1, 2, True), (PASMegatronTP, 2, 1, False),
    (functools.partial(PASContext, cp=2), 2, 1, False)], ids=["data", "1f1b_one_sample", "tensor", "cp"])
def test_norms_train_exactly(policy, batch, nmicros, strict):
    torch.manual_seed(0)
    assert_exact(parity(Norms(), _sample(batch), policy, 2, steps=2, nmicros=nmicros, opt="sgd", strict=strict))
