"""A stack of Linear layers trained with cube.

    SINGLE_DEV_MODE=1 python examples/mlp/linears.py --policy PASSingle
    torchrun --nproc_per_node=2 examples/mlp/linears.py --policy PASSingle
    python -m cube.sim examples/mlp/linears.py --ngpus 4 --policy PASData --estimate   # predicted step
"""
from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    """Linear layers with a squared-error loss against zero."""

    def __init__(self, dim: int = 256, nlayers: int = 8):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(dim, dim) for _ in range(nlayers)])

    def forward(self, data):
        x = data
        for layer in self.layers:
            x = layer(x)
        loss = torch.sum(x * x) / x.numel()
        return loss


def build(dim: int = 256, layers: int = 8, batch: int = 16):
    """The model and one global batch (what ``python -m cube.sim examples/mlp/linears.py`` plans)."""
    torch.manual_seed(0)
    model = MLP(dim, layers)
    return model, torch.randn(dim).unsqueeze(0).repeat(batch, 1)   # one sample, repeated


def main(argv=None):
    import argparse
    import logging

    import cube
    from cube.policies import resolve

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="PASSingle",
                        help="a shipped policy (e.g. PASSingle), or 'file.py:Name' / 'module:Name'")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--log-every", type=int, default=1, help="steps between metrics lines")
    parser.add_argument("--metrics-csv", default=None, metavar="PATH", help="append every step's metrics to PATH")
    parser.add_argument("--verbose", action="store_true", help="log compile phases")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")

    policy = resolve(args.policy)
    model, batch = build(args.dim, args.layers, args.batch)
    dataloader = cube.runtime.utils.create_dummy_dataloader(batch)

    @cube.compile(model, dataloader, PAS=policy)
    def train_iter(model, dataloader):
        data = next(dataloader)
        loss = model(data)
        loss.backward()
        return loss

    model = cube.load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # a sample counts as one token; each line: "step N: loss X | s/step | tok/s | MFU | peak memory" (rank 0)
    metrics = cube.Metrics(model, tokens_per_step=args.batch, log_every=args.log_every, csv=args.metrics_csv,
                           total_steps=args.steps, loss_format=".6f")
    for step in range(args.steps):
        loss = train_iter(model, dataloader)
        optimizer.step()
        optimizer.zero_grad()
        metrics.step(loss)


if __name__ == "__main__":
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    main()
