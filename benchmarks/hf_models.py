"""Hugging Face models as shipped, through cube on one device, against the plain model.

    python -m benchmarks.hf_models [--quick] [--cpu] [--models gpt2,llama]

Each model is built from its default configuration (``use_cache`` on, the shipped attention
implementation; dropout off, so the three ways train the same numbers), trained with AdamW
on one batch from the same weights three ways, rounds interleaved after warm-up: the plain
model in eager mode, cube (``PASSingle``, one process), and cube with the fused-projection
cut off (``CUBE_FUSED_CUT=0``: GPT-2's ``c_attn`` stays one matmul rather than three over views
of its weight, the cut that lets tensor parallel split it; see ``cube.trace.fused``). Prints
ms/step of each and the ratios cube / torch and cut / uncut: what cube's per-rank code costs
over the model it was traced from, and what the cut costs every plan.

On a GPU: GPT-2 small (124M: 12 layers, d768, T1024, batch 8) and a Llama of 8 layers, d1024,
16 heads (8 key/value heads), T1024, batch 8, bf16 autocast. On the CPU (or ``--cpu``): the
same families at a tiny size, float32, to show it works (CPU numbers say nothing of a GPU).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU = {"gpt2": dict(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257),
       "llama": dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000, max_position_embeddings=1024)}
CPU = {"gpt2": dict(n_layer=2, n_embd=128, n_head=4, n_positions=128, vocab_size=512),
       "llama": dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)}
CLASSES = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM")}


def _lm(model):
    """``model(ids, labels=ids).loss``: the model's own loss, as its users train it."""
    import torch.nn as nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, labels):
            return self.model(ids, labels=labels).loss
    return LM()


def _build(name: str, sizes: dict):
    import transformers
    config, model = CLASSES[name]
    cfg = getattr(transformers, config)(**sizes)
    for k, v in list(vars(cfg).items()):   # dropout off: the three ways must train the same numbers
        if isinstance(v, float) and ("dropout" in k or "pdrop" in k):
            setattr(cfg, k, 0.0)
    return _lm(getattr(transformers, model)(cfg))


def _cube_step(model, batch, cache: str, precision, fused: bool) -> Callable[[], float]:
    import cube
    import torch
    os.environ["CUBE_FUSED_CUT"] = "1" if fused else "0"
    loader = iter(lambda: batch, None)

    @cube.compile(model, loader, PAS="cube.policies.single:PASSingle", cache_dir=cache, precision=precision)
    def train_iter(model, dataloader):
        ids, labels = next(dataloader)
        loss = model(ids, labels)
        loss.backward()
        return loss
    gen = cube.load_model()
    opt = cube.build_optimizer(gen, torch.optim.AdamW, lr=1e-4)
    os.environ.pop("CUBE_FUSED_CUT")

    def step():
        loss = train_iter(gen, loader)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


def _one(name: str, cuda: bool, quick: bool) -> List[dict]:
    import torch
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    sizes = dict((GPU if cuda else CPU)[name])
    if quick and cuda:
        sizes = {**sizes, **({"n_layer": 4} if name == "gpt2" else {"num_hidden_layers": 4})}
    seq, bsz = (1024, 8) if cuda else (64, 4)
    precision, dtype = ("bf16", torch.bfloat16) if cuda else (None, None)
    torch.manual_seed(0)
    base = _build(name, sizes)
    vocab = sizes["vocab_size"]
    ids = torch.randint(0, vocab, (bsz, seq), device=dev)
    batch = (ids, ids.clone())
    eager = copy.deepcopy(base).to(dev)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-4)

    def eager_step():
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = eager(*batch)
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad(set_to_none=True)
        return loss.detach()

    steps: Dict[str, Callable] = {"torch eager": eager_step}
    losses: Dict[str, List[float]] = {}
    with tempfile.TemporaryDirectory() as cache:
        steps["cube"] = _cube_step(copy.deepcopy(base).to(dev), batch, cache, precision, fused=True)
        steps["cube, no fused cut"] = _cube_step(copy.deepcopy(base).to(dev), batch, cache, precision, fused=False)
        times: Dict[str, List[float]] = {k: [] for k in steps}
        n, rounds = (5, 2) if quick else (10, 3)
        for _ in range(rounds):
            for k, step in steps.items():
                for i in range(n + 2):   # two warm-up steps
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    loss = step()
                    if cuda:
                        torch.cuda.synchronize()
                    if i >= 2:
                        times[k].append(time.perf_counter() - t0)
                    losses.setdefault(k, []).append(float(loss))
    med = {k: statistics.median(v) for k, v in times.items()}
    # every way took the same steps from the same weights on the same batch
    diff = max(abs(a - b) / max(abs(b), 1e-12) for k in ("cube", "cube, no fused cut")
               for a, b in zip(losses[k], losses["torch eager"]))
    where = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"{name}: {sizes}, batch {bsz}, T{seq}, {precision or 'float32'}, {where}")
    print("  " + ", ".join(f"{k} {med[k] * 1e3:.1f} ms/step" for k in steps))
    ratio, cut = med["cube"] / med["torch eager"], med["cube"] / med["cube, no fused cut"]
    print(f"  cube / torch eager {ratio:.3f}, fused cut / no cut {cut:.3f}; largest relative loss difference "
          f"from the plain model: {diff:.1e}")
    rows = [{"benchmark": "hf_models", "name": f"{name} {k}", "ms_per_step": med[k] * 1e3} for k in steps]
    rows += [{"benchmark": "hf_models", "name": f"{name} cube / torch eager", "time_ratio": ratio, "device": where},
             {"benchmark": "hf_models", "name": f"{name} fused cut / no cut", "time_ratio": cut,
              "loss_rel_diff": diff}]
    return rows


def main(quick: bool = False, cpu: bool = False, models: str = "gpt2,llama") -> List[dict]:
    """Runs the comparison for each model; returns the rows (ms per step, the ratios)."""
    os.environ["SINGLE_DEV_MODE"] = "1"
    if cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""   # before CUDA starts: cube's device follows it
    import torch
    cuda = torch.cuda.is_available() and not cpu
    rows: List[dict] = []
    for name in models.split(","):
        rows += _one(name, cuda, quick)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer layers and steps")
    p.add_argument("--cpu", action="store_true", help="the tiny CPU run even where CUDA is available")
    p.add_argument("--models", default="gpt2,llama")
    main(**vars(p.parse_args()))
