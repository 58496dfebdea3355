"""A Hugging Face causal LM as a module whose forward returns the scalar loss (``cube.CausalLM``)."""
from cube.models import CausalLM

__all__ = ["CausalLM"]
