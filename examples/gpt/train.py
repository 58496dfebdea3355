"""Train the nanoGPT-style GPT with cube.

    SINGLE_DEV_MODE=1 python examples/gpt/train.py --policy PASSingle
    torchrun --nproc_per_node=2 examples/gpt/train.py --policy PASSingle
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cube  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from policies import resolve  # noqa: E402

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="PASSingle",
                        help="a policy in policies/ (e.g. PASSingle), or 'file.py:Name' / 'module:Name'")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--verbose", action="store_true", help="log compile phases")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    policy = resolve(args.policy)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    model = GPT(config)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    dataloader = cube.runtime.utils.create_dummy_dataloader((ids, torch.roll(ids, -1, dims=1)))

    @cube.compile(model, dataloader, PAS=policy)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss

    model = cube.load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    env = cube.init()
    for step in range(args.steps):
        loss = train_iter(model, dataloader)
        optimizer.step()
        optimizer.zero_grad()
        if env.rank == 0:
            print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
