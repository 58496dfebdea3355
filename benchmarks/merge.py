"""Peak memory of merging a checkpoint: streamed into safetensors vs. into state dicts.

    python -m benchmarks.merge [--quick] [--hidden H] [--layers L]

A Hugging Face Llama (untied, vocabulary 32000; hidden 512 and 2 layers, about
a minute on a 2-core CPU; hidden 256 and 1 layer with --quick; larger with
--hidden/--layers, e.g. 2048 and 16: 0.88B) is compiled under Megatron TP on 2 ranks
(in one process, ``cube.debug.run``), trained one AdamW step and saved. Each
merge then runs in a fresh process, which reports its peak resident memory
(``VmHWM``, reset after its imports; Linux) above what it held then:

- ``out=dir``: sharded safetensors for ``from_pretrained``, one tensor at a time
  (target: at most the largest tensor + 10% of the model's bytes);
- ``state dicts``: ``merge_checkpoint(path)`` returning the model and optimizer
  state, which holds all of it (for comparison).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MB = 2 ** 20
_MEASURE = r"""
import json, re, sys
import cube
from cube.runtime.checkpoint import merge_checkpoint


def kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


with open("/proc/self/clear_refs", "w") as f:   # resets the peak (VmHWM) to what is resident now
    f.write("5")
before = kib("VmRSS")
if sys.argv[2] == "out":
    merge_checkpoint(sys.argv[1], out=sys.argv[3], strip_prefix="m.", max_shard_size="200MB")
else:
    state, opt_state = merge_checkpoint(sys.argv[1])
print(json.dumps({"peak_kib": kib("VmHWM") - before}))
"""


def _llama(hidden: int, layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class Wrapped(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids, labels):
            return self.m(input_ids=ids, labels=labels).loss

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=64, use_cache=False, tie_word_embeddings=False,
                      attn_implementation="eager")
    torch.manual_seed(0)
    return Wrapped(LlamaForCausalLM(cfg))


def _save(ckpt: Path, cache: Path, hidden: int, layers: int):
    """Each rank: compile under Megatron TP, one AdamW step, save; returns the model's tensor sizes."""
    import torch

    import cube
    model = _llama(hidden, layers)
    ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(1))
    loader = iter([(ids, ids)] * 2)

    @cube.compile(model, loader, PAS="cube.policies.megatron:PASMegatronTP", cache_dir=cache)
    def train_iter(model, dataloader):
        ids, labels = next(dataloader)
        loss = model(ids, labels)
        loss.backward()
        return loss

    gen = cube.load_model(train_iter)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
    train_iter(gen, loader)
    opt.step()
    cube.save_checkpoint(ckpt, gen, opt)
    return [t.numel() * t.element_size() for t in model.state_dict().values()]


def main(quick: bool = False, hidden: int = 0, layers: int = 0):
    import cube.debug
    hidden, layers = hidden or (256 if quick else 512), layers or (1 if quick else 2)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        sizes = cube.debug.run(lambda: _save(tmp / "ckpt", tmp / "cache", hidden, layers), 2)[0]
        saved = time.perf_counter() - start
        model_mb, largest_mb = sum(sizes) / MB, max(sizes) / MB
        target = largest_mb + 0.1 * model_mb
        print(f"compile, one step and save on 2 ranks: {saved:.1f} s")
        print(f"merge peak memory (Llama hidden {hidden}, {layers} layers, {model_mb:.0f} MB of weights, "
              f"largest tensor {largest_mb:.0f} MB, checkpoint with AdamW state; target for out=: largest + 10% "
              f"of the model = {target:.0f} MB)")
        print(f"{'merge':<14}{'peak MB':>10}{'model MB':>10}{'largest MB':>12}{'target MB':>11}{'peak/target':>13}"
              f"{'seconds':>9}")
        for how in ("out", "state dicts"):
            start = time.perf_counter()
            cmd = [sys.executable, "-c", _MEASURE, str(tmp / "ckpt"), how.split()[0], str(tmp / "hf")]
            res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            if res.returncode:
                raise RuntimeError(f"benchmarks.merge: the merge failed:\n{res.stderr[-3000:]}")
            seconds = time.perf_counter() - start
            peak = json.loads(res.stdout.strip().splitlines()[-1])["peak_kib"] / 1024
            row = {"benchmark": "merge", "name": f"merge ({how})", "peak_mb": round(peak, 1),
                   "model_mb": round(model_mb, 1), "largest_tensor_mb": round(largest_mb, 1),
                   "target_mb": round(target, 1), "peak_target_ratio": round(peak / target, 3),
                   "seconds": round(seconds, 1)}
            if how == "out":
                row["target"] = "<= 1"
            rows.append(row)
            print(f"{how:<14}{peak:>10.0f}{model_mb:>10.0f}{largest_mb:>12.0f}{target:>11.0f}{peak / target:>13.2f}"
                  f"{seconds:>9.1f}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model")
    parser.add_argument("--hidden", type=int, default=0, help="hidden size (default 512, 256 with --quick)")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (default 2, 1 with --quick)")
    args = parser.parse_args()
    main(args.quick, args.hidden, args.layers)
