"""Train the nanoGPT-style GPT with cube.

    SINGLE_DEV_MODE=1 python examples/gpt/train.py --policy PASSingle
    torchrun --nproc_per_node=2 examples/gpt/train.py --policy PASData --zero 2 --precision bf16
    torchrun --nproc_per_node=2 examples/gpt/train.py --policy PASData --log-every 2 --metrics-csv m.csv
    torchrun --nproc_per_node=2 examples/gpt/train.py --policy PASMegatronTP --backend inductor   # torch.compile
    python -m cube.sim examples/gpt/train.py --ngpus 4 --policy PASData --estimate   # predicted step

Restarts: with ``--ckpt DIR`` the script saves a checkpoint ``DIR/step{N}`` every
``--save-every`` steps (``--async-save``: written in the background while
training goes on) and, when DIR already holds one, resumes from the newest
complete one (``cube.latest_checkpoint``; a save cut short by a crash is
skipped), also under another policy or world size (elastic: the plan is made
for the world the job has now and the checkpoint is resharded into it). The
checkpoint keeps the loader's position and the random generator states, so
under ``torchrun --max-restarts=N`` a rank that dies is restarted with the
others and training goes on to exactly the result of an uninterrupted run,
dropout (``--dropout``) included. ``--crash-at-step K`` kills rank ``world-1``
at step K on the first attempt, to watch that happen:

    torchrun --nproc_per_node=2 --max-restarts=1 examples/gpt/train.py --policy PASData \\
        --ckpt /tmp/gpt_ckpt --crash-at-step 5 --dropout 0.1
    torchrun --nproc_per_node=1 examples/gpt/train.py --policy PASData --ckpt /tmp/gpt_ckpt --steps 12

A rank that makes no progress for ``CUBE_HANG_TIMEOUT`` seconds (a stuck peer)
names where it waits and stops the job, so ``--max-restarts`` can restart it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cube  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from cube.policies import resolve  # noqa: E402


class StepBatches:
    """Global batch ``i`` drawn from a generator seeded with ``i``; its state is the next ``i``
    (``state_dict()``/``load_state_dict()``: a checkpoint resumes it)."""

    def __init__(self, config: GPTConfig, batch: int, start: int = 0):
        self.config, self.batch, self.step = config, batch, start

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def __iter__(self):
        return self

    def __next__(self):
        gen = torch.Generator().manual_seed(1000 + self.step)
        self.step += 1
        ids = torch.randint(0, self.config.vocab_size, (self.batch, self.config.block_size), generator=gen)
        return ids, torch.roll(ids, -1, dims=1)


def build(layers: int = 4, dim: int = 256, heads: int = 4, seq: int = 64, batch: int = 16, dropout: float = 0.0):
    """The model and its first global batch (what ``python -m cube.sim examples/gpt/train.py`` plans)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=seq, n_layer=layers, n_head=heads, n_embd=dim, dropout=dropout)
    return GPT(config), next(StepBatches(config, batch))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="PASSingle",
                        help="a shipped policy (e.g. PASSingle), or 'file.py:Name' / 'module:Name'")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--precision", choices=["bf16", "fp16"], default=None, help="mixed precision")
    parser.add_argument("--backend", default=None,
                        help="torch.compile backend for each rank's generated compute (e.g. inductor; "
                             "default: eager)")
    parser.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: off)")
    parser.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (resume from it)")
    parser.add_argument("--save-every", type=int, default=1)
    parser.add_argument("--async-save", action="store_true", help="write checkpoints in the background")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--crash-at-step", type=int, default=-1, help=argparse.SUPPRESS)
    parser.add_argument("--log-every", type=int, default=1, help="steps between metrics lines")
    parser.add_argument("--metrics-csv", default=None, metavar="PATH", help="append every step's metrics to PATH")
    parser.add_argument("--verbose", action="store_true", help="log compile phases")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    policy = resolve(args.policy)
    model, _ = build(args.layers, args.dim, args.heads, args.seq, args.batch, args.dropout)
    config = model.config
    dataloader = StepBatches(config, args.batch)

    @cube.compile(model, dataloader, PAS=policy, zero=3 if args.zero == 3 else 0, precision=args.precision,
                  backend=args.backend)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss

    model = cube.load_model()
    optimizer = cube.build_optimizer(model, torch.optim.AdamW, zero=args.zero, lr=1e-3)
    env = cube.init()
    start = 0
    latest = cube.latest_checkpoint(args.ckpt) if args.ckpt is not None and args.ckpt.is_dir() else None
    if latest is not None:
        # the loader's position, the optimizer and the random generators as they were at the save
        start = cube.load_checkpoint(latest, model, optimizer, dataloader=dataloader)["step"]
        if env.rank == 0:
            print(f"resumed from {latest} at step {start}")
    # each line: "step N: loss X | s/step | tok/s | MFU | peak memory" (rank 0)
    metrics = cube.Metrics(model, tokens_per_step=args.batch * args.seq, log_every=args.log_every,
                           csv=args.metrics_csv, total_steps=args.steps, start_step=start, loss_format=".6f")
    for step in range(start, args.steps):
        if step == args.crash_at_step and env.rank == env.world_size - 1 \
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            os.kill(os.getpid(), signal.SIGKILL)   # a rank dies without a word, as on a lost machine
        loss = train_iter(model, dataloader)
        norm = cube.clip_grad_norm_(model, args.clip, optimizer=optimizer) if args.clip else None
        optimizer.step()
        optimizer.zero_grad()
        metrics.step(loss, grad_norm=norm)
        if args.ckpt is not None and ((step + 1) % args.save_every == 0 or step + 1 == args.steps):
            cube.save_checkpoint(args.ckpt / f"step{step + 1}", model, optimizer, extra={"step": step + 1},
                                 dataloader=dataloader, async_save=args.async_save)
    cube.wait_checkpoint()   # the last asynchronous save is complete (or its failure raised) before exit


if __name__ == "__main__":
    main()
