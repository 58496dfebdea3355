"""Expert parallel on a Hugging Face Mixtral: cube ep4 against cube data parallel, 4 ranks.

    python -m benchmarks.moe [--quick] [--layers 2] [--hidden 256] [--steps 4]

A Mixtral-shaped model (``transformers.MixtralConfig``: 8 experts, top-2, hidden 256, 2 layers,
Transformers' default ``grouped_mm`` experts kernel), a global batch of 8 sequences of 64 tokens,
AdamW, 4 gloo ranks under torchrun:

- under ``PASData``, the MoE layers fused into one ``moe_experts`` call each (every rank runs its
  own tokens through every expert) and the ops that run on gathered tokens (planned in process);
- step time, ``PASMegatron(ep=4)`` (each rank holds 2 of the 8 experts; tokens reach them by
  all-to-all) against ``PASData`` (every rank holds every expert): the slowest rank's median;
- parameter + optimizer bytes per rank, measured on the generated modules after an AdamW step;
- the experts' all-to-all bytes per step, counted in the runtime
  (``cube.runtime.experts.traffic``: the rows each rank sent to other ranks, summed over ranks),
  against the formula from the step's token counts: the (token, expert) pairs whose expert lives
  on another rank than the token (from the router's top-k ids of the plain model on the same
  batch), times hidden x 4 bytes, times 2 (dispatch and combine), times 2 (forward and backward).

Torch's own expert parallel: torch 2.13 has none (``torch.distributed`` offers the building blocks,
``all_to_all_single`` with split sizes and, on CUDA with NVSHMEM, ``symm_mem``'s
``all_to_all_vdev_2d``; torchtitan's expert parallel is not part of torch). The output says so.

The ranks are processes sharing this machine's CPU cores: step times measure overheads, not speed-ups.
"""
from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._torchrun import compile_gpt, run_rows, worker_cli  # noqa: E402

DEFAULTS = {"layers": 2, "hidden": 256, "experts": 8, "topk": 2, "seq": 64, "batch": 8, "vocab": 512,
            "steps": 4, "ep": 4}
QUICK = {"steps": 2}
TORCH_EP = ("torch 2.13 has no expert parallel: torch.distributed offers all_to_all_single (split sizes) and, "
            "on CUDA with NVSHMEM, symm_mem.all_to_all_vdev_2d, not an MoE layer or plan; torchtitan's is not torch")


class _LM(torch.nn.Module):
    """The Hugging Face model whose forward returns its own loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        return self.model(ids, labels=labels).loss


def _model(cfg):
    import transformers
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=2 * cfg["hidden"],
        num_hidden_layers=cfg["layers"], num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=cfg["experts"], num_experts_per_tok=cfg["topk"], max_position_embeddings=cfg["seq"])
    return _LM(transformers.MixtralForCausalLM(config))


def _batches(cfg, n):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
        out.append((ids, ids.clone()))
    return out


def _timed(step, n: int) -> float:
    """The slowest rank's median time of ``step`` (one warm-up)."""
    step()
    times = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def _state_bytes(gen, opt) -> int:
    params = sum(p.numel() * p.element_size() for p in gen.parameters())
    state = sum(s.numel() * s.element_size() for p in gen.parameters() for s in opt.state[p].values()
                if torch.is_tensor(s) and s.ndim > 0)
    return params + state


