"""A Hugging Face causal LM as a module whose forward returns the scalar loss."""
import torch


class CausalLM(torch.nn.Module):
    """Wraps a Hugging Face causal LM so forward returns the scalar loss (its names gain ``model.``)."""

    def __init__(self, hf_model):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss
