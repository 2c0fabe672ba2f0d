"""RandomResizedCrop, the image-folder recipe (timm's, torchvision's, FFCV's, DALI's), the same math
in every pipeline.

Each training image is stored once as the WHOLE image squashed to L x L (L = store_size: a bounded
multiple of the training size, as FFCV stores images at a bounded resolution) with its own aspect
ratio (width / height) beside it: a uniform array the device pipeline keeps on the device and the
decoded cache maps. A crop is drawn in the original image's coordinates, exactly as timm's
RandomResizedCropAndInterpolation.get_params draws it (area fraction in --scale, log-uniform aspect
ratio in --ratio, 10 attempts, then the central fallback), as fractions of the width and height: the
same fractions of the squashed store are the same region of the image. Its randomness is a hash of
(seed, epoch, sample index) computed on the CPU in float64 (rrc_boxes): every pipeline, world size
and resume crops alike.

The box is snapped to whole pixels of the store (at most half a stored pixel per edge: 0.15% of the
side at L = 336), and that region is resampled to image_size x image_size, antialiased, by one of
two kernels that agree (tests/test_train_recipe.py states by how much: mean |difference| ~0.25 of
255, bilinear):
- the device pipeline's on an accelerator: torchvision.ops.roi_align on floats, batched (bilinear
  with an adaptive number of samples per output pixel: area-averaged when the crop shrinks), no host
  sync;
- on a CPU (the cpu and cache pipelines' DataLoader workers, and the device pipeline where the
  device is the CPU): torch's uint8 antialiased resize, per image (the kernel torchvision's v2
  resize calls for uint8), writing uint8 straight into the batch: 0.14 ms an image from
  channels-last rows against roi_align's 2.5-2.9 ms on one thread (bench/data_bench.py --kernels).
--train_interpolation bicubic resizes each crop by itself (antialiased bicubic; the device pipeline
on floats, the workers on uint8); random (timm train.py's default) picks bilinear or bicubic per
sample, half each, from the same hash.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .augment import mix32, sample_hash

STORE_SCALE = 1.5  # the stored whole image's side, x the training size (FFCV's ImageNet configs:
# max_res ~1.3-2.5x)
ATTEMPTS = 10  # timm's and torchvision's RandomResizedCrop


def store_size(image_size: int) -> int:
    """L: the side of the squashed whole image kept for RandomResizedCrop (a multiple of 8)."""
    return max(8, math.ceil(image_size * STORE_SCALE / 8) * 8)


def uniforms(idx: torch.Tensor, epoch: int, seed: int, n: int) -> torch.Tensor:
    """(len(idx), n) float64 in [0, 1): n independent draws per (seed, epoch, sample index), on the
    CPU."""
    h = sample_hash(idx.cpu(), epoch, seed)
    k = (torch.arange(1, n + 1, dtype=torch.long) * 0x9E3779B9) & 0xFFFFFFFF
    return mix32(h[:, None] ^ k).double() / 2**32


def rrc_boxes(
    idx: torch.Tensor,
    epoch: int,
    seed: int,
    aspects: torch.Tensor,
    scale=(0.08, 1.0),
    ratio=(3 / 4, 4 / 3),
) -> torch.Tensor:
    """(len(idx), 4) float64 crops (x0, y0, x1, y1) as fractions of each image's width and height:
    timm's RandomResizedCrop parameters for images of `aspects` (width / height), drawn from the
    hash of (seed, epoch, idx)."""
    a = aspects.double().cpu()
    u = uniforms(idx, epoch, seed, 4 * ATTEMPTS)
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    # the central fallback (no attempt fits): the whole image, or its middle at the nearest allowed
    # ratio
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


def pixel_boxes(boxes: torch.Tensor, hgt: int, wid: int) -> torch.Tensor:
    """Boxes as fractions (rrc_boxes) -> float32 (x0, y0, x1, y1) whole pixels of a hgt x wid store,
    at least one pixel each way, on boxes' device: the same integers on every device (float32
    products, round half to even)."""
    scale = torch.tensor([wid, hgt, wid, hgt], dtype=torch.float32, device=boxes.device)
    px = (boxes.float() * scale).round()
    return torch.cat([px[:, :2], torch.maximum(px[:, 2:], px[:, :2] + 1)], 1)


def resized_crop(
    images: torch.Tensor,
    boxes: torch.Tensor,
    flips: torch.Tensor,
    size: int,
    interpolation: str = "bilinear",
    bicubic: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 (N, 3, L, L) stores -> uint8 (N, 3, size, size): each box (fractions, rrc_boxes)
    resampled to size x size and mirrored where flips says, on images' device: the device
    pipeline's. Bilinear: one batched roi_align, no host sync; bicubic: per image; random: bicubic
    where `bicubic` (rrc_bicubic) is 1. A per-image resize needs its box on the host: small copies a
    batch where the boxes are on an accelerator, the price of bicubic there."""
    n, _, hgt, wid = images.shape
    each = _bicubic_each(n, interpolation, bicubic)
    if each is not None and each.all():
        out = torch.empty((n, images.shape[1], size, size), device=images.device)
    else:
        from torchvision.ops import roi_align

        px = pixel_boxes(boxes.to(images.device), hgt, wid)
        rois = torch.cat(
            [torch.arange(n, device=images.device, dtype=torch.float32)[:, None], px], 1
        )
        out = roi_align(images.float(), rois, output_size=size, sampling_ratio=-1, aligned=True)
    if each is not None and each.any():
        host = pixel_boxes(boxes.cpu(), hgt, wid).long()
        for k in each.nonzero().flatten().tolist():
            x0, y0, x1, y1 = host[k].tolist()
            crop = images[k : k + 1, :, y0:y1, x0:x1].float()
            out[k : k + 1] = F.interpolate(
                crop, size=(size, size), mode="bicubic", antialias=True, align_corners=False
            )
    out = torch.where(flips.to(images.device).view(-1, 1, 1, 1).bool(), out.flip(-1), out)
    return out.round_().clamp_(0, 255).to(torch.uint8)