def remote_pairs(model, batch, ranks: int, experts: int) -> int:
    """The (token, expert) pairs of ``batch`` whose expert is held by another rank than the token,
    under ``ranks``-way expert parallel (rank ``q`` holds experts ``[q E / n, (q + 1) E / n)`` and
    the batch's ``q``-th block of tokens), from the router's top-k ids of the plain model."""
    ids_per_layer = []
    hooks = [m.register_forward_hook(lambda mod, args, out: ids_per_layer.append(out[2]))
             for m in model.modules() if type(m).__name__ == "MixtralTopKRouter"]
    with torch.no_grad():
        model(*batch)
    for h in hooks:
        h.remove()
    pairs = 0
    for ids in ids_per_layer:
        tokens = ids.shape[0]
        home = torch.arange(tokens).unsqueeze(1) // (tokens // ranks)
        pairs += int((ids // (experts // ranks) != home).sum())
    return pairs


def data_plan(cfg) -> tuple:
    """Under ``PASData`` on ``ep`` ranks (planned in this process): the fused MoE calls in rank 0's
    code (each runs the rank's own tokens through every expert) and the ops that lose the batch
    split (run whole on the gathered tokens)."""
    import cube
    from cube.policies.data import PASData
    plan = cube.plan(_model(cfg), _batches(cfg, 1)[0], PASData, cfg["ep"])
    return plan.source(0).count("runtime.experts.moe("), len(plan.lost)


def worker(args) -> None:
    """One rank of a torchrun job (``--mode ep``: ``PASMegatron(ep=)``; ``data``: ``PASData``)."""
    from cube.policies.data import PASData
    from cube.policies.megatron3d import PASMegatron
    from cube.runtime import experts
    cfg, rank = vars(args), int(os.environ.get("RANK", "0"))
    policy = functools.partial(PASMegatron, tp=1, pp=1, nmicros=1, ep=cfg["ep"]) if cfg["mode"] == "ep" else PASData
    batches = _batches(cfg, cfg["steps"] + 3)
    it = iter(batches)
    train_iter, gen = compile_gpt(_model(cfg), it, policy, args.cache)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
    experts.traffic(reset=True)

    def step():
        train_iter(gen, it)
        opt.step()
        opt.zero_grad()
    step()   # the first batch: its all-to-all bytes, against the formula on the same batch
    row = {"rank": rank, "a2a": experts.traffic(reset=True), "bytes": _state_bytes(gen, opt)}
    row["step"] = _timed(step, cfg["steps"])
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()   # no rank leaves while another still talks to it


def main(quick: bool = False, **overrides):
    cfg = dict(DEFAULTS, **(QUICK if quick else {}), **overrides)
    n, h = cfg["ep"], cfg["hidden"]
    ep = run_rows(Path(__file__), dict(cfg, nproc=n, mode="ep"))
    data = run_rows(Path(__file__), dict(cfg, nproc=n, mode="data"))
    remote = remote_pairs(_model(cfg), _batches(cfg, 1)[0], n, cfg["experts"])
    formula = remote * h * 4 * 2 * 2
    measured = sum(r["a2a"] for r in ep)
    ep_t, data_t = ep[0]["step"], data[0]["step"]
    ep_b, data_b = max(r["bytes"] for r in ep), max(r["bytes"] for r in data)
    fused, gathered = data_plan(cfg)
    rows = [
        {"benchmark": "moe", "name": "data parallel MoE layers fused / layers", "ratio": fused / cfg["layers"],
         "detail": f"{fused} moe_experts calls per rank on its own tokens; {gathered} ops run on gathered tokens"},
        {"benchmark": "moe", "name": "step time", "ratio": ep_t / data_t,
         "detail": f"ep{n} {ep_t * 1e3:.1f} ms / data parallel {data_t * 1e3:.1f} ms"},
        {"benchmark": "moe", "name": "parameter + AdamW bytes per rank", "ratio": ep_b / data_b,
         "detail": f"ep{n} {ep_b / 2**20:.2f} MiB / data parallel {data_b / 2**20:.2f} MiB"},
        {"benchmark": "moe", "name": "all-to-all bytes per step, measured / formula", "ratio": measured / formula,
         "detail": f"{measured} B / {formula} B ({remote} pairs leave their rank x {h} x 4 B x 2 x 2)"},
        {"benchmark": "moe", "name": "torch expert parallel", "ratio": "n/a", "detail": TORCH_EP},
    ]
    print(f"Mixtral {cfg['layers']} layers, hidden {h}, {cfg['experts']} experts top-{cfg['topk']}, batch "
          f"{cfg['batch']} x {cfg['seq']} tokens, AdamW, {n} gloo ranks")
    for r in rows:
        v = r["ratio"]
        print(f"  {r['name']:<48} {v:>8.3f}   {r['detail']}" if isinstance(v, float) else
              f"  {r['name']:<48} {v:>8}   {r['detail']}")
    return rows


if __name__ == "__main__":
    sys.exit(worker_cli(__doc__, dict(DEFAULTS, mode="ep"), "2 timed steps", worker,
                        lambda quick, **kw: main(quick, **{k: v for k, v in kw.items() if k != "mode"})))
