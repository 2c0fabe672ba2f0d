"""Image files: reading and decoding them, the errors that name unreadable ones (and the notes on
images far from the size they are decoded at), and the training images' channel statistics. Which
files make each split of an image folder: folders.py."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config.train_config import SIZE_SAMPLE
from ..errors import Preempted
from ..lines import counted
from .info import DataError


class UnreadableImage(DataError):
    """One image file Pillow cannot read; `path` and `reason` for a list of several
    (unreadable_images). Rebuilt from one argument, its message (a DataLoader worker's: DataError),
    it has neither."""

    def __init__(self, path, reason: str | None = None):
        super().__init__(
            str(path)
            if reason is None
            else (
                f"{path} does not exist; check the path"
                if reason == MISSING
                else f"{path} is not a readable image ({reason}); replace or remove it"
            )
        )
        self.path, self.reason = (None, None) if reason is None else (path, reason)


# Pixels an image may need decoded (a JPEG's after its reduced-scale draft): Pillow refuses only
# from 179 M, and a 20 KB 1-bit PNG of 169 M pixels took 1.6 GB to decode; 64 M is a 50 MP photo
# with room to spare
MAX_DECODED_PIXELS = 64_000_000


def too_large(path, img) -> None:
    """An image past MAX_DECODED_PIXELS (as it would be decoded now: a JPEG at the least scale its
    draft allows unless `draft` already ran) is refused as unreadable, named with its size."""
    w, h = img.size
    least = 64 if img.format == "JPEG" and getattr(img, "decoderconfig", ()) == () else 1
    if w * h / least > MAX_DECODED_PIXELS:
        raise UnreadableImage(
            path,
            f"{w}x{h}, {w * h / 1e6:.0f} M pixels to decode, over "
            f"accel_train's limit of {MAX_DECODED_PIXELS // 1_000_000} M: "
            "downscale it",
        )


MISSING = "no such file"


def why_unreadable(path, error: Exception) -> str:
    """Pillow's reason in a few words; an empty file is called one (Pillow says "cannot identify
    image file")."""
    if isinstance(error, FileNotFoundError):
        return MISSING
    try:
        if os.path.getsize(path) == 0:
            return "empty file, 0 bytes"
    except OSError:
        pass
    return str(error).splitlines()[0][:120] if str(error) else type(error).__name__


NAMED_BAD_IMAGES = 10  # an error names this many unreadable files, then counts the rest


def unreadable_images(errors: list[UnreadableImage]) -> DataError:
    """Every unreadable file found in one pass, in one message (the first NAMED_BAD_IMAGES
    named)."""
    if len(errors) == 1:
        return errors[0]
    errors = sorted(errors, key=lambda e: str(e.path))
    # (no 2nd path)
    named = ", ".join(
        f"{e.path} ({' '.join(e.reason.replace(repr(str(e.path)), '').split())})"
        for e in errors[:NAMED_BAD_IMAGES]
    )
    more = f" and {len(errors) - NAMED_BAD_IMAGES} more" if len(errors) > NAMED_BAD_IMAGES else ""
    return DataError(
        f"{len(errors)} files are not readable images: {named}{more}; replace or remove them"
    )


# 16-bit grayscale PNG/TIFF (I: older Pillow, int TIFF)
SIXTEEN_BIT = ("I", "I;16", "I;16L", "I;16B", "I;16N")


def to_rgb(img):
    """Any mode -> RGB. 16-bit grayscale keeps its top 8 bits (value >> 8; mode I is read as
    0..65535 and clipped there): Pillow's own convert clips at 255 and turns most of such an image
    white."""
    from PIL import Image

    if img.mode in SIXTEEN_BIT:
        values = np.clip(np.asarray(img).astype(np.int64), 0, 65535) >> 8
        return Image.fromarray(values.astype(np.uint8)).convert("RGB")
    return (
        img.convert("RGBA").convert("RGB") if img.mode in ("P", "PA", "LA") else img.convert("RGB")
    )


@dataclass(frozen=True)
class Decode:
    """How a split's files become its stored uint8 squares of `size` px: the shorter side resized to
    size / crop_pct (timm's eval transform: floor(size / crop_pct)) and the centre cropped, or
    (`whole`) the whole image squashed to size x size, the RandomResizedCrop store (crops.py). A
    bare int where one is asked: Decode(int)."""

    size: int
    crop_pct: float = 1.0
    whole: bool = False

    def name(self) -> str:
        """Its part of a decoded cache's file name (the crop_pct 1 decode keeps the older name)."""
        return f"{self.size}px" + (
            "_whole" if self.whole else "" if self.crop_pct == 1 else f"_crop{self.crop_pct:g}"
        )


def as_decode(size) -> Decode:
    return size if isinstance(size, Decode) else Decode(int(size))


def decode_image(
    path,
    size,
    crop_pct: float = 1.0,
    whole: bool = False,
    small: list | None = None,
    channels_last: bool = False,
) -> torch.Tensor:
    """An image file (any mode Pillow reads) -> 3 x size x size uint8: turned upright as its EXIF
    orientation says (phone photos), RGB, shorter side resized to floor(size / crop_pct) (bilinear,
    antialiased), centre crop; or (`whole`) the whole image resized to size x size. Training,
    evaluate and predict all see images through this. `size` may be a Decode (its crop_pct and whole
    then). `channels_last`: the decoded H x W x 3 pixels seen as 3 x H x W, for a crop that is
    resized next (crops.resized_crop_each)."""
    from PIL import Image, ImageOps

    if isinstance(size, Decode):
        size, crop_pct, whole = size.size, size.crop_pct, size.whole
    short = size if whole else max(size, math.floor(size / crop_pct))
    try:
        with Image.open(path) as img:
            if small is not None and min(img.size) * SMALL < size:  # (for note_small)
                small.append((path, *img.size))
            # JPEG: decode at the smallest scale that is still >= the size
            img.draft("RGB", (short, short))
            too_large(path, img)
            # (no copy of an image without an orientation)
            ImageOps.exif_transpose(img, in_place=True)
            img = to_rgb(img)
            w, h = img.size
            if whole:
                squashed = squash(img, size)
            else:
                scale = short / min(w, h)
                target = (max(short, round(w * scale)), max(short, round(h * scale)))
                if (w, h) != target:
                    img = img.resize(target, Image.BILINEAR)
                w, h = img.size
                left, top = (w - size) // 2, (h - size) // 2
                img = img.crop((left, top, left + size, top + size))
                array = np.asarray(img, dtype=np.uint8)
    except UnreadableImage:
        raise
    # Pillow raises many kinds (OSError, SyntaxError, struct.error, ...) for a broken file
    except Exception as e:
        raise UnreadableImage(path, why_unreadable(path, e)) from None
    # (numpy's transposing copy: torch's permute().contiguous() of a small uint8 image took 0.2 ms
    # on one thread and 5-8 ms with two on a loaded machine, as long as the reduced-scale decode
    # itself)
    if whole:
        return squashed if channels_last else squashed.contiguous()
    if channels_last:  # (Pillow's array is read-only: a copy, in its own layout)
        return torch.from_numpy(array.copy()).permute(2, 0, 1)
    return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))


