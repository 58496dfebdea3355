"""Context parallel GPT (ring attention): memory per rank, K/V bytes, load balance, torch's CP.

    python -m benchmarks.ring_attention [--quick] [--seq 4096] [--cp 4] [--steps 4]

A tiny-width GPT (2 layers, 32 wide, 2 heads, causal) on one sequence of 4096 tokens, AdamW:

- memory: the activation bytes a rank keeps for backward (``saved_tensors_hooks``, parameters
  excluded) under ``PASContext(cp=4)`` against the single-device model (cp 1; target <= 0.35x);
- K/V bytes a rank sends per layer, measured at the ring's sends, next to the formula
  ``(cp - 1) / cp x`` the layer's whole K and V (forward), the backward's (K and V again, their
  gradients one more hop) and the zigzag reordering's, apart;
- load balance: ``cube.runtime.ring.attention`` forward and backward on each rank's block, zigzag
  against contiguous blocks (a rank's chunk pairs: 2 cp + 1 against 4 p + 3): the slowest rank's
  wall time (ranks sharing cores: the total work, equal both ways, decides it) and the busiest
  rank's CPU time (what ranks with a device each would wait for);
- step time of cube cp 4 against one process, and torch's
  ``torch.distributed.tensor.experimental.context_parallel`` if it runs here (on CPU it does not:
  DTensor has no sharding rule for the CPU flash-attention kernel; the row says so).

The ranks are processes sharing this machine's CPU cores: step times measure overheads, not speed-ups.
"""
from __future__ import annotations

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

from benchmarks._torchrun import compile_gpt, kept_bytes, run_rows, worker_cli  # noqa: E402

DEFAULTS = {"seq": 4096, "cp": 4, "steps": 4, "layers": 2, "width": 32, "heads": 2, "vocab": 128}
QUICK = {"seq": 1024, "steps": 2}


def _model(cfg):
    from examples.gpt.model import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=cfg["vocab"], block_size=cfg["seq"], n_layer=cfg["layers"], n_head=cfg["heads"],
                         n_embd=cfg["width"], bias=False))


def _batches(cfg, n):
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, cfg["vocab"], (1, cfg["seq"]), generator=gen)
        out.append((ids, torch.roll(ids, -1, dims=1)))
    return out


def _timed(steps, n: int, clock=time.perf_counter):
    """Median time of each of ``steps`` (timed in alternation; with a barrier when distributed, the
    slowest rank's). ``clock=time.process_time``: the CPU time a rank spends, what a rank with a
    device of its own would wait for, where ranks share the cores."""
    for step in steps:
        step()   # warm-up
    times = [[] for _ in steps]
    for _ in range(n):
        for k, step in enumerate(steps):
            if dist.is_initialized():
                dist.barrier()
            t0 = clock()
            step()
            if dist.is_initialized():   # the slowest rank's time: the ring waits for it
                t = torch.tensor([clock() - t0])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[k].append(t.item())
            else:
                times[k].append(clock() - t0)
    return [statistics.median(t) for t in times]


def _count_ring_bytes():
    """Wraps the ring's sends to count the bytes this rank sends, by message kind."""
    from cube.runtime import ring
    sent = {ring.TAG_KV: 0, ring.TAG_GRAD: 0, ring.TAG_CHUNK: 0}
    original = ring._post

    def counting(sends, recvs, tag):
        sent[tag] += sum(t.numel() * t.element_size() for _, t in sends)
        return original(sends, recvs, tag)
    ring._post = counting
    return sent


def _balance(cfg):
    """Forward and backward of the ring op alone on this rank's block, zigzag vs contiguous."""
    from cube.runtime import ring
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    hd, block = cfg["width"] // cfg["heads"], cfg["seq"] // world
    q, k, v = (torch.randn(1, cfg["heads"], block, hd, generator=g, requires_grad=True) for _ in range(3))

    def run(balance):
        def step():
            out = ring.attention(q, k, v, ranks=tuple(range(world)), pos=rank, causal=True, balance=balance)
            out.sum().backward()
        return step
    steps = [run(True), run(False)]
    return _timed(steps, cfg["steps"] + 2) + _timed(steps, cfg["steps"] + 2, clock=time.process_time)


