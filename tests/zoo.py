"""Models nobody here wrote, as their users build them, under every shipped plan.

Each model comes from an installed package (``transformers``, or torch.nn's own transformer layers
wrapped in a small language model: ``TorchLM``) with its default configuration,
shrunk only in size (hidden size, layers, vocabulary) so it trains in seconds on a CPU:
``use_cache``, attention implementation, MoE routing, loss functions and normalizations are as
shipped. Dropout and stochastic depth are set to 0 (the one change of behaviour): on, a plan draws other
masks than one process, so a run is not comparable with the plain model (``exact_rng``). A model that
draws random numbers in training outside dropout (``DRAWS``: PhiMoE samples its experts with Gumbel
noise, ``exponential_``) keeps them, and both sides start from one seed under ``exact_rng=True``: every
plan draws the single device's numbers. A model whose float32 rounding alone moves it past the tolerance
(``DOUBLE``: batch norms over a handful of values) is compared in float64.

``run(model, plan)`` trains two steps of one plan in the in-process world and compares the loss
and every parameter piece with the plain model on the same global batches (SGD: an update linear
in the gradient, so a gradient of the wrong scale shows). The outcome is ``exact``, ``refused``
(a ``ValueError`` saying why), ``wrong`` or ``crash``; ``python -m tests.zoo`` runs the whole
table, each case in its own process under a time limit (``hang``), and prints it as Markdown.

Every plan compiles with ``strict=True``: a split the policy asks for and the plan cannot keep
(an op run whole on gathered inputs, ``cube.ir.lost``) is a refusal, so an exact outcome is also
one without silent loss of parallelism. ``REFUSED`` lists the refusals that are justified, with
the reason; any other refusal fails the tier's tests.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

V, S, B = 128, 16, 4   # vocabulary, sequence length, samples per micro-batch
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
PARAM_FLOOR = 1e-3   # see tests.inprocess.parity: biases a model initializes to zero and never moves


class LM(nn.Module):
    """A Hugging Face model whose forward returns its own loss (``labels=``), as users train it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return self.model(x, labels=labels).loss


def no_dropout(cfg):
    """``cfg`` with every dropout, drop-path (stochastic depth) and LayerDrop probability 0 (module docstring)."""
    for k, v in list(vars(cfg).items()):
        named = any(w in k for w in ("dropout", "pdrop", "drop_prob", "drop_path", "layerdrop")) or k.endswith("_drop")
        if isinstance(v, float) and named:
            setattr(cfg, k, 0.0)
    return cfg


def _hf(config: str, model: str, **kw) -> nn.Module:
    import transformers
    return LM(getattr(transformers, model)(no_dropout(getattr(transformers, config)(**kw))))


