"""Wrappers that make a model's forward return its scalar loss, as ``cube.compile`` traces it."""
from __future__ import annotations

import torch


class CausalLM(torch.nn.Module):
    """A Hugging Face model whose forward computes its own loss (``labels=``: causal and masked LMs,
    encoder-decoders) as a module whose forward returns that scalar loss: ``CausalLM(hf)(input_ids,
    labels)``. Its parameters' names gain the prefix ``model.`` (``rename=lambda k: "model." + k``
    loads a Hugging Face checkpoint into it)."""

    def __init__(self, hf_model: torch.nn.Module):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss
