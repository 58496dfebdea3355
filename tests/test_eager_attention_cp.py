"""Eager attention under context parallel (``cube.ir.follow._query_rows``): scores written as
``q @ k.transpose(-1, -2)``, soft-capped (Gemma2's ``tanh``), masked by an additive causal mask and
multiplied by the values split along their query rows, the keys and values read gathered: exact
under ``strict=True``, and no split lost."""
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import cube
from cube.policies.context import PASContext
from tests.inprocess import assert_exact, parity

V, E, H, B, T = 40, 16, 2, 2, 8


class Eager(nn.Module):
    """One attention block written out: scores, soft-capping, a causal mask, softmax, values."""

    def __init__(self, softcap: float = 5.0):
        super().__init__()
        self.embed, self.qkv, self.out, self.head = nn.Embedding(V, E), nn.Linear(E, 3 * E), nn.Linear(E, E), \
            nn.Linear(E, V)
        self.softcap = softcap

    def forward(self, x, y):
        h = self.embed(x)
        q, k, v = (t.view(B, T, H, E // H).transpose(1, 2) for t in self.qkv(h).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / (E // H) ** 0.5
        scores = torch.tanh(scores / self.softcap) * self.softcap
        pos = torch.arange(T, device=x.device)
        scores = scores + torch.where(pos[None, :] > pos[:, None], float("-inf"), 0.0)
        att = F.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        h = h + self.out(att.transpose(1, 2).reshape(B, T, E))
        return F.cross_entropy(self.head(h).permute(0, 2, 1), y)


def test_eager_soft_capped_attention_splits_its_query_rows():
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen))
    policy = functools.partial(PASContext, cp=2)
    model = Eager()
    plan = cube.plan(model, batch, policy, 2)
    assert plan.lost == [], [r.describe() for r in plan.lost]
    assert_exact(parity(model, batch, policy, 2, steps=2, opt="sgd", strict=True))
