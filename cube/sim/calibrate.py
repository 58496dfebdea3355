"""``python -m cube.sim.calibrate --out my-cluster.json``: a hardware profile fitted on this machine.

Measures, on ``cuda:0`` when there is one (else the CPU):

- a GEMM sweep in the profile's precision: square matmuls of growing size and
  the shapes a transformer's layers run (tokens x hidden x hidden, x 4 hidden,
  and back), on a GPU timed on the device alone (a CUDA graph of the calls
  replayed: a small product's host dispatch is the host floor's, below).
  Seconds are taken linear in FLOPs, ``t = (f + half) / peak``; a
  least-squares line gives the peak and the size at which half of it is
  reached (the profile's ``gemm`` curve with ``max`` 1 of the fitted peak);
  convolution takes the same curve;
- attention (GPU): ``scaled_dot_product_attention`` forward and backward at a
  few transformer sizes, without a mask (FLOPs as ``cube.ir.ops.flops``
  counts them), giving the ``attention`` curve and its backward factor;
- memory bandwidth: a large copy (bytes read and written per second) is the
  peak; elementwise ops (add, multiply, GELU) give the share of it that
  memory-bound ops reach (``efficiency.memory``);
- AdamW (GPU): ``torch.optim.AdamW``'s default step over a model-sized set of
  float32 tensors, as bytes moved per parameter at the copy's rate
  (``optimizer_bytes_per_param``: the multi-tensor step makes several passes);
- the dispatch time of a tiny kernel, and (GPU) the host's seconds per op of
  an eager training step: a small transformer's forward and backward under
  autocast, so small that the device waits for the host, over the ops the
  simulator counts in it (``host_us_per_op``: the floor under each op's time);
- the network: kept from ``--base`` (a shipped profile) on a GPU, since one
  process on one device cannot measure NVLink or InfiniBand; on the CPU, gloo's
  calibrated costs (``cube.sim.comm``) for both hops.

Every measurement is kept in the file (``measurements``), beside what was fitted from it.
The file is usable at once: ``python -m cube.sim SPEC --hardware my-cluster.json ...``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import torch

from cube.sim import hardware
from cube.sim.profile import time_call

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def transformer_shapes(tokens: Sequence[int], hidden: Sequence[int]) -> List[Tuple[int, int, int]]:
    """``(m, n, k)`` of a transformer layer's matmuls: ``tokens x hidden`` times ``hidden x {hidden, 3 hidden,
    4 hidden}``, and the ``4 hidden -> hidden`` projection."""
    return [(t, n, k) for t in tokens for h in hidden for n, k in ((h, h), (3 * h, h), (4 * h, h), (h, 4 * h))]


def gemm_sweep(device: torch.device, dtype: torch.dtype, sizes: Sequence[int], repeat: int = 5,
               shapes: Sequence[Tuple[int, int, int]] = ()) -> List[Tuple[float, float]]:
    """``[(flops, seconds)]`` of square matmuls of ``sizes`` and of ``(m, n, k)`` ``shapes``."""
    points = []
    for m, n, k in [(n, n, n) for n in sizes] + list(shapes):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        points.append((2.0 * m * n * k, time_call(lambda: torch.matmul(a, b), device, repeat)))
    return points


def device_seconds(fn: Callable[[], object], calls: int = 10, repeat: int = 5) -> float:
    """Seconds ``fn`` keeps the GPU busy, the host's dispatch left out: ``calls`` of it captured in a
    CUDA graph, the graph replayed and timed by CUDA events (the median of ``repeat``)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()   # warm up (cuBLAS picks its kernel and workspace) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def gemm_device_sweep(device: torch.device, dtype: torch.dtype, shapes: Sequence[Tuple[int, int, int]]
                      ) -> List[Tuple[float, float]]:
    """``[(flops, GPU seconds)]`` of ``(m, n, k)`` matmuls timed without the host (``device_seconds``)."""
    points = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        c = torch.empty(m, n, device=device, dtype=dtype)
        points.append((2.0 * m * n * k, device_seconds(lambda: torch.matmul(a, b, out=c))))
    return points


