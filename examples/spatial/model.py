"""Models for spatial partitioning: a WRF-like stencil model and a small U-Net."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Stencil(nn.Module):
    """A 2-D field of ``channels`` variables advanced by ``steps`` learnable 3 x 3 stencils.

    Each step is an explicit update ``x <- x + dt * tanh(stencil(x))`` (a convolution with padding 1,
    as a finite-difference scheme reads its 8 neighbours); the loss is the mean squared error of
    the final field against a target field.
    """

    def __init__(self, channels: int = 4, steps: int = 4, dt: float = 0.1):
        super().__init__()
        self.stencils = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in range(steps))
        self.dt = dt

    def forward(self, field: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = field
        for stencil in self.stencils:
            x = x + self.dt * torch.tanh(stencil(x))
        return F.mse_loss(x, target)


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    """Two down-sampling levels (max pool), two up-sampling levels (nearest) with skip connections."""

    def __init__(self, cin: int = 3, cout: int = 2, width: int = 8):
        super().__init__()
        self.enc1, self.enc2 = _block(cin, width), _block(width, 2 * width)
        self.mid = _block(2 * width, 2 * width)
        self.dec2, self.dec1 = _block(4 * width, width), _block(2 * width, width)
        self.out = nn.Conv2d(width, cout, 1)

    def forward(self, image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(image)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([F.interpolate(m, scale_factor=2, mode="nearest"), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2, mode="nearest"), e1], dim=1))
        return F.mse_loss(self.out(d1), target)
