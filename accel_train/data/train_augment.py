"""The training augmentation as one picklable plan (`TrainAugment`) that every pipeline applies
alike.

- the crop: 'pad' (random crop with zero padding, CIFAR's: augment.crop_flip) or 'random_resized'
  (RandomResizedCrop from the stored whole image: crops.py), then the horizontal flip; batched, on
  the batch's device (the workers' RandomResizedCrop: per image, on uint8);
- timm's per-sample transforms (`SampleTransforms`: --color_jitter, --aa, --reprob), on PIL images,
  which only the cpu and cache pipelines' DataLoader workers run (load.choose_pipeline leaves the
  device pipeline out for them).

Every random choice is a function of (seed, epoch, sample index): the crops' hash (crops.py,
augment.py), and for timm's transforms, which draw from Python's, numpy's and torch's global
generators, those generators seeded from the same hash around each sample (and restored after it).
"""

from __future__ import annotations

import random
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..config.recipes import TRIVIAL, parse_pair, train_crop
from .augment import crop_flip_each, crop_flip_params, mix32, sample_hash
from .crops import resized_crop, resized_crop_each, rrc_bicubic, rrc_boxes, rrc_flips

SAMPLE_STREAM = 0x5BD1E995  # xor'ed into the crop's hash: the per-sample transforms' own seeds


