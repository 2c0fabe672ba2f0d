"""Data: the CIFAR-10 python-batches reader, random data, augmentation and the loaders.

Two pipelines, one contract. Both return DataLoaders that `accelerator.prepare` shards, and an
`inputs(batch, train, epoch)` function that turns what a prepared loader yields into
(normalised images, labels) on the device.

- `device` (default): the uint8 images (150 MB for all of CIFAR-10) live on the accelerator; the
  loaders yield only index batches; each batch is gathered there and augmented there, batched.
- `cpu`: per-sample torchvision transforms in DataLoader workers, for data that does not fit.

Augmentation is random crop with 4-pixel zero padding, then horizontal flip, then normalisation.
On the device its randomness is a hash of (seed, epoch, sample index): the same sample in the same
epoch gets the same crop and flip whatever the world size, the batch size or a resume.
"""

from __future__ import annotations

import codecs
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from .config import CIFAR10_MEAN, CIFAR10_STD, NUM_CLASSES, ConfigError, TrainConfig

CIFAR_DIR = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
PAD = 4


class DataError(ConfigError):
    """The data on disk is missing or not in the CIFAR-10 python format."""


# ---------------------------------------------------------------------------------------------
# CIFAR-10 reader
# ---------------------------------------------------------------------------------------------

def _numpy_globals() -> dict:
    core = getattr(np, "_core", None) or np.core
    # _codecs.encode: how Python 3 writes bytes in protocol-2 pickles (a pure data transform)
    allowed = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype, ("_codecs", "encode"): codecs.encode}
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(module, "_reconstruct")] = core.multiarray._reconstruct
        allowed[(module, "scalar")] = core.multiarray.scalar
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """Admits only what numpy arrays, lists, dicts, bytes and ints need; refuses any other global,
    so a pickle that would run code (os.system, eval, ...) fails before anything runs."""

    ALLOWED = _numpy_globals()

    def find_class(self, module, name):
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refused global {module}.{name}") from None


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-10 batch file -> (N x 3 x 32 x 32 uint8, N int64 labels), validated."""
    try:
        with open(path, "rb") as f:
            obj = RestrictedUnpickler(f, encoding="bytes").load()
    except pickle.UnpicklingError as e:
        if "refused global" in str(e):
            raise DataError(f"{path} is not a plain CIFAR-10 pickle ({e}); it was not executed - replace it "
                            "with the original cifar-10-batches-py file") from None
        raise DataError(f"{path} is truncated or corrupt ({e}); re-extract cifar-10-python.tar.gz") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise DataError(f"{path} is truncated or corrupt ({type(e).__name__}: {e}); "
                        "re-extract cifar-10-python.tar.gz") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not a CIFAR-10 batch dict")
    data = obj.get(b"data", obj.get("data"))
    labels = obj.get(b"labels", obj.get("labels"))
    if data is None or labels is None:
        raise DataError(f"{path} has no 'data'/'labels' entries; is it a CIFAR-10 python batch?")
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise DataError(f"{path}: data must be an N x 3072 uint8 array, got shape {shape} dtype {dtype}")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.shape[0] != data.shape[0] or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{path}: expected {data.shape[0]} integer labels, got shape {labels.shape} "
                        f"dtype {labels.dtype}")
    if labels.size and (labels.min() < 0 or labels.max() >= NUM_CLASSES):
        raise DataError(f"{path}: labels must be in 0..{NUM_CLASSES - 1}, found {labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def read_cifar10(data_dir) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """<data_dir>/cifar-10-batches-py -> {'train': (images u8, labels), 'test': (...)}."""
    data_dir = Path(data_dir)
    root = data_dir / CIFAR_DIR
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist; pass --data_dir (or --data_url) pointing "
                        f"at the folder that holds {CIFAR_DIR}/, or use --data random")
    if not root.is_dir():
        raise DataError(f"{data_dir} has no {CIFAR_DIR}/ folder; extract cifar-10-python.tar.gz there, "
                        "or use --data random")
    missing = [name for name in TRAIN_FILES + (TEST_FILE,) if not (root / name).is_file()]
    if missing:
        raise DataError(f"{root} lacks {', '.join(missing)}; re-extract cifar-10-python.tar.gz")
    out = {}
    for split, names in (("train", TRAIN_FILES), ("test", (TEST_FILE,))):
        parts = [read_batch(root / name) for name in names]
        images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        if len(labels) == 0:
            raise DataError(f"{root}: the {split} split is empty")
        out[split] = (images, labels)
    return out


def random_data(train_samples: int, test_samples: int, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Uniform random uint8 images and labels, the same for the same seed on every rank."""
    out = {}
    for i, (split, n) in enumerate((("train", train_samples), ("test", test_samples))):
        g = torch.Generator().manual_seed(seed * 2 + i)
        images = torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, NUM_CLASSES, (n,), generator=g)
        out[split] = (images, labels)
    return out


