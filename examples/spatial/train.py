"""Train a stencil model or a U-Net with spatial partitioning (each rank holds a block of the field).

    SINGLE_DEV_MODE=1 python examples/spatial/train.py                    # one device, the reference
    torchrun --nproc_per_node=4 examples/spatial/train.py                 # 2 x 2 grid (PASSpatial dims=HW)
    torchrun --nproc_per_node=2 examples/spatial/train.py --dims H --model unet
    torchrun --nproc_per_node=4 examples/spatial/train.py --model unet-transpose   # ConvTranspose2d + GroupNorm
    python -m cube.sim examples/spatial/train.py --ngpus 4 --policy PASSpatial --option dims=HW --estimate
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import cube  # noqa: E402
from examples.spatial.model import Stencil, UNet  # noqa: E402
from cube.policies.spatial import PASSpatial  # noqa: E402


class StepBatches:
    """Batch ``i`` drawn from a generator seeded with ``i`` (the same on every rank)."""

    def __init__(self, shapes, start: int = 0):
        self.shapes, self.step = shapes, start

    def __iter__(self):
        return self

    def __next__(self):
        gen = torch.Generator().manual_seed(1000 + self.step)
        self.step += 1
        return tuple(torch.randn(s, generator=gen) for s in self.shapes)


def shapes(model: str, size: int, batch: int):
    if model == "stencil":
        return [(batch, 4, size, size), (batch, 4, size, size)]
    return [(batch, 3, size, size), (batch, 2, size, size)]


def build(model: str = "stencil", size: int = 64, batch: int = 4, steps: int = 4):
    """The model and its first batch (what ``python -m cube.sim examples/spatial/train.py`` plans)."""
    torch.manual_seed(0)
    net = Stencil(steps=steps) if model == "stencil" else \
        UNet(up="transpose", norm="group") if model == "unet-transpose" else UNet()
    return net, next(StepBatches(shapes(model, size, batch)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["stencil", "unet", "unet-transpose"], default="stencil")
    parser.add_argument("--size", type=int, default=64, help="the field is size x size")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dims", default="HW", help="spatial dims split (H, W or HW)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    model, _ = build(args.model, args.size, args.batch)
    loader = StepBatches(shapes(args.model, args.size, args.batch))
    policy = functools.partial(PASSpatial, dims=args.dims)   # one device (SINGLE_DEV_MODE): a 1 x 1 grid

    @cube.compile(model, loader, PAS=policy)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(*data)
        loss.backward()
        return loss

    model = cube.load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    env = cube.init()
    for step in range(args.steps):
        loss = train_iter(model, loader)
        optimizer.step()
        optimizer.zero_grad()
        if env.rank == 0:
            print(f"step {step}: loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
