"""Launching a benchmark's worker under torchrun and reading back rank 0's rows."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rows(script: Path, cfg: dict) -> List[dict]:
    """Runs ``script --worker --cache DIR --out FILE --k=v ...`` on ``cfg["nproc"]`` ranks; returns the rows
    rank 0 wrote to FILE.

    Raises:
        RuntimeError: the job failed (its output, passed through, says why).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        forward = [f"--{k}={v}" for k, v in cfg.items() if k != "nproc"]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={cfg['nproc']}",
               "--master_addr=127.0.0.1", f"--master_port={port()}",
               str(Path(script).resolve()), "--worker", "--cache", tmp, "--out", out] + forward
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        code = subprocess.call(cmd, env=env, cwd=ROOT)
        if code or not os.path.exists(out):
            raise RuntimeError(f"{Path(script).name}: the torchrun job failed (exit code {code}); its output "
                               f"above says why")
        with open(out) as f:
            return json.load(f)


def kept_bytes(forward: Callable, params) -> int:
    """Bytes of the tensors autograd keeps for backward while ``forward()`` (returning a loss) runs,
    parameters excluded, each storage counted once; then runs the backward."""
    import torch
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward().backward()
    return sum(seen.values())


def compile_gpt(model, loader, policy, cache: str, **options):
    """``cube.compile`` of the standard GPT step (``model(ids, targets)``, backward, return the loss).

    Args:
        options: ``cube.compile`` options (``zero=``, ``precision=``).

    Returns:
        ``(train_iter, generated model of this rank)``.
    """
    import cube

    @cube.compile(model, loader, PAS=policy, cache_dir=cache, **options)
    def train_iter(model, dataloader):
        ids, tgt = next(dataloader)
        loss = model(ids, tgt)
        loss.backward()
        return loss
    return train_iter, cube.load_model()


def adamw_step(model, batches, policy, cache: str):
    """A training step through cube (``compile_gpt`` over ``batches``, then AdamW at lr 1e-3):
    ``(step, generated model of this rank)``; ``step()`` runs one."""
    import torch
    it = iter(batches)
    train_iter, gen = compile_gpt(model, it, policy, cache)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)

    def step():
        train_iter(gen, it)
        opt.step()
        opt.zero_grad()
    return step, gen


def worker_cli(doc: str, defaults: dict, quick_help: str, worker: Callable, main: Callable,
               argv: Optional[Sequence[str]] = None) -> int:
    """The command line of a benchmark that runs itself as its ranks' worker under torchrun:
    ``--quick``, one option per entry of ``defaults`` (its type), and the hidden worker flags.

    Returns:
        The exit status: 1 when ``main`` raised a ``RuntimeError`` (printed), else 0.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=quick_help)
    for k, v in defaults.items():
        p.add_argument(f"--{k}", type=type(v), default=None, help=f"(default {v})")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", default="", help=argparse.SUPPRESS)
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        for k, v in defaults.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        worker(args)
        return 0
    try:
        main(args.quick, **{k: v for k, v in vars(args).items() if k in defaults and v is not None})
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    return 0
