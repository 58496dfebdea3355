"""A Mixtral-shaped mixture of experts (Hugging Face's ``MixtralForCausalLM`` with Mixtral 8x7B's
shape: 32 layers, hidden 4096, 8 experts of 14336 each, 2 per token; 46.7B parameters) on the
meta device and one global batch, for the cluster simulator and search:

    python -m cube.sim benchmarks/mixtral.py --hardware dgx-h100 --ngpus 64 --search
    python -m cube.sim benchmarks/mixtral.py --hardware dgx-h100 --ngpus 64 --policy PASMegatron \\
        --option tp=1 --option pp=1 --option ep=8 --option nmicros=1 --zero 1 --moe-imbalance 1.2

The global batch is 256 sequences of 4096 tokens (1M tokens a step). ``build(layers=...)``
gives a shallower model of the same width (tests). Expert parallel (``ep``) splits each MoE
layer's experts over data parallel neighbours; its all-to-alls and the experts' grouped matmuls
are priced from the token counts (``cube.sim.program``).
"""
import torch

MIXTRAL = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "max_position_embeddings": 4096}
BATCH, SEQ = 256, 4096


def build(layers: int = 32, batch: int = BATCH, seq: int = SEQ, **shape):
    from transformers import MixtralConfig, MixtralForCausalLM
    from cube.models import CausalLM
    cfg = MixtralConfig(**{**MIXTRAL, "num_hidden_layers": layers, **shape}, attn_implementation="sdpa",
                        use_cache=False)
    with torch.device("meta"):
        model = CausalLM(MixtralForCausalLM(cfg))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids)
