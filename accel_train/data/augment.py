"""Augmentation on uint8 tensors (crop and flip, batched on the device or per sample) and
normalisation. (Image folders' RandomResizedCrop: crops.py; the run's whole plan, timm's per-sample
transforms too: train_augment.py.)

Augmentation is random crop with zero padding of image_size/8 pixels (4 at 32), then horizontal flip
(`--hflip false` turns it off), then normalisation. In both pipelines its randomness is a hash of
(seed, epoch, sample index): the same sample in the same epoch gets the same crop and flip whatever
the world size, the batch size or a resume.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .info import CIFAR10


def sample_hash(idx: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """A 32-bit hash per (seed, epoch, sample index), computed on idx's device (int64, no
    overflow)."""
    return mix32(
        (idx.long() * 2654435761 + (epoch * 40503 + seed * 97531 + 12345) % 2**31) & 0xFFFFFFFF
    )


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (int64 holding 32-bit values, no overflow): sample_hash's, and
    crops.uniforms'."""
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def crop_flip_params(
    idx: torch.Tensor, epoch: int, seed: int, pad: int = 4, hflip: bool = True
) -> tuple[torch.Tensor, ...]:
    """Per-sample crop offsets (0..2*pad, top and left in the padded image) and flips (0/1)."""
    h = sample_hash(idx, epoch, seed)
    top = h % (2 * pad + 1)
    left = (h >> 8) % (2 * pad + 1)
    flip = (h >> 20) & 1 if hflip else torch.zeros_like(h)
    return top, left, flip


def crop_flip(
    images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor, pad: int = 4
) -> torch.Tensor:
    """Batched RandomCrop(size, padding=pad) then RandomHorizontalFlip, as one gather on the
    device."""
    n, c, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    ar_h = torch.arange(h, device=images.device)
    ar_w = torch.arange(w, device=images.device)
    rows = top[:, None] + ar_h  # n, h
    cols = left[:, None] + torch.where(flip[:, None].bool(), w - 1 - ar_w, ar_w)  # n, w
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, chans, rows[:, None, :, None], cols[:, None, None, :]]


def crop_flip_each(
    images: torch.Tensor,
    top: torch.Tensor,
    left: torch.Tensor,
    flip: torch.Tensor,
    pad: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """crop_flip's result, made sample by sample with slice copies: on a CPU several times faster
    than its gather (what the cpu pipeline's workers run). `out`: zeros of images' shape to write it
    into, in any memory format (channels_last: the same copies transpose), else a new tensor."""
    n, c, h, w = images.shape
    out = torch.zeros_like(images) if out is None else out
    for k, (dy, dx, f) in enumerate(
        zip((top - pad).tolist(), (left - pad).tolist(), flip.tolist())
    ):
        crop = out[k, :, max(0, -dy) : h - max(0, dy), max(0, -dx) : w - max(0, dx)]
        crop.copy_(images[k, :, max(0, dy) : h + min(0, dy), max(0, dx) : w + min(0, dx)])
        if f:
            out[k] = out[k].flip(-1)
    return out


class Normalize:
    """uint8 -> float, (x/255 - mean) / std, as one fused multiply-add."""

    def __init__(self, device, mean=CIFAR10.mean, std=CIFAR10.std):
        std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, device=device).view(1, 3, 1, 1) / std_t

    def __call__(self, images_u8: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, images_u8.float(), self.scale)
