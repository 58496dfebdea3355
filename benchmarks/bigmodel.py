"""A model that does not fit one rank: a Hugging Face Llama built on the meta device, tp2 x pp2 on 4 ranks.

    python -m benchmarks.bigmodel [--quick] [--size medium] [--tp 2 --pp 2]

The full size is a ~0.85B-parameter Llama (hidden 2048, 16 layers, intermediate
5632, 16 heads, 4 KV heads, vocab 32000, float32), sequence 256, a global batch
of 4 taken as 2 micro-batches of 2 by ``PASMegatron(tp=2, pp=2, nmicros=2)`` (1F1B),
AdamW through ``cube.build_optimizer``, 2 steps; ``--quick`` is a small Llama
through the same code. The run:

1. writes the model's weights as Hugging Face sharded safetensors
   (``model.safetensors.index.json``), streamed: the meta model's modules are
   visited in ``model.apply`` order from a fixed seed, one module materialized
   and initialized at a time, so the file equals ``load_model(init=)`` from the
   same seed and no process ever holds the whole model;
2. launches 4 ranks under torchrun (gloo, CPU). Each compiles the meta model,
   loads it with ``cube.load_model(init=model._init_weights)`` (timed), frees
   it and loads again from the safetensors (timed; its pieces must equal the
   init's), trains 2 steps, and reports its memory: peak RSS (``ru_maxrss``),
   RSS right after the load (``VmRSS``), the peak after each phase (to tell
   which phase sets it), the bytes of parameters, gradients and AdamW state
   (``cube.runtime.memory.report``) and of activations saved for backward
   (``SavedActivations``);
3. after the ranks exit, computes step 1's loss in one process from the
   safetensors (the whole model, alone on the machine) and compares.

A rank's share is its parameters + gradients + AdamW state; the targets are a
peak RSS of at most 1.3 x share + 0.5 GB and an RSS right after the load of at
most 2.5 GB (at ``--quick`` size the interpreter's fixed cost dominates both).

``--size medium`` (hidden 1024, 8 layers, vocab 32000: 0.16B) and ``--tp``/``--pp``
(``tp x pp`` dividing 4; the rest data parallel) vary the plan; each run also
prints the RSS of a process that has only imported torch (the baseline every
rank pays before holding anything) and each rank's peak above it, what
``python -m cube.sim benchmarks/bigmodel.py:build_medium --policy PASMegatron
--option tp=2 --option pp=2 --option nmicros=2 --ngpus 4 --json`` predicts per
rank (``build``, ``build_medium``, ``build_quick``: the model, built on the CPU,
and one global batch).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Dict, List

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:   # python benchmarks/bigmodel.py as well as python -m benchmarks.bigmodel
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import run_rows  # noqa: E402
from examples.bigmodel.model import CausalLM  # noqa: E402

GB = 1e9
SEED = 1234
SIZES = {
    "full": dict(hidden=2048, layers=16, intermediate=5632, heads=16, kv_heads=4, vocab=32000, seq=256),
    "medium": dict(hidden=1024, layers=8, intermediate=2816, heads=8, kv_heads=2, vocab=32000, seq=256),
    "quick": dict(hidden=256, layers=4, intermediate=704, heads=8, kv_heads=2, vocab=4096, seq=128),
}
NMICROS, MICRO_BATCH, STEPS, LR = 2, 2, 2, 1e-4   # micro-batches of 2: torch.export specializes dims of size 1
SHARD_BYTES = {"full": 1 << 30, "medium": 256 << 20, "quick": 4 << 20}
NPROC = 4


# ---------------------------------------------------------------------- the model
def llama_config(size: str):
    from transformers import LlamaConfig
    s = SIZES[size]
    # eager attention: the same math traced and in the single-process reference
    return LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                       num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                       num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"], use_cache=False,
                       attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="eager")


def meta_model(size: str) -> CausalLM:
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return CausalLM(LlamaForCausalLM(llama_config(size)))


def batches(size: str, n: int) -> List[tuple]:
    """``n`` global batches of ``NMICROS x MICRO_BATCH`` sequences (the pipeline cuts each into ``NMICROS``)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.cat([torch.randint(0, SIZES[size]["vocab"], (MICRO_BATCH, SIZES[size]["seq"]), generator=gen)
                         for _ in range(NMICROS)])
        out.append((ids, ids.clone()))
    return out


def policy(tp: int = 2, pp: int = 2):
    import functools

    from cube.policies.megatron3d import PASMegatron
    return functools.partial(PASMegatron, tp=tp, pp=pp, nmicros=NMICROS)


