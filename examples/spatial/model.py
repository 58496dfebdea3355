"""Models for spatial partitioning: a WRF-like stencil model and a small U-Net (nearest, bilinear or
transposed-convolution up-sampling; batch or group norm)."""
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


def _block(cin: int, cout: int, norm: str = "batch") -> nn.Sequential:
    norm_layer = nn.BatchNorm2d(cout) if norm == "batch" else nn.GroupNorm(2, cout)
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), norm_layer, nn.ReLU())


class UNet(nn.Module):
    """Two down-sampling levels (max pool), two up-sampling levels with skip connections.

    Args:
        up: how a level up-samples: ``"nearest"`` (interpolation), ``"bilinear"`` (interpolation,
            ``align_corners`` False), or ``"transpose"`` (a learned 2 x 2 ``ConvTranspose2d`` of
            stride 2).
        norm: ``"batch"`` (``BatchNorm2d``) or ``"group"`` (``GroupNorm`` of 2 groups).
    """

    def __init__(self, cin: int = 3, cout: int = 2, width: int = 8, up: str = "nearest", norm: str = "batch"):
        super().__init__()
        if up not in ("nearest", "bilinear", "transpose") or norm not in ("batch", "group"):
            raise ValueError(f"UNet: up={up!r} (nearest, bilinear, transpose), norm={norm!r} (batch, group)")
        self.up = up
        self.enc1, self.enc2 = _block(cin, width, norm), _block(width, 2 * width, norm)
        self.mid = _block(2 * width, 2 * width, norm)
        self.dec2, self.dec1 = _block(4 * width, width, norm), _block(2 * width, width, norm)
        if up == "transpose":
            self.up2 = nn.ConvTranspose2d(2 * width, 2 * width, 2, stride=2)
            self.up1 = nn.ConvTranspose2d(width, width, 2, stride=2)
        self.out = nn.Conv2d(width, cout, 1)

    def _up(self, x: torch.Tensor, level: int) -> torch.Tensor:
        if self.up == "transpose":
            return (self.up2 if level == 2 else self.up1)(x)
        return F.interpolate(x, scale_factor=2, mode=self.up)

    def forward(self, image: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(image)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self._up(m, 2), e2], dim=1))
        d1 = self.dec1(torch.cat([self._up(d2, 1), e1], dim=1))
        return F.mse_loss(self.out(d1), target)
