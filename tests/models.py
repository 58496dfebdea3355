"""Models the parity tests run: small configs, built locally (no downloads)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from examples.bigmodel.model import CausalLM as HFCausalLM
from examples.gpt.model import GPT, GPTConfig
from examples.mlp.linears import MLP


class PatchViT(nn.Module):
    """A ViT: conv patch embedding, class token, pre-norm encoder, linear head."""

    def __init__(self, image=16, patch=4, dim=64, depth=2, heads=4, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        npatch = (image // patch) ** 2
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, npatch + 1, dim) * 0.02)
        self.blocks = nn.ModuleList([ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images, labels):
        x = self.patch(images).flatten(2).transpose(1, 2)
        cls = self.cls.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x)[:, 0])
        return F.cross_entropy(logits, labels)


class ViTBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(B, N, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q @ k.transpose(-2, -1)) * (C // self.heads) ** -0.5
        attn = attn.softmax(dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(B, N, C)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class SmallCNN(nn.Module):
    """Conv, batch norm, ReLU, pooling, a linear classifier."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16 * 4 * 4, classes)

    def forward(self, images, labels):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(images))), 2)
        x = F.avg_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        logits = self.fc(torch.flatten(x, 1))
        return F.cross_entropy(logits, labels)


class WritesIntoViews(nn.Module):
    """Tensors made with the batch's shape, then written through views of them: the decoder
    input built the way encoder-decoder models shift labels right (``new_zeros`` then
    slice and select writes), a float tensor written through slice, select and transposed
    views (gradients flow through the writes), and an in-place add."""

    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, labels):
        dec = labels.new_zeros(labels.shape)
        dec[:, 1:] = labels[:, :-1].clone()
        dec[:, 0] = 3
        dec.masked_fill_(dec == -100, 0)
        h = self.proj(self.emb(dec))
        out = h.new_zeros(h.shape)
        out[:, 1:] = h[:, :-1]
        out[:, :, 0] += 1.0
        t = out.transpose(1, 2)
        t[:, 1] = t[:, 1] * 2.0
        out.add_(self.emb(ids))
        logits = self.head(torch.tanh(out))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class StaticMoE(nn.Module):
    """A mixture of experts with static shapes, as ordinary PyTorch: top-``k`` routing (``k``
    argmaxes) with a fixed ``capacity`` per expert and sequence (later tokens over it are
    dropped), the experts one ``(E, d, f)`` and one ``(E, f, d)`` weight applied with ``bmm`` to
    the ``(E, batch x capacity, d)`` dispatched tokens, combined back weighted by the router.

    Routing looks only within a sequence, so a batch split changes nothing."""

    def __init__(self, dim=16, hidden=32, experts=4, k=2, capacity=6):
        super().__init__()
        self.experts, self.k, self.capacity = experts, k, capacity
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)

    def forward(self, x):
        B, S, D = x.shape
        E, C = self.experts, self.capacity
        probs = torch.softmax(self.gate(x), dim=-1)                        # (B, S, E)
        ids = torch.arange(E, device=x.device)
        chosen, left = torch.zeros_like(probs), probs
        for _ in range(self.k):
            hit = left.argmax(dim=-1, keepdim=True) == ids                  # (B, S, E)
            chosen = chosen + hit.to(x.dtype)
            left = left.masked_fill(hit, -1.0)
        slot = torch.cumsum(chosen, dim=1) * chosen - 1                    # place in the expert's queue; -1: not routed
        dispatch = (slot.unsqueeze(-1) == torch.arange(C, device=x.device)).to(x.dtype)   # (B, S, E, C)
        combine = dispatch * (probs * chosen).unsqueeze(-1)
        xe = torch.bmm(dispatch.reshape(B, S, E * C).transpose(1, 2), x)   # (B, E*C, D)
        xe = xe.reshape(B, E, C, D).transpose(0, 1).reshape(E, B * C, D)  # (E, B*C, D): the experts' tokens
        ye = torch.bmm(F.gelu(torch.bmm(xe, self.w1)), self.w2)           # (E, B*C, D)
        ye = ye.reshape(E, B, C, D).transpose(0, 1).reshape(B, E * C, D)
        return torch.bmm(combine.reshape(B, S, E * C), ye)                 # (B, S, D)