def load_splits(cfg: TrainConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if cfg.data == "random":
        return random_data(cfg.train_samples or 50_000, cfg.test_samples or 10_000, cfg.seed)
    splits = read_cifar10(cfg.data_dir)
    limits = {"train": cfg.train_samples, "test": cfg.test_samples}
    return {k: (x[: limits[k]], y[: limits[k]]) for k, (x, y) in splits.items()}


# ---------------------------------------------------------------------------------------------
# Augmentation
# ---------------------------------------------------------------------------------------------

def sample_hash(idx: torch.Tensor, epoch: int, seed: int) -> torch.Tensor:
    """A 32-bit hash per (seed, epoch, sample index), computed on idx's device (int64, no overflow)."""
    m = 0xFFFFFFFF
    x = (idx.long() * 2654435761 + (epoch * 40503 + seed * 97531 + 12345) % 2**31) & m
    for _ in range(2):
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & m
    return x ^ (x >> 16)


def crop_flip_params(idx: torch.Tensor, epoch: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Per-sample crop offsets (0..2*PAD, top and left in the padded image) and flips (0/1)."""
    h = sample_hash(idx, epoch, seed)
    top = h % (2 * PAD + 1)
    left = (h >> 8) % (2 * PAD + 1)
    flip = (h >> 20) & 1
    return top, left, flip


def crop_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Batched RandomCrop(32, padding=4) then RandomHorizontalFlip, as one gather on the device."""
    n, c, h, w = images.shape
    padded = F.pad(images, (PAD, PAD, PAD, PAD))
    ar_h = torch.arange(h, device=images.device)
    ar_w = torch.arange(w, device=images.device)
    rows = top[:, None] + ar_h                                                     # n, h
    cols = left[:, None] + torch.where(flip[:, None].bool(), w - 1 - ar_w, ar_w)  # n, w
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, chans, rows[:, None, :, None], cols[:, None, None, :]]


class Normalize:
    """uint8 -> float, (x/255 - mean) / std, as one fused multiply-add."""

    def __init__(self, device, mean=CIFAR10_MEAN, std=CIFAR10_STD):
        std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, device=device).view(1, 3, 1, 1) / std_t

    def __call__(self, images_u8: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, images_u8.float(), self.scale)


def cpu_transforms() -> v2.Compose:
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR10_MEAN, CIFAR10_STD)])


# ---------------------------------------------------------------------------------------------
# Datasets and loaders
# ---------------------------------------------------------------------------------------------

class IndexDataset(Dataset):
    """Yields sample indices only: the device pipeline gathers the samples itself."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def __getitems__(self, indices):
        return torch.as_tensor(indices, dtype=torch.long)


def _identity(batch):
    return batch


class TransformDataset(Dataset):
    """uint8 tensors + per-sample crop/flip and a torchvision transform (the cpu pipeline).

    The crop and flip of sample i in epoch e are the device pipeline's hash of (seed, e, i), not the
    workers' RNG, so a resumed run (and any number of workers or ranks) augments exactly alike. The
    DataLoader calls set_epoch before each epoch (through the prepared loader); the workers are
    started per epoch, so they see it.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform, augment_seed: int | None = None):
        self.images, self.labels, self.transform = images, labels, transform
        self.augment_seed, self.epoch = augment_seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        image = self.images[i]
        if self.augment_seed is not None:
            idx = torch.tensor([i])
            image = crop_flip(image[None], *crop_flip_params(idx, self.epoch, self.augment_seed))[0]
        return self.transform(image), self.labels[i]


@dataclass
class Data:
    train_loader: DataLoader
    test_loader: DataLoader
    inputs: Callable  # (batch, train: bool, epoch: int) -> (images, labels) on the device
    train_size: int
    test_size: int


def build_data(cfg: TrainConfig, device, splits=None) -> Data:
    splits = splits if splits is not None else load_splits(cfg)
    (train_x, train_y), (test_x, test_y) = splits["train"], splits["test"]
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format

    if cfg.pipeline == "device":
        train_x, train_y, test_x, test_y = (t.to(device) for t in (train_x, train_y, test_x, test_y))
        normalize = Normalize(device)

        def inputs(idx, train, epoch=0):
            images = (train_x if train else test_x)[idx]
            if train and cfg.augment:
                images = crop_flip(images, *crop_flip_params(idx, epoch, cfg.seed))
            x = normalize(images).contiguous(memory_format=memory_format)
            return x, (train_y if train else test_y)[idx]

        train_ds, test_ds = IndexDataset(len(train_y)), IndexDataset(len(test_y))
        collate, workers = _identity, 0
    else:
        def inputs(batch, train, epoch=0):
            x, y = batch
            return x.contiguous(memory_format=memory_format), y

        train_ds = TransformDataset(train_x, train_y, cpu_transforms(), cfg.seed if cfg.augment else None)
        test_ds = TransformDataset(test_x, test_y, cpu_transforms())
        collate, workers = None, cfg.num_workers

    common = dict(batch_size=cfg.batch_size, num_workers=workers, collate_fn=collate)
    # training workers restart each epoch so they see the epoch (set_epoch) their augmentation depends on
    train_loader = DataLoader(train_ds, shuffle=True, drop_last=True, persistent_workers=False, **common)
    test_loader = DataLoader(test_ds, shuffle=False, drop_last=False, persistent_workers=workers > 0, **common)
    return Data(train_loader, test_loader, inputs, len(train_y), len(test_y))