SQUASH_PIXELS = 16  # a decoded image of more pixels than this x the store's: Pillow's resize


def squash_kernel() -> str:
    """What resizes a whole image to its store: "torch" where torch's uint8 resize has its
    vectorised kernel (an AVX2 or AVX-512 build: 0.22 ms for a 460 x 330 photo to 336 px against
    Pillow's 1.38), else "pillow" (torch's generic uint8 kernel there: 2.9 ms)."""
    return "torch" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "pillow"


def squash(img, size: int) -> torch.Tensor:
    """A decoded RGB image (PIL) -> the whole image resized to size x size (3 x size x size,
    channels-last): torch's antialiased uint8 bilinear resize, Pillow's bilinear within 1 level
    (mean 0.007) at a sixth of its time (0.22 ms for a 460 x 330 photo to 336 px, one thread; the
    batch dimension first, so that torch sees a channels-last batch and keeps it). Pillow's own
    resize, from its own buffer, where squash_kernel says so or the image is large (no copies of
    its full-size pixels)."""
    from PIL import Image

    w, h = img.size
    if (w, h) != (size, size) and (squash_kernel() != "torch" or w * h > SQUASH_PIXELS * size**2):
        img = img.resize((size, size), Image.BILINEAR)
    image = torch.from_numpy(np.array(img, dtype=np.uint8))[None].permute(0, 3, 1, 2)
    if image.shape[-2:] != (size, size):
        image = torch.nn.functional.interpolate(
            image, size=(size, size), mode="bilinear", antialias=True, align_corners=False
        )
    return image[0]


def never() -> str | None:
    """A should_stop that never asks to stop (no trainer's stop request to answer)."""
    return None