def _build(size: str):
    """``size``'s Llama on the CPU (initialized) and one global batch: a ``python -m cube.sim`` spec."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(SEED)
    return CausalLM(LlamaForCausalLM(llama_config(size))), batches(size, 1)[0]


def build():
    return _build("full")


def build_medium():
    return _build("medium")


def build_quick():
    return _build("quick")


def baseline_rss() -> int:
    """Peak RSS of a fresh process that imports torch (and this module) only: what every rank pays first.

    Read from ``VmHWM``: ``ru_maxrss`` survives ``exec``, so a child started from this process
    would report this process's peak."""
    code = "import torch, benchmarks.bigmodel as b; print(b.rss_peak())"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout)


# ---------------------------------------------------------------------- memory probes
def rss_now() -> int:
    """This process's resident bytes now (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_peak() -> int:
    """This process's peak resident bytes so far (``VmHWM``; ``ru_maxrss`` where there is none, which
    also counts the launcher's peak before ``exec``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------- the weights file, streamed
def write_weights(size: str, folder: Path, seed: int = SEED) -> float:
    """Writes the Hugging Face sharded safetensors of ``size``'s Llama as ``load_model(init=)`` from
    ``seed`` makes it: modules in ``model.apply`` order, each materialized, initialized, written and
    freed in turn (a shard is written when it holds ``SHARD_BYTES``).

    Returns:
        Seconds taken.
    """
    import safetensors.torch

    from cube.runtime.materialize import visit_order
    start = time.perf_counter()
    hf = meta_model(size).model
    folder.mkdir(parents=True, exist_ok=True)
    persistent = set(hf.state_dict(keep_vars=True))
    torch.manual_seed(seed)
    shard: Dict[str, torch.Tensor] = {}
    names_of: List[List[str]] = []
    total = 0

    def flush():
        if shard:
            name = f"part-{len(names_of):05d}.safetensors"
            safetensors.torch.save_file(shard, str(folder / name), metadata={"format": "pt"})
            names_of.append([name] + list(shard))
            shard.clear()

    with torch.no_grad():
        for path, m in visit_order(hf):
            own = [(store, k, t) for store in (m._parameters, m._buffers) for k, t in store.items() if t is not None]
            for store, k, t in own:   # to_empty, this module only
                empty = torch.empty_like(t, device="cpu")
                store[k] = torch.nn.Parameter(empty, t.requires_grad) if isinstance(t, torch.nn.Parameter) else empty
            hf._init_weights(m)
            for store, k, t in own:
                name = f"{path}.{k}" if path else k
                if name in persistent:
                    shard[name] = store[k].detach()
                    total += store[k].nbytes
                store[k] = t   # back to meta: the shard holds the value until it is written
            if sum(v.nbytes for v in shard.values()) >= SHARD_BYTES[size]:
                flush()
        flush()
    count = len(names_of)
    weight_map = {}
    for i, (name, *keys) in enumerate(names_of):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(folder / name, folder / final)
        weight_map.update({k: final for k in keys})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    llama_config(size).save_pretrained(folder)
    return time.perf_counter() - start