def resized_crop_each(
    images: torch.Tensor,
    boxes: torch.Tensor,
    flips: torch.Tensor,
    out: torch.Tensor,
    interpolation: str = "bilinear",
    bicubic: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cpu and cache pipelines' resized_crop: uint8 stores (N, 3, L, L; a mapped array's rows
    too) on a CPU -> `out`, uint8 (N, 3, S, S) in any memory format, each crop resized by itself on
    uint8 and written into its row, mirrored where flips says. The same boxes and interpolation as
    resized_crop; no floats. The kernel: torch's antialiased uint8 resize (what torchvision's v2
    resize calls for uint8), fastest on a crop of channels-last stores (the decoded cache's rows, a
    decoded file: H x W x 3 in memory) into a channels-last `out`: 0.14 ms an image at 336 -> 224 px
    on one thread, against 0.23 into NCHW rows and 0.38 from NCHW stores (bench/data_bench.py
    --kernels)."""
    n, _, hgt, wid = images.shape
    size = tuple(out.shape[-2:])
    each = _bicubic_each(n, interpolation, bicubic)
    modes = (
        ["bilinear"] * n
        if each is None
        else ["bicubic" if b else "bilinear" for b in each.tolist()]
    )
    host = pixel_boxes(boxes.cpu(), hgt, wid).long().tolist()
    for k, ((x0, y0, x1, y1), flip, mode) in enumerate(zip(host, flips.tolist(), modes)):
        crop = F.interpolate(
            images[k : k + 1, :, y0:y1, x0:x1],
            size=size,
            mode=mode,
            antialias=True,
            align_corners=False,
        )
        out[k : k + 1].copy_(crop.flip(-1) if flip else crop)
    return out


def _bicubic_each(n: int, interpolation: str, bicubic: torch.Tensor | None) -> torch.Tensor | None:
    """Which of n samples are resized bicubic (bool, on the CPU); None: all bilinear."""
    if interpolation == "bilinear":
        return None
    if interpolation == "bicubic":
        return torch.ones(n, dtype=torch.bool)
    if bicubic is None:
        raise ValueError(
            f"interpolation {interpolation!r} needs its per-sample choice (rrc_bicubic)"
        )
    return bicubic.bool().cpu()