@contextmanager
def seeded(seed: int):
    """Python's, numpy's and torch's CPU generators seeded with `seed` inside, restored after
    (torch.manual_seed would seed an accelerator's generators too, and leave them so)."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


class SampleTransforms:
    """timm's own per-sample training transforms, as timm's transforms_imagenet_train builds them
    (its 'secondary' stage: AutoAugment/RandAugment/AugMix from the --aa string, else ColorJitter;
    color jitter off with --aa, as timm does; --aa trivial: torchvision's TrivialAugmentWide), and
    its RandomErasing (per-pixel normal noise, timm train.py's --remode pixel). RandomErasing works
    on the normalised image: here the uint8 image is normalised, erased, and returned to uint8 (the
    noise clipped to 0..255). Built in each process on first use (not pickled)."""

    def __init__(
        self,
        size: int,
        color_jitter: float,
        aa: str | None,
        reprob: float,
        mean,
        std,
        interpolation: str = "bilinear",
    ):
        self.size, self.color_jitter, self.aa, self.reprob = size, color_jitter, aa, reprob
        self.mean, self.std, self.interpolation = tuple(mean), tuple(std), interpolation
        self._built = None

    def __getstate__(self):
        return {**self.__dict__, "_built": None}

    def build(self):
        from timm.data.transforms_factory import transforms_imagenet_train

        trivial = self.aa == TRIVIAL
        _, secondary, final = transforms_imagenet_train(
            self.size,
            auto_augment=None if trivial else self.aa,
            color_jitter=None if trivial else self.color_jitter or None,
            interpolation=self.interpolation,
            mean=self.mean,
            std=self.std,
            re_prob=self.reprob,
            re_mode="pixel",
            separate=True,
        )
        if trivial:
            from torchvision.transforms import InterpolationMode, TrivialAugmentWide

            # (one mode: torchvision's)
            mode = "bilinear" if self.interpolation == "random" else self.interpolation
            secondary.transforms.append(TrivialAugmentWide(interpolation=InterpolationMode(mode)))
        erase = final.transforms[-1] if self.reprob > 0 else None
        return secondary if secondary.transforms else None, erase

    def __call__(
        self, images: torch.Tensor, idx: torch.Tensor, epoch: int, seed: int
    ) -> torch.Tensor:
        """uint8 (N, 3, S, S) images of samples `idx` (epoch `epoch`), transformed in place."""
        from PIL import Image

        if self._built is None:
            self._built = self.build()
        pil, erase = self._built
        mean, std = torch.tensor(self.mean).view(3, 1, 1), torch.tensor(self.std).view(3, 1, 1)
        seeds = mix32(sample_hash(idx.cpu(), epoch, seed) ^ SAMPLE_STREAM).tolist()
        for k, s in enumerate(seeds):
            with seeded(s):
                x = images[k]
                if pil is not None:
                    img = pil(Image.fromarray(np.ascontiguousarray(x.permute(1, 2, 0).numpy())))
                    x = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
                if erase is not None:
                    f = erase((x.float() / 255 - mean) / std)
                    x = ((f * std + mean) * 255).round_().clamp_(0, 255).to(torch.uint8)
                images[k].copy_(x)
        return images


@dataclass
class TrainAugment:
    """The run's training augmentation (see the module's text). `pad`: the pad crop's padding;
    `per_sample`: timm's transforms, or None."""

    seed: int
    hflip: bool
    crop: str = "pad"  # 'pad' | 'random_resized'
    size: int = 32
    pad: int = 4
    scale: tuple = (0.08, 1.0)
    ratio: tuple = (3 / 4, 4 / 3)
    interpolation: str = "bilinear"
    per_sample: SampleTransforms | None = None

    @property
    def resized(self) -> bool:
        return self.crop == "random_resized"

    def boxes(
        self, idx: torch.Tensor, epoch: int, aspects: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        """RandomResizedCrop's (boxes as float32 fractions, flips, bicubic) for samples `idx`, on
        the CPU (aspects: of the whole data set, width / height; None: square images; bicubic:
        --train_interpolation random's choice)."""
        idx = idx.cpu()
        a = torch.ones(len(idx), dtype=torch.float64) if aspects is None else aspects[idx]
        return (
            rrc_boxes(idx, epoch, self.seed, a, self.scale, self.ratio).float(),
            rrc_flips(idx, epoch, self.seed, self.hflip),
            rrc_bicubic(idx, epoch, self.seed),
        )

    def crop_batch(
        self,
        images: torch.Tensor,
        idx: torch.Tensor,
        epoch: int,
        aspects=None,
        boxes=None,
        out: torch.Tensor | None = None,
        per_image: bool = False,
    ) -> torch.Tensor:
        """uint8 stores (whole images, or the images themselves for 'pad') -> uint8 crops of `size`,
        into `out` (zeros of that shape, any memory format) where given. `boxes`: this batch's from
        .boxes, where already made. RandomResizedCrop: one batched resample on the images' device
        (the device pipeline's on an accelerator), or with `per_image` or stores on a CPU (the
        workers', and the device pipeline's on a CPU device, into `out`) each crop resized on uint8:
        on a CPU ~15x faster than the batched resample on floats (bench/data_bench.py --kernels;
        crops.py: the two agree)."""
        if self.resized:
            boxes, flips, bicubic = boxes if boxes is not None else self.boxes(idx, epoch, aspects)
            if per_image or images.device.type == "cpu":
                if out is None:  # (channels-last: the uint8 resize's own; the caller normalises)
                    out = torch.empty(
                        (len(images), self.size, self.size, 3), dtype=torch.uint8
                    ).permute(0, 3, 1, 2)
                return resized_crop_each(images, boxes, flips, out, self.interpolation, bicubic)
            crops = resized_crop(images, boxes, flips, self.size, self.interpolation, bicubic)
            return crops if out is None else out.copy_(crops)
        params = crop_flip_params(idx, epoch, self.seed, self.pad, self.hflip)
        return crop_flip_each(images, *params, pad=self.pad, out=out)


def plan(cfg, info, pad: int | None = None) -> TrainAugment | None:
    """The run's TrainAugment from its flags and data (None: --augment false)."""
    if not cfg.augment:
        return None
    per_sample = (
        SampleTransforms(
            info.image_size,
            cfg.color_jitter,
            cfg.aa,
            cfg.reprob,
            info.mean,
            info.std,
            cfg.train_interpolation,
        )
        if (cfg.color_jitter or cfg.aa or cfg.reprob)
        else None
    )
    return TrainAugment(
        cfg.seed,
        cfg.hflip,
        train_crop(cfg.data, cfg.train_crop),
        info.image_size,
        info.pad if pad is None else pad,
        parse_pair("scale", cfg.scale, 0, 1),
        parse_pair("ratio", cfg.ratio, 0),
        cfg.train_interpolation,
        per_sample,
    )