# ---------------------------------------------------------------------- one rank
def worker(args) -> None:
    import torch.distributed as dist

    import cube
    from cube.runtime.memory import SavedActivations, report
    peaks = {"start": rss_peak()}
    env = cube.init()
    size, weights = args.size, args.weights
    model = meta_model(size)
    loader = iter(batches(size, STEPS))
    start = time.perf_counter()

    @cube.compile(model, loader, PAS=policy(args.tp, args.pp), cache_dir=args.cache)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss
    t_compile = time.perf_counter() - start
    gc.collect()
    peaks["compile"], rss_compiled = rss_peak(), rss_now()

    torch.manual_seed(SEED)
    start = time.perf_counter()
    gen = cube.load_model(init=model.model._init_weights)
    t_init = time.perf_counter() - start
    peaks["load init"], rss_loaded = rss_peak(), rss_now()
    sums = {k: v.detach().double().sum().item() for k, v in gen.state_dict().items()}
    alive = weakref.ref(next(gen.parameters()))
    del gen
    gc.collect()
    freed = {"rss": rss_now(), "module_alive": alive() is not None}

    start = time.perf_counter()
    gen = cube.load_model(weights=weights, init=model.model._init_weights, rename=lambda k: "model." + k)
    t_weights = time.perf_counter() - start
    peaks["load weights"], rss_loaded_weights = rss_peak(), rss_now()
    same = all(v.detach().double().sum().item() == sums[k] for k, v in gen.state_dict().items())

    opt = cube.build_optimizer(gen, torch.optim.AdamW, lr=LR)
    losses, step_s, held, saved = [], [], {}, 0
    for i in range(STEPS):
        start = time.perf_counter()
        with SavedActivations(exclude=list(gen.parameters())) as acts:
            losses.append(train_iter(gen, loader).item())
        opt.step()
        step_s.append(time.perf_counter() - start)
        if i == 0:
            held, saved = report(gen, opt), acts.bytes   # gradients still held, AdamW state made
        opt.zero_grad()
        peaks[f"step {i + 1}"] = rss_peak()
    part = cube.runtime.data.part()
    row = {"rank": env.rank, "losses": losses, "t_compile": t_compile, "t_init": t_init, "t_weights": t_weights,
           "step_s": step_s, "weights_equal_init": same, "rss_compiled": rss_compiled, "rss_loaded": rss_loaded,
           "rss_loaded_weights": rss_loaded_weights, "after_free": freed, "peak": rss_peak(), "peaks": peaks,
           "params": held["params"], "grads": held["grads"], "optimizer": held["optimizer"], "activations": saved,
           "reads_batch": part.reads}
    rows = [None] * env.world_size
    dist.all_gather_object(rows, row)
    if env.rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)


# ---------------------------------------------------------------------- the single-process reference
def reference_loss(size: str, weights: str) -> float:
    """Step 1's loss (on its whole global batch) of the model in ``weights``, in this process."""
    import safetensors.torch
    model = meta_model(size)
    hf = model.model
    index = json.loads((Path(weights) / "model.safetensors.index.json").read_text())
    for name in sorted(set(index["weight_map"].values())):
        hf.load_state_dict(safetensors.torch.load_file(str(Path(weights) / name)), strict=False, assign=True)
    rotary = hf.model.rotary_emb   # its buffers are not in the file (non-persistent): computed by init
    rotary.to_empty(device="cpu")
    hf._init_weights(rotary)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not meta, meta
    with torch.no_grad():
        return model(*batches(size, 1)[0]).item()


# ---------------------------------------------------------------------- the driver
def _row(r: dict, baseline: int) -> dict:
    share = r["params"] + r["grads"] + r["optimizer"]
    target_peak = 1.3 * share + 0.5 * GB
    return {"benchmark": "bigmodel", "name": f"rank {r['rank']}", "peak_gb": r["peak"] / GB,
            "peak_above_baseline_gib": (r["peak"] - baseline) / 2**30,
            "peak_above_compiled_gib": (r["peak"] - r["rss_compiled"]) / 2**30,
            "rss_after_load_gb": r["rss_loaded"] / GB, "params_gb": r["params"] / GB, "grads_gb": r["grads"] / GB,
            "adam_gb": r["optimizer"] / GB, "activations_gb": r["activations"] / GB, "share_gb": share / GB,
            "target_peak_gb": target_peak / GB, "peak_target_ratio": r["peak"] / target_peak,
            "load_target_ratio": r["rss_loaded"] / (2.5 * GB), "peak_phase": max(r["peaks"], key=r["peaks"].get),
            "peaks_gb": {k: v / GB for k, v in r["peaks"].items()}, "t_compile_s": r["t_compile"],
            "t_init_s": r["t_init"], "t_weights_s": r["t_weights"], "step_s": r["step_s"],
            "weights_equal_init": r["weights_equal_init"], "loss": r["losses"][0],
            "rss_after_free_gb": r["after_free"]["rss"] / GB, "module_alive_after_free": r["after_free"]["module_alive"]}


def table(rows: List[dict], extra: dict) -> str:
    out = ["| rank | peak RSS GB | RSS after load GB | params | grads | Adam | activations | share | "
           "peak / (1.3 share + 0.5) | after load / 2.5 | peak set by | init s | safetensors s | step s |",
           "|" + "---|" * 14]
    for r in rows:
        out.append(f"| {r['name'][5:]} | {r['peak_gb']:.2f} | {r['rss_after_load_gb']:.2f} | {r['params_gb']:.2f} | "
                   f"{r['grads_gb']:.2f} | {r['adam_gb']:.2f} | {r['activations_gb']:.3f} | {r['share_gb']:.2f} | "
                   f"{r['peak_target_ratio']:.2f} | {r['load_target_ratio']:.2f} | {r['peak_phase']} | "
                   f"{r['t_init_s']:.1f} | {r['t_weights_s']:.1f} | "
                   f"{' / '.join(f'{s:.1f}' for s in r['step_s'])} |")
    out.append("")
    out.append(f"parameters {extra['nparams'] / 1e9:.3f} B; compile {extra['t_compile_s']:.1f} s (rank 0); "
               f"safetensors written in {extra['t_write_s']:.1f} s; step-1 loss {extra['loss']:.6f}, single "
               f"process {extra['ref_loss']:.6f} (rel {extra['loss_rel']:.1e}); weights file equals init on every "
               f"rank: {extra['weights_equal_init']}")
    return "\n".join(out)