def _torch_cp(cfg):
    """torch's context parallel on the same model and sequence, or why it does not run."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = _model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = _batches(cfg, cfg["steps"] + 2)
        it = iter(batches)

        def step():
            ids, tgt = (t.clone() for t in next(it))
            with context_parallel(mesh, buffers=[ids, tgt], buffer_seq_dims=[1, 1]):
                model(ids, tgt).backward()
            opt.step()
            opt.zero_grad()
        return {"torch_cp": _timed([step], cfg["steps"])[0]}
    except Exception as e:   # noqa: BLE001 - the row reports it
        return {"torch_cp_error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}


def worker(args) -> None:
    """One rank of a torchrun job (``--mode cp``: cube's plan; ``torch``: torch's context parallel)."""
    import functools

    from cube.policies.context import PASContext
    cfg, rank = vars(args), int(os.environ.get("RANK", "0"))
    row = {"rank": rank}
    if cfg["mode"] == "torch":
        dist.init_process_group("gloo")
        row.update(_torch_cp(cfg))
    else:
        batches = _batches(cfg, cfg["steps"] + 4)
        it = iter(batches)
        train_iter, gen = compile_gpt(_model(cfg), it, functools.partial(PASContext, cp=cfg["cp"]), args.cache)
        opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
        sent = _count_ring_bytes()
        loss = gen(*batches[1])
        fw = dict(sent)
        loss.backward()
        gen.zero_grad()
        row.update({"fw_kv": fw[0x5249], "fw_reorder": fw[0x5243], "bw_kv": sent[0x5249] - fw[0x5249],
                    "bw_grad": sent[0x5247], "bw_reorder": sent[0x5243] - fw[0x5243]})
        row["kept"] = kept_bytes(lambda: gen(*batches[2]), list(gen.parameters()))
        gen.zero_grad()

        def step():
            train_iter(gen, it)
            opt.step()
            opt.zero_grad()
        row["step"] = _timed([step], cfg["steps"])[0]
        row["zigzag"], row["contiguous"], row["zigzag_cpu"], row["contiguous_cpu"] = _balance(cfg)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(rows, f)
    dist.barrier()   # no rank leaves while another still talks to it
    if cfg["mode"] == "torch":
        dist.destroy_process_group()


def _single(cfg):
    model = _model(cfg)
    batches = _batches(cfg, cfg["steps"] + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    it = iter(batches)

    def step():
        model(*next(it)).backward()
        opt.step()
        opt.zero_grad()
    kept = kept_bytes(lambda: model(*batches[0]), list(model.parameters()))
    model.zero_grad()
    return kept, _timed([step], cfg["steps"])[0]


def main(quick: bool = False, **overrides):
    cfg = dict(DEFAULTS, **(QUICK if quick else {}), **overrides)
    cp, T, C, L = cfg["cp"], cfg["seq"], cfg["width"], cfg["layers"]
    kept1, single_t = _single(cfg)
    ranks = run_rows(Path(__file__), dict(cfg, nproc=cp, mode="cp"))
    torch_row = run_rows(Path(__file__), dict(cfg, nproc=cp, mode="torch"))[0]
    kv = 2 * T * C * 4   # one layer's K and V, float32, batch 1
    worst = max(ranks, key=lambda r: r["kept"])
    r0 = ranks[0]
    rows = [
        {"metric": f"kept activations, worst rank of cp {cp} / cp 1", "value": worst["kept"] / kept1,
         "detail": f"{worst['kept'] / 2**20:.2f} MiB / {kept1 / 2**20:.2f} MiB (target <= 0.35)"},
        {"metric": "K/V bytes sent per rank per layer, forward", "value": r0["fw_kv"] // L,
         "detail": f"formula (cp-1)/cp x 2 x T x C x 4 B = {(cp - 1) * kv // cp}"},
        {"metric": "  backward: K/V again + their gradients", "value": (r0["bw_kv"] + r0["bw_grad"]) // L,
         "detail": f"formula (2 cp - 1)/cp x 2 x T x C x 4 B = {(2 * cp - 1) * kv // cp}"},
        {"metric": "  zigzag reordering, rank 0, forward + backward",
         "value": (r0["fw_reorder"] + r0["bw_reorder"]) // L,
         "detail": "q, k, v chunks in and the output's back (and the adjoint)"},
        {"metric": "ring op fwd+bwd, zigzag / contiguous (slowest rank)", "value": r0["zigzag"] / r0["contiguous"],
         "detail": f"{r0['zigzag'] * 1e3:.1f} ms / {r0['contiguous'] * 1e3:.1f} ms; chunk pairs "
                   f"{2 * cp + 1} on every rank vs up to {4 * cp - 1}"},
        {"metric": "  the same, CPU time of the busiest rank", "value": r0["zigzag_cpu"] / r0["contiguous_cpu"],
         "detail": f"{r0['zigzag_cpu'] * 1e3:.1f} ms / {r0['contiguous_cpu'] * 1e3:.1f} ms (a rank with its own "
                   f"device waits for this)"},
        {"metric": f"step time, cube cp {cp} / one process", "value": r0["step"] / single_t,
         "detail": f"{r0['step'] * 1e3:.1f} ms / {single_t * 1e3:.1f} ms ({cp} processes share the cores)"},
    ]
    if "torch_cp" in torch_row:
        rows.append({"metric": f"step time, cube / torch context_parallel (cp {cp})",
                     "value": r0["step"] / torch_row["torch_cp"],
                     "detail": f"{r0['step'] * 1e3:.1f} ms / {torch_row['torch_cp'] * 1e3:.1f} ms"})
    else:
        rows.append({"metric": "torch context_parallel (CPU, gloo)", "value": "n/a",
                     "detail": f"does not run: {torch_row['torch_cp_error']}"})
    print(f"GPT {L} layers, width {C}, {cfg['heads']} heads, causal, sequence {T}, batch 1, AdamW; cp {cp}")
    for r in rows:
        v = r["value"]
        print(f"  {r['metric']:<56} {v:>10.3f}   {r['detail']}" if isinstance(v, float) else
              f"  {r['metric']:<56} {v:>10}   {r['detail']}")
    return rows


if __name__ == "__main__":
    sys.exit(worker_cli(__doc__, dict(DEFAULTS, mode="cp"), "a 1024-token sequence, 2 timed steps",
                        worker, lambda quick, **kw: main(quick, **{k: v for k, v in kw.items() if k != "mode"})))
