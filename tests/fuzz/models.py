"""The models the plan fuzzer draws from: small configs, built locally (no downloads).

``mlp``, ``gpt_nobias`` and ``hf_llama`` come from ``tests.models``; ``hf_t5`` and
``hf_bart`` too when it has them (else ``hf_t5`` is the same tiny T5 defined here,
and ``hf_bart`` is left out).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from tests import models as shared

MODELS = ["mlp", "gpt_nobias", "hf_llama", "hf_t5"] + (["hf_bart"] if hasattr(shared, "hf_bart") else [])


class Seq2SeqLoss(nn.Module):
    """Wraps a Hugging Face encoder-decoder so forward returns the scalar loss."""

    def __init__(self, hf_model):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def _tiny_t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                   num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
                   pad_token_id=0, eos_token_id=1, attn_implementation="eager")
    return Seq2SeqLoss(T5ForConditionalGeneration(cfg))


def build(name: str):
    """Returns (model, sample batch) for one of ``MODELS`` (seeded: the same values each call).

    Raises:
        KeyError: an unknown model name.
    """
    try:
        return shared.build(name)
    except KeyError:
        if name != "hf_t5":
            raise
    torch.manual_seed(0)   # the same draws as tests.models' hf_t5: a seed's plan is the same either way
    model = _tiny_t5()
    ids = torch.randint(0, 128, (4, 16))
    return model, (ids, torch.randint(0, 128, (4, 16)))
