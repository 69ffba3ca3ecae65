"""Image corruptions for the robustness study: pure functions of a tensor and a severity.

Every corruption takes images ``(n, C, H, W)`` with values in [0, 1], a
``severity`` in [0, 5] (0 is the identity; 1..5 follow the usual
common-corruption scale, fractional values interpolate its parameters) and a
``seed`` where it is random, and returns a new tensor of the same shape,
dtype and device, clipped to [0, 1]. :func:`corrupt` wraps them for inputs
normalised as ``(x - mean) / std`` (the zoo's pixel transform).

The parameter tables are ours, set for small (32 px) images: at severity 5 a
demo image is still recognisable to a person.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Parameter at severities 0..5 (0 = the identity).
NOISE_STD = (0.0, 0.04, 0.08, 0.12, 0.18, 0.26)  # Gaussian noise: std in pixel units
BLUR_SIGMA = (0.0, 0.4, 0.6, 0.8, 1.1, 1.5)  # Gaussian blur: sigma in pixels
FOG_AMOUNT = (0.0, 0.2, 0.4, 0.6, 0.85, 1.2)  # fog: strength of the haze layer


def _level(table: tuple[float, ...], severity: float) -> float:
    """Linear interpolation of a severity table (a severity outside its range is an error)."""
    if not 0.0 <= severity <= len(table) - 1:
        raise ValueError(f"severity must be in [0, {len(table) - 1}], got {severity}.")
    lo = int(severity)
    hi = min(lo + 1, len(table) - 1)
    return table[lo] + (severity - lo) * (table[hi] - table[lo])


def _generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def gaussian_noise(x: torch.Tensor, severity: float, seed: int = 0) -> torch.Tensor:
    """``x + sigma * N(0, 1)`` per pixel and channel, clipped."""
    std = _level(NOISE_STD, severity)
    if std == 0.0:
        return x.clone()
    noise = torch.randn(x.shape, generator=_generator(seed, x.device), device=x.device, dtype=x.dtype)
    return (x + std * noise).clamp(0.0, 1.0)


def _gauss_kernel(sigma: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    radius = max(1, int(3.0 * sigma + 0.5))
    t = torch.arange(-radius, radius + 1, dtype=dtype, device=device)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()  # (2 radius + 1,)


def _separable_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Depthwise Gaussian blur of ``(n, C, H, W)`` with reflect padding (edge-replicate when tiny)."""
    k = _gauss_kernel(sigma, x.dtype, x.device)
    r = (len(k) - 1) // 2
    c = x.shape[1]
    mode = "reflect" if min(x.shape[-2:]) > r else "replicate"
    out = F.pad(x, (r, r, 0, 0), mode=mode)
    out = F.conv2d(out, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)  # along W
    out = F.pad(out, (0, 0, r, r), mode=mode)
    return F.conv2d(out, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)  # along H


def blur(x: torch.Tensor, severity: float, seed: int = 0) -> torch.Tensor:
    """Gaussian blur with a severity-dependent sigma (``seed`` unused: deterministic)."""
    sigma = _level(BLUR_SIGMA, severity)
    if sigma == 0.0:
        return x.clone()
    return _separable_blur(x, sigma).clamp(0.0, 1.0)


def _haze(
    n: int, h: int, w: int, seed: int, dtype: torch.dtype, device: torch.device, octaves: int = 4
) -> torch.Tensor:
    """A smooth random field ``(n, 1, h, w)`` in [0, 1]: coarse-to-fine octaves of uniform
    noise, each upsampled bilinearly, amplitude halving per octave."""
    gen = _generator(seed, device)
    field = torch.zeros(n, 1, h, w, dtype=dtype, device=device)
    amp, total = 1.0, 0.0
    for o in range(octaves):
        size = 2 ** (o + 1)
        grid = torch.rand(n, 1, size, size, generator=gen, device=device, dtype=dtype)
        field += amp * F.interpolate(grid, size=(h, w), mode="bilinear", align_corners=True)
        total += amp
        amp /= 2.0
    field /= total
    lo = field.amin(dim=(-2, -1), keepdim=True)
    hi = field.amax(dim=(-2, -1), keepdim=True)
    return (field - lo) / (hi - lo).clamp_min(1e-6)


def fog(x: torch.Tensor, severity: float, seed: int = 0) -> torch.Tensor:
    """A grey haze: ``x + a * haze``, then the contrast squeezed back by ``max / (max + a)``."""
    a = _level(FOG_AMOUNT, severity)
    if a == 0.0:
        return x.clone()
    n, _, h, w = x.shape
    haze = _haze(n, h, w, seed, x.dtype, x.device)  # (n, 1, H, W)
    peak = x.amax(dim=(1, 2, 3), keepdim=True)
    return ((x + a * haze) * peak / (peak + a)).clamp(0.0, 1.0)


CORRUPTIONS: dict[str, Callable[[torch.Tensor, float, int], torch.Tensor]] = {
    "gaussian_noise": gaussian_noise,
    "blur": blur,
    "fog": fog,
}


def corrupt(
    x: torch.Tensor, kind: str, severity: float, seed: int = 0, mean: float = 0.5, std: float = 0.5
) -> torch.Tensor:
    """Corrupt normalised images ``x = (pixels - mean) / std``: undo the normalisation,
    apply ``CORRUPTIONS[kind]`` in [0, 1], normalise again."""
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; choose one of {sorted(CORRUPTIONS)}.")
    if severity == 0:
        return x.clone()
    pixels = (x * std + mean).clamp(0.0, 1.0)
    return (CORRUPTIONS[kind](pixels, severity, seed) - mean) / std