class MoEModel(nn.Module):
    """A pre-norm residual MoE block between two linears; mean squared error loss (written out:
    ``F.mse_loss`` broadcasts its inputs first, an op cube cannot split)."""

    def __init__(self, dim=16, **moe):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.moe = StaticMoE(dim, **moe)
        self.out = nn.Linear(dim, dim)

    def forward(self, x, y):
        h = self.inp(x)
        h = h + self.moe(self.norm(h))
        return ((self.out(h) - y) ** 2).mean()


def hf_gpt2(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return HFCausalLM(GPT2LMHeadModel(cfg))


def hf_llama(layers: int = 2):
    # attn_implementation="eager": HF's sdpa path drops the causal mask (is_causal=True) in eager
    # runs but builds an explicit mask while tracing; both are right, but round differently, so
    # the parity test compares the same math on both sides.
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attention_dropout=0.0, use_cache=False,
                      attn_implementation="eager")
    return HFCausalLM(LlamaForCausalLM(cfg))


class HFSeq2SeqLM(nn.Module):
    """Wraps a Hugging Face encoder-decoder LM so forward returns the scalar loss; the model
    builds the decoder's inputs from the labels (shifted right)."""

    def __init__(self, hf_model):
        super().__init__()
        self.model = hf_model

    def forward(self, input_ids, labels):
        return self.model(input_ids=input_ids, labels=labels).loss


def hf_t5(layers: int = 2):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=layers, num_decoder_layers=layers,
                   num_heads=4, dropout_rate=0.0, use_cache=False, pad_token_id=0, eos_token_id=1,
                   decoder_start_token_id=0, attn_implementation="eager")
    return HFSeq2SeqLM(T5ForConditionalGeneration(cfg))


def hf_bart(layers: int = 2):
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=128, d_model=32, encoder_layers=layers, decoder_layers=layers,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                     activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
                     eos_token_id=2, decoder_start_token_id=2, attn_implementation="eager")
    model = BartForConditionalGeneration(cfg)
    # as gpt_nobias: a key projection's bias has a zero gradient by construction (softmax ignores a
    # shift), and AdamW turns round-off in it into updates of size lr; drop it so multi-rank runs compare
    for m in model.modules():
        if hasattr(m, "k_proj") and m.k_proj.bias is not None:
            m.k_proj.bias = None
    return HFSeq2SeqLM(model)


def build(name: str):
    """Returns (model, sample batch) for a model name used in the tests."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(dim=32, nlayers=4), (torch.randn(8, 32),)
    if name == "gpt_deep":   # enough blocks for the trace to export three and repeat one
        cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=9, n_head=4, n_embd=32, bias=False)
        ids = torch.randint(0, 128, (4, 16))
        return GPT(cfg), (ids, torch.roll(ids, -1, dims=1))
    if name in ("gpt", "gpt_nobias", "gpt4_nobias"):
        # multi-rank comparisons use gpt_nobias: the key projection's bias has a zero gradient by
        # construction (softmax ignores a shift), so AdamW turns any round-off in it into updates of
        # size lr, and two correct runs that round differently drift apart in that one tensor.
        # gpt4_nobias has 4 blocks: one per stage of a 4-stage pipeline.
        cfg = GPTConfig(vocab_size=128, block_size=16, n_layer=4 if name == "gpt4_nobias" else 2, n_head=4,
                        n_embd=32, bias=name == "gpt")
        ids = torch.randint(0, 128, (4, 16))
        return GPT(cfg), (ids, torch.roll(ids, -1, dims=1))
    if name in ("hf_gpt2", "hf_llama"):
        model = hf_gpt2() if name == "hf_gpt2" else hf_llama()
        ids = torch.randint(0, 128, (4, 16))
        return model, (ids, ids.clone())
    if name in ("hf_t5", "hf_bart"):
        model = hf_t5() if name == "hf_t5" else hf_bart()
        ids = torch.randint(0, 128, (4, 16))
        return model, (ids, torch.randint(0, 128, (4, 16)))
    if name == "views":
        return WritesIntoViews(), (torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8)))
    if name == "vit":
        return PatchViT(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    if name == "cnn":
        return SmallCNN(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    if name == "moe":
        return MoEModel(), (torch.randn(8, 8, 16), torch.randn(8, 8, 16))
    raise KeyError(name)


MODELS = ["mlp", "gpt", "hf_gpt2", "hf_llama", "vit", "cnn"]