class _Block(torch.nn.Module):
    """A pre-norm transformer block as GPT models write it (host-cost probe)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.fc, self.out = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=-1))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class _Probe(torch.nn.Module):
    def __init__(self, vocab: int = 256, d: int = 64, layers: int = 4, heads: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids, targets):
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def host_per_op(device: torch.device, precision: str, steps: int = 30) -> Tuple[float, float, int]:
    """``(forward, backward seconds per op, ops)`` the host spends in an eager training step of a
    transformer too small to keep the device busy, under autocast at ``precision`` (each step
    started on an idle device; medians over ``steps``); ops as the simulator counts them (the
    traced graph's, views left out: they launch nothing)."""
    from cube.compiler import trace_model
    from cube.ir.ops import op_info
    from cube.ir.operator import IRFwOperation
    torch.manual_seed(0)
    model = _Probe().to(device)
    ids = torch.randint(0, 256, (2, 32), device=device)
    batch = (ids, torch.roll(ids, -1, dims=1))
    low = DTYPES[precision] if precision != "fp32" else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fws, bws = [], []
    for _ in range(steps + 5):   # medians: a collector's pause or a first-time heuristic in one step stays out
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=low, enabled=low is not None):
            loss = model(*batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        fws.append(t1 - t0)
        bws.append(t2 - t1)
        model.zero_grad(set_to_none=True)
    sync()
    graph = trace_model(model, batch, precision=None if low is None else precision).graph
    ops = sum(1 for op in graph.select(ntype=IRFwOperation) if not op_info(op.name).alias)
    return statistics.median(fws[5:]) / ops, statistics.median(bws[5:]) / ops, ops


def host_per_op_generated(device: torch.device, precision: str, ops: int, steps: int = 30) -> float:
    """Seconds per op (forward and backward together) the host spends in cube's generated step of the
    same probe (``PASSingle`` in this process), each step started on an idle device."""
    import tempfile
    import cube
    torch.manual_seed(0)
    model = _Probe().to(device)
    ids = torch.randint(0, 256, (2, 32), device=device)
    batch = (ids, torch.roll(ids, -1, dims=1))
    loader = iter(lambda: batch, None)
    # one process without torchrun: cube runs it at world size 1 (cube.runtime.device)
    with tempfile.TemporaryDirectory() as cache:
        @cube.compile(model, loader, PAS="PASSingle", cache_dir=cache,
                      precision=None if precision == "fp32" else precision)
        def step(model, dataloader):
            loss = model(*next(dataloader))
            loss.backward()
            return loss
        gen = cube.load_model()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        total = []
        for i in range(steps + 5):
            sync()
            t0 = time.perf_counter()
            step(gen, loader)
            total.append(time.perf_counter() - t0)
            gen.zero_grad(set_to_none=True)
    return statistics.median(total[5:]) / ops


def attention_sweep(device: torch.device, dtype: torch.dtype, sizes: Sequence[Tuple[int, int, int, int]],
                    repeat: int = 5) -> List[Tuple[float, float, float]]:
    """``[(flops, forward seconds, backward seconds)]`` of ``scaled_dot_product_attention`` without a mask at
    ``(batch, heads, sequence, head dim)`` sizes; FLOPs of the forward as the simulator counts them."""
    from cube.ir.ops import flops as op_flops
    points = []
    for b, h, t, d in sizes:
        q, k, v = (torch.randn(b, h, t, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        shape = (b, h, t, d)
        f = op_flops("scaled_dot_product_attention", [shape] * 3, [shape])
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        grad = torch.randn_like(out)

        def forward():
            with torch.no_grad():   # capturable: no autograd nodes recorded
                torch.nn.functional.scaled_dot_product_attention(q, k, v)

        def both():
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            torch.autograd.grad(o, (q, k, v), grad)
        # the backward as the host times it, the forward on the device too (the curve's); autograd
        # is not captured in a graph
        fw_host, total = time_call(forward, device, repeat), time_call(both, device, repeat)
        fw = device_seconds(forward) if device.type == "cuda" else fw_host
        points.append((float(f), fw, max(total - fw_host, 0.0)))
    return points


def elementwise_rates(device: torch.device, nbytes: int, repeat: int = 5) -> dict:
    """Bytes per second (read plus written) of memory-bound ops on ``nbytes``-sized float32 tensors."""
    n = nbytes // 4
    x, y = torch.randn(n, device=device), torch.randn(n, device=device)
    ops = {"add": (lambda: x + y, 3), "mul": (lambda: x * y, 3), "gelu": (lambda: torch.nn.functional.gelu(x), 2)}
    return {name: moved * nbytes / time_call(fn, device, repeat) for name, (fn, moved) in ops.items()}


def adamw_seconds(device: torch.device, numel: int, tensors: int = 48, repeat: int = 5) -> float:
    """Seconds of one default ``torch.optim.AdamW`` step over ``tensors`` float32 tensors of ``numel`` in all."""
    params = [torch.nn.Parameter(torch.randn(numel // tensors, device=device)) for _ in range(tensors)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    return time_call(opt.step, device, repeat)


def fit_curve(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(peak FLOP/s, FLOPs at half the peak)`` from the line ``t = f / peak + half / peak``, fitted
    by least squares of the relative error (each point weighs ``1 / t^2``: a small product's
    time counts as much as a large one's, as every op's share of a step does).

    Raises:
        ValueError: fewer than two points, or times that do not grow with FLOPs.
    """
    if len(points) < 2:
        raise ValueError("fit_curve needs at least two (flops, seconds) points")
    ws = [1.0 / max(t, 1e-12) ** 2 for _, t in points]
    sw = sum(ws)
    mx = sum(w * f for w, (f, _) in zip(ws, points)) / sw
    my = sum(w * t for w, (_, t) in zip(ws, points)) / sw
    den = sum(w * (f - mx) ** 2 for w, (f, _) in zip(ws, points))
    slope = sum(w * (f - mx) * (t - my) for w, (f, t) in zip(ws, points)) / den if den else 0.0
    if slope <= 0:
        raise ValueError(f"GEMM times do not grow with size ({points}); the device is too busy to calibrate")
    intercept = max(my - slope * mx, 0.0)
    return 1.0 / slope, intercept / slope


def bandwidth(device: torch.device, nbytes: int, repeat: int = 5) -> float:
    """Bytes per second a copy moves (read plus write)."""
    n = nbytes // 4
    x, y = torch.empty(n, device=device), torch.randn(n, device=device)
    return 2 * nbytes / time_call(lambda: x.copy_(y), device, repeat)


def launch(device: torch.device, repeat: int = 9) -> float:
    x = torch.zeros(1, device=device)
    return time_call(lambda: x.add_(1), device, repeat)


def profile(precision: str = "bf16", quick: bool = False, base: str = "dgx-a100-80g", name: str = "my-cluster",
            log: Callable[[str], None] = print, calibrate_network: bool = True) -> dict:
    """The measured profile as a dict (see the module docstring)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    if not cuda and precision != "fp32":
        log(f"no GPU: calibrating the CPU in fp32 (asked {precision})")
        precision = "fp32"
    dtype = DTYPES[precision]
    sizes = ([512, 1024, 2048, 4096] if quick else [512, 1024, 2048, 3072, 4096, 6144, 8192]) if cuda else \
        ([64, 128, 256, 384] if quick else [128, 256, 384, 512, 768, 1024])
    shapes = transformer_shapes([2048, 8192] if quick else [2048, 8192, 16384],
                                [1024, 4096] if quick else [1024, 2048, 4096, 8192]) if cuda else []
    for attempt in range(3):   # another program's burst can flatten one sweep; measure again
        points = gemm_sweep(device, dtype, sizes, shapes=shapes)
        try:
            peak, half = fit_curve(points)
            break
        except ValueError:
            if attempt == 2:
                raise
            log("GEMM times did not grow with size (the device is busy): measuring again")
    log("GEMM sweep: " + ", ".join(f"{f / 1e9:.3g} GFLOP {f / t / 1e12:.2f} TFLOP/s" for f, t in points))
    log(f"fit: peak {peak / 1e12:.2f} TFLOP/s, half of it at {half / 1e9:.3f} GFLOP")
    gemm_device = []
    if cuda:   # the same shapes, GPU time alone: the curve is fitted to these (small calls above wait on dispatch)
        try:
            gemm_device = gemm_device_sweep(device, dtype, [(n, n, n) for n in sizes] + list(shapes))
            log("GEMM GPU time: " + ", ".join(f"{f / 1e9:.3g} GFLOP {f / t / 1e12:.1f}" for f, t in gemm_device))
            peak, half = fit_curve(gemm_device)
            log(f"fit (GPU time): peak {peak / 1e12:.2f} TFLOP/s, half of it at {half / 1e9:.3f} GFLOP")
        except RuntimeError as e:   # a device or driver without graph capture: the host-timed fit stays
            log(f"GEMM GPU time not measured ({e}); the fit includes dispatch")
    gemm_curve = {"max": 1.0, "half_gflop": half / 1e9}
    attn_curve, attn_backward, attn = gemm_curve, 2.0, []
    if cuda:
        attn = attention_sweep(device, dtype, [(4, 16, 1024, 64), (8, 16, 1024, 64), (4, 16, 2048, 64),
                                               (2, 16, 4096, 64), (4, 16, 2048, 128)][:3 if quick else None])
        apeak, ahalf = fit_curve([(f, fw) for f, fw, _ in attn])
        attn_curve = {"max": min(apeak / peak, 1.0), "half_gflop": ahalf / 1e9}
        attn_backward = statistics.median(bw / fw for _, fw, bw in attn)
        log("attention: " + ", ".join(f"{f / 1e9:.3g} GFLOP {f / fw / 1e12:.1f} TFLOP/s fw, bw/fw {bw / fw:.2f}"
                                      for f, fw, bw in attn))
    size = (64 << 20) if quick else (512 << 20) if cuda else (128 << 20)
    rate = bandwidth(device, size)
    elementwise = elementwise_rates(device, size // 2)
    memory_share = min(statistics.median(elementwise.values()) / rate, 1.0)
    dispatch = launch(device)
    host = host_per_op(device, precision) if cuda else None
    generated = None
    if host:
        log(f"host: {host[0] * 1e6:.1f} us forward and {host[1] * 1e6:.1f} us backward per op of an eager "
            f"training step ({host[2]} ops)")
        try:
            generated = host_per_op_generated(device, precision, host[2])
            log(f"host: {generated * 1e6:.1f} us per op (forward and backward) in cube's generated step")
        except Exception as e:   # noqa: BLE001 - a diagnostic beside the fit
            log(f"host of cube's generated step not measured: {type(e).__name__}: {e}")
    log(f"memory: copy {rate / 1e9:.1f} GB/s; elementwise " +
        ", ".join(f"{k} {v / 1e9:.1f}" for k, v in elementwise.items()) + f" GB/s; kernel dispatch "
        f"{dispatch * 1e6:.1f} us")
    adam_numel = (16 << 20) if quick else (128 << 20)
    adam_s = adamw_seconds(device, adam_numel) if cuda else None
    adam_bytes = adam_s * rate / adam_numel if adam_s else 28.0
    if adam_s:
        log(f"AdamW: {adam_s * 1e3:.2f} ms for {adam_numel / 1e6:.0f}M parameters = {adam_bytes:.1f} bytes per "
            f"parameter at the copy's rate")
    name_of = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
    memory = torch.cuda.get_device_properties(device).total_memory / 2**30 if cuda else 0
    if cuda:
        network, node = hardware.load(base).network, hardware.load(base).raw.get("node", {"gpus": 8})
        net_source = f"kept from the {base} profile (one device cannot measure its network)"
    else:
        from cube.sim import comm as comm_mod
        model = comm_mod.load(2, calibrate_missing=calibrate_network)
        alpha, beta = model.alpha["all_reduce"], model.beta["all_reduce"]
        hop = {"busbw_gbps": 1 / beta / 1e9, "p2p_gbps": 1 / model.beta["p2p"] / 1e9, "alpha_us": alpha * 1e6}
        network = {"intra": hop, "inter": {"nic_gbps_per_gpu": hop["busbw_gbps"], "efficiency": 1.0,
                                           "alpha_us": hop["alpha_us"]}}
        node = {"gpus": 1}
        net_source = "gloo on this host, calibrated by cube.sim.comm"
    when = datetime.datetime.now().isoformat(timespec="seconds")
    return {
        "name": name,
        "description": f"Fitted by python -m cube.sim.calibrate on {name_of} ({device.type}) at {when}.",
        "sources": {"device": f"measured: GEMM sweep (squares {sizes} and {len(shapes)} transformer shapes) in "
                              f"{precision}, attention, a copy, elementwise ops, AdamW, a one-element kernel",
                    "network": net_source},
        "device": {"kind": "gpu" if cuda else "cpu", "name": name_of, "memory_gib": round(memory, 1),
                   "peak_tflops": {precision: peak / 1e12},
                   "hbm_gbps": rate / 1e9,
                   "efficiency": {"gemm": gemm_curve, "attention": attn_curve, "conv": gemm_curve,
                                  "memory": memory_share},
                   "launch_us": dispatch * 1e6, "backward_factor": {"default": 2.0, "attention": attn_backward},
                   **({"host_us_per_op": {"forward": host[0] * 1e6, "backward": host[1] * 1e6}} if host else {}),
                   "optimizer_bytes_per_param": adam_bytes},
        "node": node,
        "network": network,
        "measurements": {"gemm": [[f, t] for f, t in points], "gemm_gpu_time": [[f, t] for f, t in gemm_device],
                         "gemm_shapes": [[n, n, n] for n in sizes] + [list(x) for x in shapes],
                         "attention": [list(x) for x in attn], "copy_bytes_per_s": rate,
                         "elementwise_bytes_per_s": elementwise, "adamw": [adam_numel, adam_s],
                         "host_us_per_op_generated": generated * 1e6 if generated else None},
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cube.sim.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the profile to write (JSON)")
    # fp8 is left out: the sweep times torch.matmul in a dtype of DTYPES (bf16 for fp8), not _scaled_mm
    p.add_argument("--precision", choices=sorted(set(DTYPES) - {"fp8"}), default="bf16", help="GEMM precision (GPU)")
    p.add_argument("--base", default="dgx-a100-80g", help="shipped profile whose network a GPU profile keeps")
    p.add_argument("--name", default=None, help="the profile's name (default: the file's stem)")
    p.add_argument("--quick", action="store_true", help="fewer and smaller measurements")
    p.add_argument("--no-calibrate", action="store_true", help="CPU: gloo's default costs, no network calibration")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.suffix != ".json":
        p.error("--out must end in .json (the simulator reads profiles by that suffix)")
    data = profile(args.precision, args.quick, args.base, args.name or out.stem,
                   calibrate_network=not args.no_calibrate)
    out.write_text(json.dumps(data, indent=2) + "\n")
    hardware.load(out)   # what the simulator will read: checked now
    print(f"profile written to {out}; use it: python -m cube.sim SPEC --hardware {out} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
