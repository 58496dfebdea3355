"""A 7B-parameter Llama (Hugging Face's ``LlamaForCausalLM`` with Llama-2-7B's shape) on the meta
device and one global batch, for the cluster simulator and search:

    python -m cube.sim benchmarks/llama7b.py --hardware dgx-a100-80g --ngpus 64 --search

The global batch is 512 sequences of 2048 tokens (1M tokens a step). Nothing is allocated: the
model is built on the meta device, the simulator prices it from the hardware profile.
"""
import torch

LLAMA7B = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 4096}
BATCH, SEQ = 512, 2048


def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    from cube.models import CausalLM
    cfg = LlamaConfig(**LLAMA7B, attn_implementation="sdpa", use_cache=False)
    with torch.device("meta"):
        model = CausalLM(LlamaForCausalLM(cfg))
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return model, (ids, ids)
