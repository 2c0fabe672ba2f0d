"""RandomResizedCrop, the image-folder recipe (timm's, torchvision's, FFCV's, DALI's), the same math in every pipeline.

Each training image is stored once as the WHOLE image squashed to L x L (L = store_size: a bounded multiple of the
training size, as FFCV stores images at a bounded resolution) with its own aspect ratio (width / height) beside it:
a uniform array the device pipeline keeps on the device and the decoded cache maps. A crop is drawn in the original
image's coordinates, exactly as timm's RandomResizedCropAndInterpolation.get_params draws it (area fraction in
--scale, log-uniform aspect ratio in --ratio, 10 attempts, then the central fallback), as fractions of the width and
height: the same fractions of the squashed store are the same region of the image. Its randomness is a hash of (seed,
epoch, sample index) computed on the CPU in float64 (rrc_boxes): every pipeline, world size and resume crops alike.

The crop is resampled to image_size x image_size by torchvision.ops.roi_align (bilinear, an adaptive number of
samples per output pixel: area-averaged when the crop shrinks, so no aliasing), batched, on whatever device holds the
batch: the device pipeline's on the accelerator, the cpu and cache pipelines' in their DataLoader workers.
--train_interpolation bicubic resizes each crop by itself (F.interpolate, antialiased), on the same device; random
(timm train.py's default) picks bilinear or bicubic per sample, half each, from the same hash.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .augment import mix32, sample_hash

STORE_SCALE = 1.5   # the stored whole image's side, x the training size (FFCV's ImageNet configs: max_res ~1.3-2.5x)
ATTEMPTS = 10       # timm's and torchvision's RandomResizedCrop


def store_size(image_size: int) -> int:
    """L: the side of the squashed whole image kept for RandomResizedCrop (a multiple of 8)."""
    return max(8, math.ceil(image_size * STORE_SCALE / 8) * 8)


def uniforms(idx: torch.Tensor, epoch: int, seed: int, n: int) -> torch.Tensor:
    """(len(idx), n) float64 in [0, 1): n independent draws per (seed, epoch, sample index), on the CPU."""
    h = sample_hash(idx.cpu(), epoch, seed)
    k = (torch.arange(1, n + 1, dtype=torch.long) * 0x9E3779B9) & 0xFFFFFFFF
    return mix32(h[:, None] ^ k).double() / 2**32


def rrc_boxes(idx: torch.Tensor, epoch: int, seed: int, aspects: torch.Tensor, scale=(0.08, 1.0),
              ratio=(3 / 4, 4 / 3)) -> torch.Tensor:
    """(len(idx), 4) float64 crops (x0, y0, x1, y1) as fractions of each image's width and height: timm's
    RandomResizedCrop parameters for images of `aspects` (width / height), drawn from the hash of (seed, epoch, idx)."""
    a = aspects.double().cpu()
    u = uniforms(idx, epoch, seed, 4 * ATTEMPTS)
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    # the central fallback (no attempt fits): the whole image, or its middle at the nearest allowed ratio
    cw = torch.where(a > ratio[1], ratio[1] / a, torch.ones_like(a))
    ch = torch.where(a < ratio[0], a / ratio[0], torch.ones_like(a))
    x0, y0 = (1 - cw) / 2, (1 - ch) / 2
    for t in reversed(range(ATTEMPTS)):  # (the first attempt that fits wins: written last)
        s = scale[0] + (scale[1] - scale[0]) * u[:, 4 * t]
        r = torch.exp(log_r[0] + (log_r[1] - log_r[0]) * u[:, 4 * t + 1])
        w, h = torch.sqrt(s * r / a), torch.sqrt(s * a / r)
        fits = (w <= 1) & (h <= 1)
        cw, ch = torch.where(fits, w, cw), torch.where(fits, h, ch)
        x0 = torch.where(fits, u[:, 4 * t + 2] * (1 - w), x0)
        y0 = torch.where(fits, u[:, 4 * t + 3] * (1 - h), y0)
    return torch.stack([x0, y0, x0 + cw, y0 + ch], 1)


def rrc_flips(idx: torch.Tensor, epoch: int, seed: int, hflip: bool) -> torch.Tensor:
    """0/1 per sample: the pad crop's flip bit (augment.crop_flip_params), on the CPU."""
    h = sample_hash(idx.cpu(), epoch, seed)
    return (h >> 20) & 1 if hflip else torch.zeros_like(h)


def rrc_bicubic(idx: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """0/1 per sample: bicubic (1) or bilinear (0) for --train_interpolation random, on the CPU."""
    return (sample_hash(idx.cpu(), epoch, seed) >> 21) & 1


def resized_crop(images: torch.Tensor, boxes: torch.Tensor, flips: torch.Tensor, size: int,
                 interpolation: str = "bilinear", bicubic: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 (N, 3, L, L) stores -> uint8 (N, 3, size, size): each box (fractions, rrc_boxes) resampled to size x size
    and mirrored where flips says, on images' device. Bilinear: one batched roi_align, no host sync; bicubic: per
    image; random: bicubic where `bicubic` (rrc_bicubic) is 1. A per-image resize needs its box on the host: small
    copies a batch where the boxes are on an accelerator (the device pipeline's), the price of bicubic there."""
    n, _, hgt, wid = images.shape
    scale = torch.tensor([wid, hgt, wid, hgt], dtype=torch.float32)
    if interpolation == "bilinear":
        each = None
    elif interpolation == "bicubic":
        each = torch.ones(n, dtype=torch.bool)
    elif bicubic is None:
        raise ValueError(f"interpolation {interpolation!r} needs its per-sample choice (rrc_bicubic)")
    else:
        each = bicubic.bool().cpu()
    if each is not None and each.all():
        out = torch.empty((n, images.shape[1], size, size), device=images.device)
    else:
        from torchvision.ops import roi_align
        px = boxes.to(images.device, torch.float32) * scale.to(images.device)
        rois = torch.cat([torch.arange(n, device=images.device, dtype=torch.float32)[:, None], px], 1)
        out = roi_align(images.float(), rois, output_size=size, sampling_ratio=-1, aligned=True)
    if each is not None and each.any():
        host = (boxes.cpu().float() * scale).round().long()
        for k in each.nonzero().flatten().tolist():
            x0, y0, x1, y1 = host[k].tolist()
            crop = images[k:k + 1, :, y0:max(y1, y0 + 1), x0:max(x1, x0 + 1)].float()
            out[k:k + 1] = F.interpolate(crop, size=(size, size), mode="bicubic", antialias=True, align_corners=False)
    out = torch.where(flips.to(images.device).view(-1, 1, 1, 1).bool(), out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)