def decode_all(
    files: list[Path], size, say_small: bool = False, should_stop: Callable[[], str | None] = never
) -> tuple[torch.Tensor, float]:
    """Decode every file once (a thread pool: Pillow releases the GIL) -> (N x 3 x size x size
    uint8, images/s); `size`: an int or a Decode. `should_stop` names a stop that the caller
    received meanwhile (the trainer's: a stop signal), or None: a name ends the decode at once,
    Preempted."""
    start = time.perf_counter()
    spec = as_decode(size)
    out = torch.empty((len(files), 3, spec.size, spec.size), dtype=torch.uint8)

    small = []

    def one(i):
        if should_stop() is not None:  # (the rest of the pool's files are passed over)
            return None
        try:
            out[i] = decode_image(files[i], spec, small=small)
        except UnreadableImage as e:
            return e

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        errors = [e for e in pool.map(one, range(len(files))) if e is not None]
    if (stop := should_stop()) is not None:
        raise Preempted(f"stopped by {stop} while decoding {len(files)} images at start-up")
    if errors:
        raise unreadable_images(errors)
    if say_small:  # (where no check_images said it)
        note_small(small, len(files), spec)
    return out, len(files) / max(time.perf_counter() - start, 1e-9)


def native_size(files: list[Path], limit: int = SIZE_SAMPLE) -> int | None:
    """The images' own size: the median shorter side of up to `limit` evenly spaced files (headers
    only, no decoding; the same files on every rank). None if none is readable (the decode or check
    names them)."""
    from PIL import Image

    sides = []
    for i in (
        np.linspace(0, len(files) - 1, min(limit, len(files))).round().astype(int) if files else ()
    ):
        try:
            with Image.open(files[i]) as img:
                sides.append(min(img.size))
        except Exception:  # a broken file: named by check_images / decode_image, not here
            continue
    return int(np.median(sides)) if sides else None


def check_images(files: list[Path], size=None) -> torch.Tensor:
    """The cpu pipeline decodes later, in workers: read every file's header now (cheap, no decoding)
    so that a file that is not an image stops the run before it starts, named. (A file whose header
    is fine but whose pixel data is truncated is only found, and named, when a worker decodes it.)
    Returns each image's aspect ratio, width / height upright (EXIF orientations 5-8 turn it):
    float64, what RandomResizedCrop needs (crops.py). `size` (an int or a Decode): the size they are
    decoded at, for note_small."""
    from PIL import Image

    small = []

    def one(path):
        try:
            with Image.open(path) as img:
                too_large(path, img)
                w, h = img.size
                turned = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)
            if size is not None and min(w, h) * SMALL < as_decode(size).size:
                small.append((path, w, h))
            return h / w if turned else w / h
        except UnreadableImage as e:
            return e
        except Exception as e:  # Pillow raises many kinds for a broken file
            return UnreadableImage(path, why_unreadable(path, e))

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        found = list(pool.map(one, files))
    errors = [e for e in found if isinstance(e, UnreadableImage)]
    if errors:
        raise unreadable_images(errors)
    note_small(small, len(files), size)
    return torch.tensor(found, dtype=torch.float64)


# an image whose shorter side is under 1/SMALL of the size it is decoded at is noted: mostly
# interpolation
SMALL = 4


def note_small(small: list[tuple], n: int, size) -> None:
    """One line for the images far smaller than the size they are decoded at (upscaled: little to
    learn from)."""
    if small:
        side = as_decode(size).size
        path, w, h = min(small, key=lambda s: (min(s[1], s[2]), str(s[0])))
        logging.getLogger("accel_train").warning(
            f"{counted(len(small), 'image')} of {n} are far smaller than the {side} px they are "
            f"decoded at (shorter side under {side / SMALL:g} px; the smallest: {path}, {w}x{h}): "
            "upscaled, with little detail to learn from; remove them, or pass a smaller "
            "--image_size"
        )


def channel_stats(images) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std in [0, 1] of N x 3 x H x W uint8 images (a tensor, or the decoded
    cache's mapped array: the same sums in the same order, the same numbers)."""
    total, squares = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for start in range(0, len(images), 256):
        chunk = images[start : start + 256]
        c = (
            chunk if isinstance(chunk, torch.Tensor) else torch.from_numpy(np.array(chunk))
        ).double()
        total += c.sum((0, 2, 3))
        squares += (c * c).sum((0, 2, 3))
    n = int(np.prod(images.shape)) / 3
    mean = total / n / 255
    std = (squares / n / 255**2 - mean**2).clamp_min(1e-6).sqrt().clamp_min(1e-3)
    return tuple(round(v, 4) for v in mean.tolist()), tuple(round(v, 4) for v in std.tolist())