def _batched_mm(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if getattr(m, "config", None) is not None:
            m.config._experts_implementation = "batched_mm"
    return model


_TEXT = {
    "gpt2": lambda: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4),
    "llama": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **SMALL),
    "mistral": lambda: _hf("MistralConfig", "MistralForCausalLM", **SMALL),
    "qwen2": lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", **SMALL),
    "qwen3": lambda: _hf("Qwen3Config", "Qwen3ForCausalLM", head_dim=8, **SMALL),
    "gemma": lambda: _hf("GemmaConfig", "GemmaForCausalLM", head_dim=8, **SMALL),
    "gemma2": lambda: _hf("Gemma2Config", "Gemma2ForCausalLM", head_dim=8, **SMALL),
    "phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", pad_token_id=0, **SMALL),
    "gpt_neox": lambda: _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", vocab_size=V, hidden_size=32,
                            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=64),
    "opt": lambda: _hf("OPTConfig", "OPTForCausalLM", vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32),
    "falcon": lambda: _hf("FalconConfig", "FalconForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4),
    "mixtral": lambda: _hf("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                           **SMALL),
    "mixtral_bmm": lambda: _batched_mm(_TEXT["mixtral"]()),
    "qwen2_moe": lambda: _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=64, **SMALL),
    "qwen2_moe_bmm": lambda: _batched_mm(_TEXT["qwen2_moe"]()),
    # DeepSeek-V2: multi-head latent attention, complex rotary embeddings (view_as_complex), MoE
    "deepseek_v2": lambda: _hf("DeepseekV2Config", "DeepseekV2ForCausalLM", kv_lora_rank=16, q_lora_rank=None,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
                               n_routed_experts=4, num_experts_per_tok=2, **{**SMALL, "num_key_value_heads": 4}),
    # more decoder families as shipped: ALiBi (BLOOM, MPT), parallel attention and MLP (GPT-J, CodeGen,
    # Cohere), QK norms (OLMo-2), sliding windows (Gemma 3, Starcoder2), NoPE layers (SmolLM3),
    # bmm attention with its heads merged into the batch (BLOOM, XGLM), sinusoidal positions (XGLM)
    "bloom": lambda: _hf("BloomConfig", "BloomForCausalLM", vocab_size=V, hidden_size=32, n_layer=2, n_head=4),
    "gptj": lambda: _hf("GPTJConfig", "GPTJForCausalLM", vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                        n_positions=64),
    "codegen": lambda: _hf("CodeGenConfig", "CodeGenForCausalLM", vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                           rotary_dim=4, n_positions=64, n_ctx=64),
    "olmo": lambda: _hf("OlmoConfig", "OlmoForCausalLM", **SMALL),
    "olmo2": lambda: _hf("Olmo2Config", "Olmo2ForCausalLM", **SMALL),
    "cohere": lambda: _hf("CohereConfig", "CohereForCausalLM", **SMALL),
    "stablelm": lambda: _hf("StableLmConfig", "StableLmForCausalLM", **SMALL),
    "starcoder2": lambda: _hf("Starcoder2Config", "Starcoder2ForCausalLM", **SMALL),
    "granite": lambda: _hf("GraniteConfig", "GraniteForCausalLM", **SMALL),
    "gemma3": lambda: _hf("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8, sliding_window=8, **SMALL),
    "mpt": lambda: _hf("MptConfig", "MptForCausalLM", vocab_size=V, d_model=32, n_layers=2, n_heads=4, max_seq_len=64),
    "helium": lambda: _hf("HeliumConfig", "HeliumForCausalLM", head_dim=8, **SMALL),
    "glm4": lambda: _hf("Glm4Config", "Glm4ForCausalLM", head_dim=8, pad_token_id=0, **SMALL),
    "smollm3": lambda: _hf("SmolLM3Config", "SmolLM3ForCausalLM", pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           **SMALL),
    "xglm": lambda: _hf("XGLMConfig", "XGLMForCausalLM", vocab_size=V, d_model=32, num_layers=2, attention_heads=4,
                        ffn_dim=64, max_position_embeddings=64),
    "biogpt": lambda: _hf("BioGptConfig", "BioGptForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
    # more MoE routers: top-k of the logits (GraniteMoE, GPT-OSS: biased experts, clamped SwiGLU,
    # attention sinks), sigmoid group routing (DeepSeek-V3), sparsemixer with Gumbel sampling (PhiMoE),
    # Mamba, attention and MoE layers in one stack (Jamba)
    "qwen3_moe": lambda: _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=32, head_dim=8, **SMALL),
    "olmoe": lambda: _hf("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, **SMALL),
    "granitemoe": lambda: _hf("GraniteMoeConfig", "GraniteMoeForCausalLM", num_local_experts=4,
                              num_experts_per_tok=2, **SMALL),
    "phimoe": lambda: _hf("PhimoeConfig", "PhimoeForCausalLM", num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "gpt_oss": lambda: _hf("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                           sliding_window=8, **SMALL),
    "deepseek_v3": lambda: _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", kv_lora_rank=16, q_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
                               n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                               topk_group=1, **{**SMALL, "num_key_value_heads": 4}),
    "jamba": lambda: _hf("JambaConfig", "JambaForCausalLM", num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                         attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                         mamba_expand=2, **SMALL),
    # state-space and recurrent language models, their PyTorch paths (no mamba_ssm kernels installed)
    "mamba": lambda: _hf("MambaConfig", "MambaForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                         state_size=8),
    "mamba2": lambda: _hf("Mamba2Config", "Mamba2ForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                          state_size=8, num_heads=4, head_dim=16, n_groups=1, chunk_size=8),
    "rwkv": lambda: _hf("RwkvConfig", "RwkvForCausalLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                        attention_hidden_size=32, intermediate_size=64, context_length=64),
    "bert": lambda: _hf("BertConfig", "BertForMaskedLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
    "roberta": lambda: _hf("RobertaConfig", "RobertaForMaskedLM", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
    # encoders: shared layers (ALBERT: one block's weights for every layer), disentangled relative
    # attention (DeBERTa-v2), factorized embeddings (ALBERT, ELECTRA)
    "distilbert": lambda: _hf("DistilBertConfig", "DistilBertForMaskedLM", vocab_size=V, dim=32, n_layers=2, n_heads=4,
                              hidden_dim=64, max_position_embeddings=64),
    "albert": lambda: _hf("AlbertConfig", "AlbertForMaskedLM", vocab_size=V, embedding_size=16, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
    "electra": lambda: _hf("ElectraConfig", "ElectraForMaskedLM", vocab_size=V, embedding_size=16, hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64),
    "deberta_v2": lambda: _hf("DebertaV2Config", "DebertaV2ForMaskedLM", vocab_size=V, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              max_position_embeddings=64),
    # the families of 2025 (``RECENT``): hybrids of Mamba-2 mixers and attention (Bamba, Falcon-H1, Granite 4's
    # MoE hybrid, Nemotron-H), short convolutions (LFM2), linear attention (Qwen3-Next's gated delta rule,
    # MiniMax's lightning attention, Kimi Linear's delta attention), Falcon-Mamba, MoE routers with
    # sigmoid scores, groups and bias correction (GLM-4.5, ERNIE 4.5, dots.llm1, Hunyuan-A13B, Llama 4),
    # and the dense newcomers (OLMo 3, Apertus, Seed-OSS, EXAONE 4, BitNet)
    "bamba": lambda: _hf("BambaConfig", "BambaForCausalLM", mamba_d_state=8, mamba_n_heads=4, mamba_d_head=16,
                         mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2, attn_layer_indices=[1], **SMALL),
    "falcon_h1": lambda: _hf("FalconH1Config", "FalconH1ForCausalLM", mamba_d_state=8, mamba_n_heads=4,
                             mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=8, mamba_d_ssm=64, head_dim=8,
                             **SMALL),
    "granitemoehybrid": lambda: _hf("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", mamba_d_state=8,
                                    mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_chunk_size=8,
                                    mamba_expand=2, layer_types=["mamba", "attention"], num_local_experts=4,
                                    num_experts_per_tok=2, shared_intermediate_size=32, **SMALL),
    "nemotron_h": lambda: _hf("NemotronHConfig", "NemotronHForCausalLM", ssm_state_size=8, mamba_num_heads=4,
                              mamba_head_dim=16, n_groups=1, chunk_size=8, hybrid_override_pattern="M*-",
                              **{**SMALL, "num_hidden_layers": 3}),
    "lfm2": lambda: _hf("Lfm2Config", "Lfm2ForCausalLM", layer_types=["conv", "full_attention"], **SMALL),
    "falcon_mamba": lambda: _hf("FalconMambaConfig", "FalconMambaForCausalLM", vocab_size=V, hidden_size=32,
                                num_hidden_layers=2, state_size=8),
    "qwen3_next": lambda: _hf("Qwen3NextConfig", "Qwen3NextForCausalLM", head_dim=8, linear_num_value_heads=4,
                              linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                              linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
                              **SMALL),
    "minimax": lambda: _hf("MiniMaxConfig", "MiniMaxForCausalLM", head_dim=8, num_local_experts=4,
                           num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"], block_size=8,
                           **SMALL),
    "kimi_linear": lambda: _hf("KimiLinearConfig", "KimiLinearForCausalLM", pad_token_id=0, moe_intermediate_size=32,
                               num_experts=4, num_experts_per_token=2, qk_rope_head_dim=8, qk_nope_head_dim=8,
                               v_head_dim=8, kv_lora_rank=16, q_lora_rank=None, linear_head_dim=8, linear_num_heads=4,
                               layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
                               head_dim=8, **{**SMALL, "num_key_value_heads": 4}),
    "glm4_moe": lambda: _hf("Glm4MoeConfig", "Glm4MoeForCausalLM", head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                            moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1, pad_token_id=0,
                            **SMALL),
    "ernie4_5_moe": lambda: _hf("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", moe_num_experts=4, moe_k=2,
                                moe_intermediate_size=32, moe_layer_start_index=1, head_dim=8, **SMALL),
    "dots1": lambda: _hf("Dots1Config", "Dots1ForCausalLM", n_routed_experts=4, n_shared_experts=1,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                         topk_group=1, head_dim=8, **SMALL),
    "hunyuan_moe": lambda: _hf("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", num_experts=4, moe_topk=2, head_dim=8,
                               **SMALL),
    "llama4": lambda: _hf("Llama4TextConfig", "Llama4ForCausalLM", num_local_experts=4, num_experts_per_tok=1,
                          intermediate_size_mlp=64, head_dim=8, attention_chunk_size=8, **SMALL),
    "olmo3": lambda: _hf("Olmo3Config", "Olmo3ForCausalLM", sliding_window=8, **SMALL),
    "apertus": lambda: _hf("ApertusConfig", "ApertusForCausalLM", **SMALL),
    "seed_oss": lambda: _hf("SeedOssConfig", "SeedOssForCausalLM", head_dim=8, **SMALL),
    "exaone4": lambda: _hf("Exaone4Config", "Exaone4ForCausalLM", sliding_window=8, **SMALL),
    "bitnet": lambda: _hf("BitNetConfig", "BitNetForCausalLM", **SMALL),
}
_SEQ2SEQ = {
    "t5": lambda: _hf("T5Config", "T5ForConditionalGeneration", vocab_size=V, d_model=32, d_kv=8, d_ff=64,
                      num_layers=2, num_heads=4, decoder_start_token_id=0),
    "bart": lambda: _hf("BartConfig", "BartForConditionalGeneration", vocab_size=V, d_model=32, encoder_layers=2,
                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_position_embeddings=64),
}
_IMAGE = {
    "vit": lambda: _hf("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8, hidden_size=32,
                       num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=10),
    "swin": lambda: _hf("SwinConfig", "SwinForImageClassification", image_size=32, patch_size=4, embed_dim=16,
                        depths=[1, 1], num_heads=[4, 8], window_size=4, num_labels=10),
    "convnext": lambda: _hf("ConvNextConfig", "ConvNextForImageClassification", num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                            num_labels=10, image_size=32),
    "resnet": lambda: _hf("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16],
                          depths=[1, 1], num_labels=10),
}


class TorchLM(nn.Module):
    """torch.nn's own transformer (``nn.TransformerEncoder`` or ``nn.Transformer``, so
    ``nn.MultiheadAttention``) as a language model: a token embedding, the stack, a head and cross
    entropy. An encoder-decoder reads the ids and predicts the labels from the labels shifted right,
    under the causal mask torch makes for it."""

    def __init__(self, stack: nn.Module, batch_first: bool):
        super().__init__()
        self.embed = nn.Embedding(V, 32)
        self.stack = stack
        self.head = nn.Linear(32, V)
        self.batch_first = batch_first

    def _in(self, ids):
        h = self.embed(ids)
        return h if self.batch_first else h.transpose(0, 1)

    def forward(self, ids, labels):
        if isinstance(self.stack, nn.Transformer):
            mask = nn.Transformer.generate_square_subsequent_mask(labels.shape[1])
            h = self.stack(self._in(ids), self._in(F.pad(labels[:, :-1], (1, 0))), tgt_mask=mask,
                           tgt_is_causal=True)
        else:
            h = self.stack(self._in(ids))
        h = h if self.batch_first else h.transpose(0, 1)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def torch_lm(kind: str, batch_first: bool = False, norm_first: bool = False) -> TorchLM:
    """torch.nn's ``"encoder"`` (two ``nn.TransformerEncoderLayer``) or ``"transformer"`` (``nn.Transformer``,
    two layers each side) with its defaults but sizes and dropout (module docstring)."""
    kw = dict(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
    if kind == "encoder":
        return TorchLM(nn.TransformerEncoder(nn.TransformerEncoderLayer(**kw), num_layers=2), batch_first)
    return TorchLM(nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **kw), batch_first)


# torch.nn's own layers (nn.MultiheadAttention inside), sequence first as shipped or batch first, the norm
# after (as shipped) or before each block
_TORCH = {
    "torch_encoder": lambda: torch_lm("encoder"),
    "torch_encoder_nf": lambda: torch_lm("encoder", norm_first=True),
    "torch_encoder_bf": lambda: torch_lm("encoder", batch_first=True),
    "torch_encoder_bf_nf": lambda: torch_lm("encoder", batch_first=True, norm_first=True),
    "torch_transformer": lambda: torch_lm("transformer"),
}


class Classify(nn.Module):
    """An image classifier trained as timm's and torchvision's users train one: cross-entropy on its logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return nn.functional.cross_entropy(self.model(x), labels)


def _timm(name: str, **kw) -> nn.Module:
    import timm
    # dropout and stochastic depth off, as for the Hugging Face models (``no_dropout``): timm's Swin ships
    # drop_path_rate=0.1
    return Classify(timm.create_model(name, pretrained=False, num_classes=10, drop_rate=0.0, drop_path_rate=0.0,
                                      **kw))


def _torchvision(name: str, **kw) -> nn.Module:
    import torchvision
    return Classify(getattr(torchvision.models, name)(num_classes=10, **kw))


# image models of timm and torchvision, built with their model functions' defaults but for size (dropout and
# stochastic depth 0, torchvision's ViT default); they need torchvision, which has no CPU wheel for every torch: the table runs
# them where it installs (``PACKAGES``; the tests skip them, saying so, elsewhere)
_VISION = {
    "timm_vit": lambda: _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4),
    "timm_swin": lambda: _timm("swin_tiny_patch4_window7_224", img_size=32, patch_size=4, window_size=4,
                               embed_dim=16, depths=(1, 1), num_heads=(2, 4)),
    "timm_convnext": lambda: _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 8, 16, 16)),
    "timm_resnet": lambda: _timm("resnet18", layers=(1, 1, 1, 1)),
    "tv_vit": lambda: _torchvision("VisionTransformer", image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                   hidden_dim=32, mlp_dim=64),
}
_IMAGE.update(_VISION)

# more families of every kind, as users train them: decoders (Phi, Persimmon, Nemotron, StarCoder's GPT-BigCode,
# GPT-Neo's local attention, RecurrentGemma's RG-LRU, Doge, Command R7B's Cohere2, Zamba2's shared hybrid),
# encoders (ModernBERT, MobileBERT's bottlenecks and trigram input, DeBERTa, Funnel's pooling, XLNet, BigBird,
# ConvBERT's span convolutions), encoder-decoders (mBART, Pegasus, M2M100 with LayerDrop off, mT5, PLBart) and
# vision models (DeiT, BEiT, DINOv2, SegFormer, ConvNeXt V2, RegNet, LeViT, MobileNetV2, MobileViT,
# PVTv2): ``WIDER``
_MHA = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64)
_BART = dict(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)
_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_labels=10)
_TEXT.update({
    "phi": lambda: _hf("PhiConfig", "PhiForCausalLM", **SMALL),
    "persimmon": lambda: _hf("PersimmonConfig", "PersimmonForCausalLM", **_MHA),
    "nemotron": lambda: _hf("NemotronConfig", "NemotronForCausalLM", head_dim=8, **SMALL),
    "gpt_bigcode": lambda: _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=V, n_embd=32, n_layer=2,
                               n_head=4, n_positions=64),
    "gpt_neo": lambda: _hf("GPTNeoConfig", "GPTNeoForCausalLM", vocab_size=V, hidden_size=32, num_layers=2,
                           num_heads=4, attention_types=[[["global", "local"], 1]], window_size=8,
                           max_position_embeddings=64),
    "recurrent_gemma": lambda: _hf("RecurrentGemmaConfig", "RecurrentGemmaForCausalLM", num_hidden_layers=3,
                                   lru_width=32, attention_window_size=8, head_dim=8,
                                   **{k: v for k, v in SMALL.items() if k != "num_hidden_layers"}),
    "doge": lambda: _hf("DogeConfig", "DogeForCausalLM", **SMALL),
    "cohere2": lambda: _hf("Cohere2Config", "Cohere2ForCausalLM", sliding_window=8, **SMALL),
    "zamba2": lambda: _hf("Zamba2Config", "Zamba2ForCausalLM", num_key_value_heads=4, mamba_d_state=8,
                          mamba_headdim=8, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
                          **{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}),
    "modernbert": lambda: _hf("ModernBertConfig", "ModernBertForMaskedLM", local_attention=8, pad_token_id=0, **_MHA),
    "mobilebert": lambda: _hf("MobileBertConfig", "MobileBertForMaskedLM", embedding_size=16, true_hidden_size=16,
                              intra_bottleneck_size=16, **_MHA),
    "deberta": lambda: _hf("DebertaConfig", "DebertaForMaskedLM", **_MHA),
    "funnel": lambda: _hf("FunnelConfig", "FunnelForMaskedLM", vocab_size=V, d_model=32, n_head=4, d_head=8,
                          d_inner=64, block_sizes=[1, 1], num_decoder_layers=1),
    "xlnet": lambda: _hf("XLNetConfig", "XLNetLMHeadModel", vocab_size=V, d_model=32, n_layer=2, n_head=4, d_inner=64),
    "big_bird": lambda: _hf("BigBirdConfig", "BigBirdForMaskedLM", attention_type="original_full", **_MHA),
    "convbert": lambda: _hf("ConvBertConfig", "ConvBertForMaskedLM", embedding_size=32, **_MHA),
})
_SEQ2SEQ.update({
    "mbart": lambda: _hf("MBartConfig", "MBartForConditionalGeneration", **_BART),
    "pegasus": lambda: _hf("PegasusConfig", "PegasusForConditionalGeneration", **_BART),
    "m2m100": lambda: _hf("M2M100Config", "M2M100ForConditionalGeneration", **_BART),
    "mt5": lambda: _hf("MT5Config", "MT5ForConditionalGeneration", vocab_size=V, d_model=32, d_kv=8, d_ff=64,
                       num_layers=2, num_heads=4),
    "plbart": lambda: _hf("PLBartConfig", "PLBartForConditionalGeneration", **_BART),
})
_IMAGE.update({
    "deit": lambda: _hf("DeiTConfig", "DeiTForImageClassification", intermediate_size=64, **_VIT),
    "beit": lambda: _hf("BeitConfig", "BeitForImageClassification", intermediate_size=64,
                        use_relative_position_bias=True, **_VIT),
    "dinov2": lambda: _hf("Dinov2Config", "Dinov2ForImageClassification", **_VIT),
    "segformer": lambda: _hf("SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2, depths=[1, 1],
                             sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2], num_labels=10,
                             decoder_hidden_size=16),
    "convnextv2": lambda: _hf("ConvNextV2Config", "ConvNextV2ForImageClassification", num_stages=2,
                              hidden_sizes=[8, 16], depths=[1, 1], num_labels=10),
    "regnet": lambda: _hf("RegNetConfig", "RegNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16],
                          depths=[1, 1], groups_width=8, num_labels=10),
    "levit": lambda: _hf("LevitConfig", "LevitForImageClassification", image_size=32, hidden_sizes=[16, 32, 48],
                         num_attention_heads=[1, 2, 3], depths=[1, 1, 1], key_dim=[8, 8, 8], num_labels=10),
    "mobilenet_v2": lambda: _hf("MobileNetV2Config", "MobileNetV2ForImageClassification", image_size=32,
                                depth_multiplier=0.1, num_labels=10),
    "mobilevit": lambda: _hf("MobileViTConfig", "MobileViTForImageClassification", image_size=32,
                             hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 64], num_labels=10),
    "pvt_v2": lambda: _hf("PvtV2Config", "PvtV2ForImageClassification", image_size=32, num_encoder_blocks=2,
                          depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16], num_attention_heads=[1, 2],
                          mlp_ratios=[2, 2], num_labels=10),
})
WIDER = ("phi persimmon nemotron gpt_bigcode gpt_neo recurrent_gemma doge cohere2 zamba2 modernbert mobilebert "
         "deberta funnel xlnet big_bird convbert mbart pegasus m2m100 mt5 plbart deit beit dinov2 segformer "
         "convnextv2 regnet levit mobilenet_v2 mobilevit pvt_v2").split()
_WIDER_IMAGE = ("deit beit dinov2 segformer convnextv2 regnet levit mobilenet_v2 mobilevit pvt_v2").split()
_WIDER_BN = ("regnet levit mobilenet_v2 mobilevit").split()   # batch norms over the batch


class TitanLM(nn.Module):
    """A torchtitan model trained as torchtitan's trainer trains it: block-causal attention within the
    documents packed into each sample (their masks from per-token positions), cross-entropy on the logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, tokens, labels, positions):
        masks = self.model.get_attention_masks(positions)
        logits = self.model(tokens, positions=positions, attention_masks=masks)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _titan(family: str, layers: int = 2) -> nn.Module:
    """torchtitan's ``debugmodel`` of ``family`` (as its configs give it: fused QKV, complex rotary
    embeddings, flex_attention) with its first ``layers`` blocks."""
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention
    if not torch.cuda.is_available():
        # torchtitan compiles flex_attention (inductor's kernels train it on GPUs only): on a CPU the plain
        # model runs torch's eager flex_attention, the dense implementation cube runs there too
        FlexAttention._compiled_flex_attn = flex_attention
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry("debugmodel")
    spec.model.layers = spec.model.layers[:layers]
    return TitanLM(spec.model.build())


def _packed(batch: int, gen: torch.Generator) -> tuple:
    """Tokens, next-token labels and per-token positions of documents packed into each sample (a position
    0 starts a document): two to four documents a sample, at other offsets in each."""
    ids = torch.randint(0, V, (batch, S), generator=gen)
    pos = torch.arange(S).repeat(batch, 1)
    for i in range(batch):
        for start in sorted(torch.randperm(S - 2, generator=gen)[:1 + i % 3].add(1).tolist()):
            pos[i, start:] = torch.arange(S - start)
    return ids, ids.roll(-1, 1), pos


# torchtitan's language models (pip package torchtitan): they attend with flex_attention only
def _titan_moe(family: str) -> nn.Module:
    """torchtitan's MoE ``debugmodel`` (DeepSeek-V3's: a dense block, then an MoE block of 8 routed experts,
    top-3, two shared experts, latent attention), its states initialized as torchtitan's trainer does
    (``build()`` leaves the experts' weights empty)."""
    model = _titan(family)
    with torch.no_grad():
        model.model.init_states()
    return model


_TITAN = {"tt_llama3": lambda: _titan("llama3"), "tt_qwen3": lambda: _titan("qwen3"),
          "tt_deepseek_v3": lambda: _titan_moe("deepseek_v3")}
PACKAGES = {**{m: "timm" for m in _VISION if m.startswith("timm_")}, "tv_vit": "torchvision",
            **{m: "torchtitan" for m in _TITAN}, **{m: "torch" for m in _TORCH}}
MODELS = list(_TEXT) + list(_SEQ2SEQ) + list(_TORCH) + list(_IMAGE) + list(_TITAN)
# the families added after the first table (tests/test_zoo_added.py runs them, beside tests/test_zoo.py)
ADDED = ("bloom gptj codegen olmo olmo2 cohere stablelm starcoder2 granite gemma3 mpt helium glm4 smollm3 xglm biogpt "
         "qwen3_moe olmoe granitemoe phimoe gpt_oss deepseek_v3 jamba mamba mamba2 rwkv distilbert albert electra "
         "deberta_v2").split()
# the families of 2025 (tests/test_zoo_recent.py runs them)
RECENT = ("bamba falcon_h1 granitemoehybrid nemotron_h lfm2 falcon_mamba qwen3_next minimax kimi_linear glm4_moe "
          "ernie4_5_moe dots1 hunyuan_moe llama4 olmo3 apertus seed_oss exaone4 bitnet").split()


def installed(name: str) -> bool:
    """Whether the package model ``name`` comes from imports here."""
    try:
        importlib.import_module(PACKAGES.get(name, "transformers"))
    except Exception:   # noqa: BLE001 - an import that fails for any reason (torchvision built for another torch)
        return False
    return True


def build(name: str, batch: int = B) -> Tuple[nn.Module, tuple]:
    """(model, one batch of ``batch`` samples) for a model of the tier."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name in _IMAGE:
        return _IMAGE[name](), (torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,), generator=gen))
    if name in _TITAN:
        return _TITAN[name](), _packed(batch, gen)
    ids = torch.randint(0, V, (batch, S), generator=gen)
    model = {**_TEXT, **_SEQ2SEQ, **_TORCH}[name]()
    if name in _SEQ2SEQ or name == "torch_transformer":   # an encoder-decoder predicts other tokens
        return model, (ids, torch.randint(0, V, (batch, S), generator=gen))
    return model, (ids, ids.clone())


@dataclass(frozen=True)
class Plan:
    """A shipped policy with its options, on ``world`` ranks; a step takes ``nmicros`` micro-batches of
    ``micro`` samples."""

    policy: str
    world: int
    options: Tuple[Tuple[str, object], ...] = ()
    nmicros: int = 1
    micro: int = B
    strict: bool = True   # every split the policy asks for is kept (cube.compile(strict=True)), or refused
    compile: Tuple[Tuple[str, object], ...] = ()   # more of cube.compile's options (zero=3)

    def make(self) -> Callable:
        module, name = self.policy.split(":")
        return functools.partial(getattr(importlib.import_module(module), name), **dict(self.options))


PLANS: Dict[str, Plan] = {
    "single": Plan("cube.policies.single:PASSingle", 1),
    "data": Plan("cube.policies.data:PASData", 2),
    "tensor": Plan("cube.policies.megatron:PASMegatronTP", 2),
    "pipeline": Plan("cube.policies.pipeline:PAS1F1B", 2, (("nmicros", 2),), nmicros=2, micro=2),
    "pipeline_1": Plan("cube.policies.pipeline:PAS1F1B", 2, (("nmicros", 2),), nmicros=2, micro=1),
    "3d": Plan("cube.policies.megatron3d:PASMegatron", 4, (("tp", 2), ("pp", 2), ("nmicros", 2)), nmicros=2, micro=2),
    # the other shipped plans (slow tier): ZeRO-3, tensor x data, sequence and context parallel, and the
    # schedules with several stages per rank, on micro-batches of one sample
    "zero3": Plan("cube.policies.data:PASData", 2, compile=(("zero", 3),)),
    "dp_tp": Plan("cube.policies.megatron3d:PASMegatron", 4, (("tp", 2), ("pp", 1), ("nmicros", 1))),
    "sp": Plan("cube.policies.megatron3d:PASMegatron", 2, (("tp", 2), ("pp", 1), ("nmicros", 1), ("sp", True))),
    "cp": Plan("cube.policies.context:PASContext", 2, (("cp", 2),)),
    "cp_tp": Plan("cube.policies.context:PASContext", 4, (("cp", 2), ("tp", 2))),
    "sp_cp": Plan("cube.policies.megatron3d:PASMegatron", 4, (("tp", 2), ("pp", 1), ("nmicros", 1), ("sp", True),
                                                            ("cp", 2))),
    "interleaved": Plan("cube.policies.pipeline:PAS1F1BInterleaved", 2, (("nmicros", 4), ("nvirtual", 2)), nmicros=4,
                        micro=1),
    "zbv": Plan("cube.policies.pipeline:PASZBV", 2, (("nmicros", 4),), nmicros=4, micro=1),
    "dualpipev": Plan("cube.policies.pipeline:PASDualPipeV", 2, (("nmicros", 4),), nmicros=4, micro=1),
}
_ONE = ("pipeline_1", "interleaved", "zbv", "dualpipev")   # plans of one-sample micro-batches

_BN = "batch norm's statistics over a micro-batch are not the global batch's"
# (model, plan) -> (a part of the refusal's message, why the refusal is justified)
REFUSED: Dict[Tuple[str, str], Tuple[str, str]] = {
    **{(m, p): ("normalizes with statistics over the batch", _BN) for m in ("resnet", "timm_resnet")
       for p in ("pipeline", "pipeline_1", "3d") if (m, p) != ("timm_resnet", "pipeline_1")},
    # torchtitan builds its packed-document mask another way for a batch of one sample (a batch_size == 1
    # branch in get_efficient_causal_mask_mod_for_packed_document): no op-for-op match with the global batch
    **{(m, p): ("runs other ops on a micro-batch of 1", "torchtitan's forward takes another path for "
                "one sample (its document mask's batch_size == 1 branch); micro-batches of 2+ train")
       for m in _TITAN for p in _ONE},
    **{(m, p): ("normalizes with statistics over the batch", _BN) for m in ("resnet", "timm_resnet")
       for p in _ONE[1:]},
    # no sequence: an image classifier's activations have no dim context parallelism splits
    **{(m, p): ("no sequence dim found to split", "an image model: no sequence for context parallelism to split")
       for m in ("vit", "swin", "convnext", "resnet", "timm_vit", "timm_resnet", "timm_convnext", "timm_swin",
                 "tv_vit") for p in ("cp", "cp_tp", "sp_cp")},
    # a convolutional network has no pair of linear layers for Megatron's split: under strict=True the
    # policy's "splits nothing" is an error
    **{(m, "tensor"): ("no linear pairs found to split", "a convolutional network: no pair of linear layers "
                       "for Megatron-LM's tensor split (data parallel splits it)") for m in ("resnet", "timm_resnet")},
    # context parallel splits a recurrence by heads (cube.ir.heads) and tensor parallel each block again: the
    # configuration's 2 key heads do not divide into cp x tp = 4 (Megatron-LM asks the same of its heads)
    **{("qwen3_next", p): ("choose cp x tp dividing the heads", "Qwen3-Next's gated delta rule splits by heads "
                           "over cp and tp together; the zoo configuration's 2 key heads do not divide into 4")
       for p in ("cp_tp", "sp_cp")},
    # torch's batch norm itself refuses one sample per channel in training (timm's ResNet ends at 1x1 pixels)
    ("timm_resnet", "pipeline_1"): ("not on a micro-batch of 1", _BN + "; one sample per channel is refused by torch"),
    # the vision models of WIDER: no sequence for context parallelism; batch norms under micro-batches (torch
    # itself refuses a norm over one value per channel, on one-sample micro-batches of the models whose last
    # stage is 1x1 pixels); convolutional networks without linear pairs for Megatron-LM's tensor split
    **{(m, p): ("no sequence dim found to split", "an image model: no sequence for context parallelism to split")
       for m in _WIDER_IMAGE for p in ("cp", "cp_tp", "sp_cp")},
    **{(m, p): ("normalizes with statistics over the batch", _BN) for m in _WIDER_BN
       for p in ("pipeline", "3d", "interleaved", "zbv", "dualpipev", "pipeline_1")},
    **{(m, p): ("more than 1 value per channel", _BN + "; one value per channel is refused by torch")
       for m in ("levit", "mobilenet_v2", "mobilevit") for p in _ONE},
    **{(m, p): ("no linear pairs found to split", "a convolutional network: no pair of linear layers for "
                "Megatron-LM's tensor split (data parallel splits it)") for m in ("regnet", "mobilenet_v2")
       for p in ("tensor",)},
}


# (model, plan) -> (a part of the refusal's message, what is missing): splits the plan cannot keep yet,
# refused under strict=True (without it: the op runs whole on gathered inputs, exact, logged). docs/models.md
GAPS: Dict[Tuple[str, str], Tuple[str, str]] = {
    # Funnel pools the sequence by strided slices around its CLS token: the slices keep the sequence whole
    **{("funnel", p): ("lost at op 'slice'", "Funnel's pooling of the sequence (strided slices around the CLS "
                       "token) has no split of the sequence") for p in ("cp", "sp", "cp_tp", "sp_cp")},
    # ConvBERT concatenates its attention heads with its span-convolution heads before the output projection,
    # and runs the convolution's kernels over positions merged with the batch
    **{("convbert", p): ("lost at op 'linear'", "ConvBERT's attention heads and span-convolution heads are "
                         "concatenated before the output projection: no Megatron pair through the cat")
       for p in ("tensor", "sp", "3d", "dp_tp", "sp_cp")},
    **{("convbert", p): ("lost at op 'conv1d'", "ConvBERT's span convolution: a kernel of 9 positions on the "
                         "zoo's 16-token sequence, more than a block of 8, and kernels over positions merged "
                         "with the batch") for p in ("cp", "cp_tp")},
    # PhiMoE's router multiplier is a torch.autograd.Function, run as written as one op (cube.runtime.functions)
    # on the tokens' merged rows (B * S, E): a split of the sequence does not reach it (cube.trace.along rewrites
    # the router's other ops onto the (B, S) dims, not an op it does not know)
    **{("phimoe", p): ("lost at op 'fn_PhimoeMultiplier", "PhiMoE's router multiplier, an autograd.Function run "
                       "as one op on the tokens' merged rows, which a split of the sequence does not reach")
       for p in ("cp", "cp_tp", "sp_cp")},
    # torchtitan's MoE returns its routed tokens flattened (T, D) and adds them to the shared experts' (B, L, D)
    **{("tt_deepseek_v3", p): ("lost at op 'add'", "torchtitan's MoE: its sorted dispatch returns the tokens "
                               "flattened with the batch, which a split of the sequence does not follow")
       for p in ("sp", "cp", "cp_tp", "sp_cp")},
}

_REFUSALS = ("ValueError", "TraceError", "LostSplitError")

# models that draw random numbers in training besides dropout (module docstring): compared under exact_rng=True
DRAWS = frozenset({"phimoe"})
# models compared in float64: their batch norms over a few values (LeViT's, over 4 samples of 1x1 pixels at the last
# stage; MobileViT's, MobileNetV2's) make float32 rounding alone, which a plan orders otherwise than one process,
# move some parameters by more than the tolerance (1e-4 to 7e-2), while float64 agrees to 1e-11
DOUBLE = frozenset({"levit", "mobilevit", "mobilenet_v2"})
SEED = 1234


@dataclass
class Outcome:
    kind: str            # exact, refused, wrong, crash, hang
    detail: str = ""
    error: float = 0.0
    seconds: float = 0.0

    def cell(self) -> str:
        return {"exact": "exact", "wrong": f"**WRONG** ({self.error:.1e})"}.get(self.kind, self.kind)


def run(name: str, plan: str, steps: int = 2) -> Outcome:
    """Trains ``steps`` steps of ``plan`` on model ``name`` and the plain model; compares them."""
    from tests.inprocess import parity
    p = PLANS[plan]
    start = time.time()
    from cube.trace.flex import device_check_off
    model, sample = build(name, p.micro)
    gen = torch.Generator().manual_seed(2)
    batches = [_packed(p.micro * p.nmicros, gen) for _ in range(steps)] if name in _TITAN else None
    if name in DOUBLE:
        from tests.parity import global_batches
        model = model.double()
        batches = [tuple(t.double() if t.is_floating_point() else t for t in b)
                   for b in global_batches(sample, steps, p.nmicros)]
    try:
        with device_check_off():   # the plain model's flex_attention trains on a CPU too (cube.trace.flex)
            errors = parity(model, sample, p.make(), p.world, steps=steps, nmicros=p.nmicros, opt="sgd",
                            param_floor=PARAM_FLOOR, batches=batches, strict=p.strict, **dict(p.compile),
                            **(dict(seed=SEED, exact_rng=True) if name in DRAWS else {}))
    except Exception as e:   # noqa: BLE001 - every failure is an outcome of the table
        cause = e
        while isinstance(cause, RuntimeError) and cause.__cause__ is not None:
            cause = cause.__cause__
        text = str(cause).replace("\n", " ")
        # a rank's error arrives as text (cube.debug): a refusal is a ValueError or one of cube's subclasses of it
        named = re.match(r"cube\.debug: rank \d+ failed: (\w+):", text)
        kind = "refused" if isinstance(cause, ValueError) or (named and named.group(1) in _REFUSALS) else "crash"
        return Outcome(kind, f"{type(cause).__name__}: {text}", seconds=time.time() - start)
    worst = max(max(e) for e in errors)
    return Outcome("exact" if worst <= 1e-5 else "wrong", error=worst, seconds=time.time() - start)


TRANSFORMERS = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "gpt_neox", "opt", "falcon",
                "mixtral", "qwen2_moe", "deepseek_v2", "bert", "roberta", "t5", "bart", "vit", "swin",
                "tt_llama3", "tt_qwen3",
                # of the families added later, one of each kind: parallel blocks, ALiBi, QK norms, sliding
                # windows, top-k routers, latent attention, shared layers, recurrent and state-space mixers
                "gptj", "mpt", "olmo2", "gemma3", "granitemoe", "deepseek_v3", "albert", "rwkv", "mamba2",
                # of the families of 2025: Mamba-2 hybrids, Falcon-Mamba, LFM2's short convolutions, sigmoid
                # routers with expert groups, Llama 4's top-1 router and shared expert
                "bamba", "falcon_mamba", "nemotron_h", "lfm2", "glm4_moe", "llama4"]


def tp_shares(name: str, tp: int) -> Dict[str, float]:
    """The share of each of block 0's linear weights that rank 0 holds under ``PASMegatronTP`` on
    ``tp`` ranks (1.0: whole on every rank)."""
    import math

    import cube
    from cube.policies.megatron import PASMegatronTP
    model, batch = build(name)
    held: Dict[str, int] = {}
    for t, box in cube.plan(model, batch, PASMegatronTP, tp, ranks=[0]).program[0].plan.attrs:
        if t.kind.value == "param":
            for n in t.names:
                held[n] = held.get(n, 0) + math.prod(e - b for b, e in box)
    block = [n for n, p in model.named_parameters() if p.ndim == 2 and ".0." in n and "embed" not in n
             and "rel" not in n and "position" not in n]
    return {n: held.get(n, 0) / model.get_parameter(n).numel() for n in block}


def _subprocess(name: str, plan: str, timeout: float) -> Outcome:
    cmd = [sys.executable, "-m", "tests.zoo", "--one", name, plan]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Outcome("hang", f"no result in {timeout:.0f} s")
    for line in out.stdout.splitlines():
        if line.startswith("OUTCOME "):
            kind, error, seconds, detail = line[len("OUTCOME "):].split("\t", 3)
            return Outcome(kind, detail, float(error), float(seconds))
    return Outcome("crash", (out.stderr or out.stdout).strip().splitlines()[-1:][0] if (out.stderr or out.stdout)
                   else f"exit {out.returncode}")


def table(results: Dict[Tuple[str, str], Outcome], plans) -> str:
    """The Markdown table of the outcomes, then one line per refusal with its reason."""
    models = sorted({m for m, _ in results}, key=MODELS.index)
    lines = ["| model | " + " | ".join(plans) + " |", "|---" * (len(plans) + 1) + "|"]
    for m in models:
        lines.append(f"| {m} | " + " | ".join(results[(m, p)].cell() if (m, p) in results else "" for p in plans) + " |")
    notes = [f"- {m} / {p}: " + (f"not yet: {GAPS[(m, p)][1]}" if (m, p) in GAPS else
                                  REFUSED.get((m, p), ('', 'NOT JUSTIFIED: ' + o.detail[:200]))[1])
             for (m, p), o in sorted(results.items()) if o.kind == "refused"]
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "PLAN"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        o = run(*args.one)
        print(f"OUTCOME {o.kind}\t{o.error}\t{o.seconds}\t{o.detail}", flush=True)
        return 0
    from concurrent.futures import ThreadPoolExecutor
    models, plans = args.models.split(","), args.plans.split(",")
    missing = [m for m in models if not installed(m)]
    if missing:
        print(f"not installed here, left out: {', '.join(missing)}", file=sys.stderr)
        models = [m for m in models if m not in missing]
    cases = [(m, p) for m in models for p in plans]
    results: Dict[Tuple[str, str], Outcome] = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for (m, p), o in zip(cases, pool.map(lambda c: _subprocess(*c, args.timeout), cases)):
            results[(m, p)] = o
            print(f"{m:14s} {p:11s} {o.kind:8s} {o.seconds:6.1f}s {o.detail[:150]}", file=sys.stderr, flush=True)
    print(table(results, plans))
    bad = [c for c, o in results.items() if o.kind in ("wrong", "crash", "hang") or
           (o.kind == "refused" and c not in REFUSED and c not in GAPS)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