def run(size: str = "full", tp: int = 2, pp: int = 2) -> List[dict]:
    """Writes the weights, runs the 4 ranks, checks step 1's loss against one process; returns the rows."""
    with tempfile.TemporaryDirectory(prefix="cube-bigmodel-") as tmp:
        folder = Path(tmp) / "weights"
        t_write = write_weights(size, folder)
        gc.collect()
        # glibc raises its mmap threshold (up to 32 MiB) after the first large free, and tensors below it
        # then come from heaps that keep freed memory: a fixed threshold returns every freed piece
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        # and cube.init() must not raise it again (its default keeps freed memory for speed)
        os.environ.setdefault("CUBE_CPU_MALLOC", "system")
        ranks = run_rows(Path(__file__), {"nproc": NPROC, "size": size, "weights": str(folder), "tp": tp, "pp": pp})
        # the reference after the ranks exit, in its own process: it holds the whole model
        out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--reference", "--size", size,
                              "--weights", str(folder)], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            raise RuntimeError(f"the single-process reference failed:\n{out.stderr[-3000:]}")
        ref = float(out.stdout.strip().splitlines()[-1])
    baseline = baseline_rss()
    rows = [_row(r, baseline) for r in sorted(ranks, key=lambda r: r["rank"])]
    loss = ranks[0]["losses"][0]
    nparams = sum(p.numel() for p in meta_model(size).parameters())
    extra = {"nparams": nparams, "t_compile_s": ranks[0]["t_compile"], "t_write_s": t_write, "loss": loss,
             "baseline_rss_gib": baseline / 2**30,
             "ref_loss": ref, "loss_rel": abs(loss - ref) / abs(ref),
             "weights_equal_init": all(r["weights_equal_init"] for r in ranks)}
    print(f"Llama {size}: {SIZES[size]}, tp{tp} x pp{pp} x dp{NPROC // (tp * pp)} on {NPROC} ranks (gloo, CPU), "
          f"{NMICROS} micro-batches of {MICRO_BATCH}, AdamW, {STEPS} steps")
    print(table(rows, extra))
    print(f"baseline (a process that imported torch): {baseline / 2**30:.3f} GiB; peak above it per rank (GiB): "
          + ", ".join(f"{r['peak_above_baseline_gib']:.3f}" for r in rows) + "; above the rank's RSS after "
          "compile (imports and plan, no tensors): " + ", ".join(f"{r['peak_above_compiled_gib']:.3f}" for r in rows))
    rows.append({"benchmark": "bigmodel", "name": "summary", **extra,
                 "max_peak_target_ratio": max(r["peak_target_ratio"] for r in rows),
                 "max_load_target_ratio": max(r["load_target_ratio"] for r in rows)})
    return rows


def main(quick: bool = False, size: str = None, tp: int = 2, pp: int = 2) -> List[dict]:
    rows = run(size or ("quick" if quick else "full"), tp, pp)
    summary = rows[-1]
    if summary["loss_rel"] > 1e-4:
        raise RuntimeError(f"step 1's loss {summary['loss']} differs from the single-process one "
                           f"{summary['ref_loss']} (rel {summary['loss_rel']:.1e} > 1e-4)")
    if not summary["weights_equal_init"]:
        raise RuntimeError("the pieces loaded from the safetensors differ from load_model(init=) from the same seed")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small Llama through the same code (< 2 minutes)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, choices=sorted(SIZES), help="the model (default full; --quick: quick)")
    ap.add_argument("--tp", type=int, default=2, help="tensor parallel degree (tp x pp divides 4)")
    ap.add_argument("--pp", type=int, default=2, help="pipeline stages")
    ap.add_argument("--weights", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
    elif a.reference:
        print(reference_loss(a.size, a.weights))
    else:
        result = main(quick=a.quick, size=a.size, tp=a.tp, pp=a.pp)
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=1))
