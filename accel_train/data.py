"""Data: what a data set is (DataInfo), its readers (CIFAR-10 batches, image folders, random data),
augmentation and the loaders.

`DataInfo` is the one description of a data set: class names, mean/std, input size. CIFAR-10 is one
instance (`CIFAR10`); an image folder gets its own from its folder names and its training images. The
model's head, the export (model_config.json), `evaluate` and `predict` all read it.

Two pipelines, one contract. Both return DataLoaders that `accelerator.prepare` shards, and an
`inputs(batch, train, epoch)` function that turns what a prepared loader yields into
(normalised images, labels) on the device.

- `device`: the uint8 images (150 MB for all of CIFAR-10; an image folder is decoded and resized once)
  live on the accelerator; the loaders yield only index batches; each batch is gathered there and
  augmented there, batched.
- `cpu`: per-sample torchvision transforms in DataLoader workers (an image folder's files are decoded
  there, per sample), for data that does not fit.
`--pipeline auto` (the default) takes the device pipeline when the decoded uint8 data fits
`--device_data_mb` (default a quarter of the device's free memory), else the cpu one.

Augmentation is random crop with zero padding of image_size/8 pixels (4 at 32), then horizontal flip
(`--hflip false` turns it off), then normalisation. In both pipelines its randomness is a hash of (seed,
epoch, sample index): the same sample in the same epoch gets the same crop and flip whatever the world
size, the batch size or a resume.
"""

from __future__ import annotations

import codecs
import os
import pickle
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

from .config import SIZE_SAMPLE, ConfigError, TrainConfig

CIFAR_DIR = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"
EVAL_DIRS = ("val", "validation", "test")  # an image folder's evaluation split, first found wins
STATS_SAMPLE = 2048  # training images decoded to estimate mean/std when the cpu pipeline decodes per sample


class DataError(ConfigError):
    """The data on disk is missing, unreadable or not in the expected layout."""


class UnreadableImage(DataError):
    """One image file Pillow cannot read; `path` and `reason` for a list of several (unreadable_images)."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path} is not a readable image ({reason}); replace or remove it")
        self.path, self.reason = path, reason


NAMED_BAD_IMAGES = 10  # an error names this many unreadable files, then counts the rest


def unreadable_images(errors: list[UnreadableImage]) -> DataError:
    """Every unreadable file found in one pass, in one message (the first NAMED_BAD_IMAGES named)."""
    if len(errors) == 1:
        return errors[0]
    errors = sorted(errors, key=lambda e: str(e.path))
    named = ", ".join(f"{e.path} ({' '.join(e.reason.replace(repr(str(e.path)), '').split())})"  # (no 2nd path)
                      for e in errors[:NAMED_BAD_IMAGES])
    more = f" and {len(errors) - NAMED_BAD_IMAGES} more" if len(errors) > NAMED_BAD_IMAGES else ""
    return DataError(f"{len(errors)} files are not readable images: {named}{more}; replace or remove them")


@dataclass(frozen=True)
class DataInfo:
    """The facts of a data set that the model, the export, evaluate and predict share."""
    name: str
    classes: tuple[str, ...]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    image_size: int

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def pad(self) -> int:
        """Crop padding: 4 pixels at 32x32 (the CIFAR recipe), scaled with the image size."""
        return max(1, round(self.image_size / 8))

    def model_config(self) -> dict:
        """The data half of model_config.json (timm's data-config names where there is one)."""
        return {"data": self.name, "num_classes": self.num_classes, "input_size": [3, self.image_size, self.image_size],
                "mean": list(self.mean), "std": list(self.std), "classes": list(self.classes),
                "interpolation": "bilinear", "crop_pct": 1.0, "resize": "shorter side, then centre crop"}

    @classmethod
    def from_model_config(cls, meta: dict) -> "DataInfo":
        return cls(meta.get("data", "cifar10"), tuple(meta["classes"]), tuple(meta["mean"]), tuple(meta["std"]),
                   int(meta["input_size"][-1]))


# CIFAR-10: channel statistics computed on the 50,000 training images; random data borrows them.
CIFAR10 = DataInfo("cifar10", ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                               "truck"), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 32)


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
    if labels.size and (labels.min() < 0 or labels.max() >= CIFAR10.num_classes):
        raise DataError(f"{path}: labels must be in 0..{CIFAR10.num_classes - 1}, found {labels.min()}..{labels.max()}")
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def read_cifar10(data_dir, splits=("train", "test")) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """<data_dir>/cifar-10-batches-py -> {'train': (images u8, labels), 'test': (...)}, only the splits asked for."""
    data_dir = Path(data_dir)
    root = data_dir / CIFAR_DIR
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist; pass --data_dir (or --data_url) pointing "
                        f"at the folder that holds {CIFAR_DIR}/, or use --data random")
    if not root.is_dir():
        raise DataError(f"{data_dir} has no {CIFAR_DIR}/ folder; extract cifar-10-python.tar.gz there, "
                        "or use --data random")
    wanted = {"train": TRAIN_FILES, "test": (TEST_FILE,)}
    missing = [name for split in splits for name in wanted[split] if not (root / name).is_file()]
    if missing:
        raise DataError(f"{root} lacks {', '.join(missing)}; re-extract cifar-10-python.tar.gz")
    out = {}
    for split in splits:
        parts = [read_batch(root / name) for name in wanted[split]]
        images = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        labels = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        if len(labels) == 0:
            raise DataError(f"{root}: the {split} split is empty")
        out[split] = (images, labels)
    return out


def random_data(train_samples: int, test_samples: int, seed: int, size: int = 32, num_classes: int = 10,
                splits=("train", "test")) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Uniform random uint8 images and labels, the same for the same seed on every rank."""
    out = {}
    for i, (split, n) in enumerate((("train", train_samples), ("test", test_samples))):
        if split not in splits:
            continue
        g = torch.Generator().manual_seed(seed * 2 + i)
        images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, num_classes, (n,), generator=g)
        out[split] = (images, labels)
    return out


# ---------------------------------------------------------------------------------------------
# Image folders: <root>/train/<class>/*, <root>/val|validation|test/<class>/*
# ---------------------------------------------------------------------------------------------

def _image_extensions() -> set[str]:
    from PIL import Image
    return {ext.lower() for ext in Image.registered_extensions()}


def scan_split(root: Path, classes: tuple[str, ...] | None = None) -> tuple[tuple[str, ...], list[Path], list[int]]:
    """<root>/<class>/<files> -> (class names, files, labels). Class names are the sorted folder names; with
    `classes` given (the training split's), the folders must be among them and labels index into them.
    Hidden files and files whose extension no Pillow plugin claims are skipped."""
    extensions = _image_extensions()
    found = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not found:
        raise DataError(f"{root} has no class folders; put each class's images in {root}/<class name>/")
    if classes is None:
        classes = tuple(found)
    unknown = [c for c in found if c not in classes]
    if unknown:
        raise DataError(f"{root}: class folder(s) {', '.join(unknown)} are not in the training split "
                        f"({', '.join(classes)}); rename or remove them")
    files, labels = [], []
    for name in found:
        images = sorted(f for f in (root / name).rglob("*") if f.is_file() and not f.name.startswith(".")
                        and f.suffix.lower() in extensions)
        if not images:
            raise DataError(f"class folder {root / name} has no images; add some or remove the folder")
        files += images
        labels += [classes.index(name)] * len(images)
    return classes, files, labels


def image_folder_splits(data_dir, need_train: bool = True) -> tuple[Path, Path]:
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"data directory {root} does not exist; pass --data_dir (or --data_url) pointing at the "
                        "folder that holds train/ and val/")
    train = root / "train"
    if need_train and not train.is_dir():
        raise DataError(f"{root} has no train/ folder; an image folder is {root}/train/<class>/... and "
                        f"{root}/val/<class>/...")
    evaluation = next((root / d for d in EVAL_DIRS if (root / d).is_dir()), None)
    if evaluation is None:
        raise DataError(f"{root} has no evaluation split; add {root}/val/<class>/... (or validation/ or test/)")
    return train, evaluation


def decode_image(path, size: int) -> torch.Tensor:
    """An image file (any mode Pillow reads) -> 3 x size x size uint8: RGB, shorter side resized to size
    (bilinear, antialiased), centre crop. Training, evaluate and predict all see images through this."""
    from PIL import Image
    try:
        with Image.open(path) as img:
            img.draft("RGB", (size, size))  # JPEG: decode at the smallest scale that is still >= size
            img = img.convert("RGBA").convert("RGB") if img.mode in ("P", "PA", "LA") else img.convert("RGB")
            w, h = img.size
            scale = size / min(w, h)
            if (w, h) != (size, size):
                img = img.resize((max(size, round(w * scale)), max(size, round(h * scale))), Image.BILINEAR)
            w, h = img.size
            left, top = (w - size) // 2, (h - size) // 2
            img = img.crop((left, top, left + size, top + size))
            array = np.asarray(img, dtype=np.uint8)
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, struct.error, ...) for a broken file
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        raise UnreadableImage(path, first) from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def decode_all(files: list[Path], size: int) -> tuple[torch.Tensor, float]:
    """Decode every file once (a thread pool: Pillow releases the GIL) -> (N x 3 x size x size uint8, images/s)."""
    start = time.perf_counter()
    out = torch.empty((len(files), 3, size, size), dtype=torch.uint8)

    def one(i):
        try:
            out[i] = decode_image(files[i], size)
        except UnreadableImage as e:
            return e

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        errors = [e for e in pool.map(one, range(len(files))) if e is not None]
    if errors:
        raise unreadable_images(errors)
    return out, len(files) / max(time.perf_counter() - start, 1e-9)


def native_size(files: list[Path], limit: int = SIZE_SAMPLE) -> int | None:
    """The images' own size: the median shorter side of up to `limit` evenly spaced files (headers only, no
    decoding; the same files on every rank). None if none is readable (the decode or check names them)."""
    from PIL import Image
    sides = []
    for i in np.linspace(0, len(files) - 1, min(limit, len(files))).round().astype(int) if files else ():
        try:
            with Image.open(files[i]) as img:
                sides.append(min(img.size))
        except Exception:  # a broken file: named by check_images / decode_image, not here
            continue
    return int(np.median(sides)) if sides else None


def check_images(files: list[Path]) -> None:
    """The cpu pipeline decodes later, in workers: read every file's header now (cheap, no decoding) so that
    a file that is not an image stops the run before it starts, named. (A file whose header is fine but
    whose pixel data is truncated is only found, and named, when a worker decodes it.)"""
    from PIL import Image

    def one(path):
        try:
            with Image.open(path) as img:
                img.size
        except Exception as e:  # Pillow raises many kinds for a broken file
            first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
            return UnreadableImage(path, first)

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        errors = [e for e in pool.map(one, files) if e is not None]
    if errors:
        raise unreadable_images(errors)


def channel_stats(images: torch.Tensor) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std in [0, 1] of N x 3 x H x W uint8 images."""
    total, squares = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for chunk in images.split(256):
        c = chunk.double()
        total += c.sum((0, 2, 3))
        squares += (c * c).sum((0, 2, 3))
    n = images.numel() / 3
    mean = total / n / 255
    std = (squares / n / 255**2 - mean**2).clamp_min(1e-6).sqrt().clamp_min(1e-3)
    return tuple(round(v, 4) for v in mean.tolist()), tuple(round(v, 4) for v in std.tolist())


# ---------------------------------------------------------------------------------------------
# Loading: the data set's description, its splits, and which pipeline holds them
# ---------------------------------------------------------------------------------------------

@dataclass
class Split:
    labels: torch.Tensor
    images: torch.Tensor | None = None  # N x 3 x S x S uint8, decoded
    files: list[Path] | None = None     # decoded per sample by the cpu pipeline

    def __len__(self):
        return len(self.labels)


def device_budget(cfg: TrainConfig, device) -> int:
    """Bytes of decoded images the device pipeline may keep on `device`, as measured here. Under several
    ranks, take rank 0's measure for every rank (broadcast it before build_data): all ranks must choose
    the same pipeline."""
    if cfg.device_data_mb is not None:
        return int(cfg.device_data_mb * 2**20)
    device = torch.device(device)
    try:
        if device.type == "cpu":
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        else:
            free, _ = torch.accelerator.get_memory_info(device)
    except (ValueError, OSError, RuntimeError, AttributeError):
        free = 2**64  # unknown: do not refuse
    return free // 4


def choose_pipeline(cfg: TrainConfig, nbytes: int, device, budget: int | None = None) -> tuple[str, str]:
    """('device' or 'cpu', the reason in words)."""
    if cfg.pipeline == "cpu":
        return "cpu", "as asked (--pipeline cpu)"
    budget = device_budget(cfg, device) if budget is None else budget
    size = f"{nbytes / 2**20:.1f} MiB of decoded uint8 images"
    if nbytes <= budget:
        return "device", f"{size} fit the {budget / 2**20:.0f} MiB allowed on {device} (--device_data_mb)"
    if cfg.pipeline == "device":
        raise ConfigError(f"--pipeline device: {size} do not fit the {budget / 2**20:.0f} MiB allowed on {device}; "
                          "use --pipeline cpu (workers decode per sample) or raise --device_data_mb")
    return "cpu", f"{size} do not fit the {budget / 2**20:.0f} MiB allowed on {device} (--device_data_mb)"


def with_flags(info: DataInfo, cfg: TrainConfig) -> DataInfo:
    mean, std = cfg.normalisation()
    return replace(info, mean=mean or info.mean, std=std or info.std)


def load_data(cfg: TrainConfig, device, info: DataInfo | None = None, eval_only: bool = False,
              budget: int | None = None):
    """-> (DataInfo, {split: Split}, pipeline, notes). With `info` (evaluate: from model_config.json) the
    classes, size and mean/std are the model's and nothing is recomputed; `eval_only` reads only 'test'."""
    wanted = ("test",) if eval_only else ("train", "test")
    if cfg.data == "imagefolder":
        return load_image_folder(cfg, device, info, wanted, budget)
    size = info.image_size if info else cfg.resolution()
    if cfg.data == "random":
        tensors = random_data(cfg.train_samples or 50_000, cfg.test_samples or 10_000, cfg.seed, size,
                              info.num_classes if info else CIFAR10.num_classes, wanted)
        info = info or with_flags(replace(CIFAR10, name="random", image_size=size), cfg)
    else:
        tensors = read_cifar10(cfg.data_dir, wanted)
        limits = {"train": cfg.train_samples, "test": cfg.test_samples}
        tensors = {k: (x[: limits[k]], y[: limits[k]]) for k, (x, y) in tensors.items()}
        info = info or with_flags(CIFAR10, cfg)
    pipeline, why = choose_pipeline(cfg, sum(x.numel() for x, _ in tensors.values()), device, budget)
    return info, {k: Split(y, images=x) for k, (x, y) in tensors.items()}, pipeline, why


def subset(files: list, labels: list, n: int | None) -> tuple[list, list]:
    """--train_samples/--test_samples on an image folder: N evenly spaced files (files are sorted by class,
    so the first N would be the first classes only)."""
    if n is None or n >= len(files):
        return files, labels
    keep = np.linspace(0, len(files) - 1, n).round().astype(int)
    return [files[i] for i in keep], [labels[i] for i in keep]


def load_image_folder(cfg: TrainConfig, device, info: DataInfo | None, wanted, budget: int | None = None):
    train_dir, eval_dir = image_folder_splits(cfg.data_dir, need_train="train" in wanted)
    classes = info.classes if info else None
    found = {}
    if "train" in wanted:
        classes, files, labels = scan_split(train_dir, classes)
        found["train"] = subset(files, labels, cfg.train_samples)
    _, files, labels = scan_split(eval_dir, classes)
    found["test"] = subset(files, labels, cfg.test_samples)
    size = info.image_size if info else cfg.resolution(native_size(found["train"][0]) if cfg.image_size is None
                                                        and "train" in found else None)
    pipeline, why = choose_pipeline(cfg, sum(len(f) for f, _ in found.values()) * 3 * size * size, device, budget)
    splits, notes = {}, [why]
    for split, (files, labels) in found.items():
        labels = torch.tensor(labels, dtype=torch.long)
        if pipeline == "device":
            images, rate = decode_all(files, size)
            notes.append(f"{split}: {len(files)} images decoded once at {rate:.0f} images/s")
            splits[split] = Split(labels, images=images)
        else:
            check_images(files)
            splits[split] = Split(labels, files=files)
    if info is None:
        mean, std = cfg.normalisation()
        if mean is None or std is None:
            train = splits["train"]
            if train.images is not None:
                stats = channel_stats(train.images)
            else:  # an evenly spaced sample of the training files, the same on every rank
                step = max(1, len(train.files) // STATS_SAMPLE)
                stats = channel_stats(decode_all(train.files[::step], size)[0])
            mean, std = mean or stats[0], std or stats[1]
            notes.append(f"mean {mean} std {std} from the training images")
        info = DataInfo("imagefolder", classes, mean, std, size)
    return info, splits, pipeline, notes


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


def crop_flip_params(idx: torch.Tensor, epoch: int, seed: int, pad: int = 4,
                     hflip: bool = True) -> tuple[torch.Tensor, ...]:
    """Per-sample crop offsets (0..2*pad, top and left in the padded image) and flips (0/1)."""
    h = sample_hash(idx, epoch, seed)
    top = h % (2 * pad + 1)
    left = (h >> 8) % (2 * pad + 1)
    flip = (h >> 20) & 1 if hflip else torch.zeros_like(h)
    return top, left, flip


def crop_flip(images: torch.Tensor, top: torch.Tensor, left: torch.Tensor, flip: torch.Tensor,
              pad: int = 4) -> torch.Tensor:
    """Batched RandomCrop(size, padding=pad) then RandomHorizontalFlip, as one gather on the device."""
    n, c, h, w = images.shape
    padded = F.pad(images, (pad, pad, pad, pad))
    ar_h = torch.arange(h, device=images.device)
    ar_w = torch.arange(w, device=images.device)
    rows = top[:, None] + ar_h                                                     # n, h
    cols = left[:, None] + torch.where(flip[:, None].bool(), w - 1 - ar_w, ar_w)  # n, w
    batch = torch.arange(n, device=images.device)[:, None, None, None]
    chans = torch.arange(c, device=images.device)[None, :, None, None]
    return padded[batch, chans, rows[:, None, :, None], cols[:, None, None, :]]


class Normalize:
    """uint8 -> float, (x/255 - mean) / std, as one fused multiply-add."""

    def __init__(self, device, mean=CIFAR10.mean, std=CIFAR10.std):
        std_t = torch.tensor(std, device=device).view(1, 3, 1, 1)
        self.scale = 1.0 / (255.0 * std_t)
        self.shift = -torch.tensor(mean, device=device).view(1, 3, 1, 1) / std_t

    def __call__(self, images_u8: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(self.shift, images_u8.float(), self.scale)


def cpu_transforms(info: DataInfo = CIFAR10) -> v2.Compose:
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(info.mean, info.std)])


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


def _ignore_ctrl_c(worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C to the trainer (a terminal signals them too; one that ended would fail
    the next batch before the trainer's checkpoint)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _identity(batch):
    return batch


class TransformDataset(Dataset):
    """uint8 tensors (or image files, decoded here), per-sample crop/flip and a torchvision transform (the cpu
    pipeline).

    The crop and flip of sample i in epoch e are the device pipeline's hash of (seed, e, i), not the
    workers' RNG, so a resumed run (and any number of workers or ranks) augments exactly alike. The
    DataLoader calls set_epoch before each epoch (through the prepared loader); the training workers
    are started per epoch, so they see it. `augment`: (seed, pad, hflip), or None for no augmentation.
    """

    def __init__(self, split: Split, transform, size: int, augment: tuple | None = None):
        self.split, self.transform, self.size, self.augment = split, transform, size, augment
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        s = self.split
        image = s.images[i] if s.images is not None else decode_image(s.files[i], self.size)
        if self.augment is not None:
            seed, pad, hflip = self.augment
            params = crop_flip_params(torch.tensor([i]), self.epoch, seed, pad, hflip)
            image = crop_flip(image[None], *params, pad=pad)[0]
        return self.transform(image), s.labels[i]


@dataclass
class Data:
    train_loader: DataLoader | None
    test_loader: DataLoader
    inputs: Callable  # (batch, train: bool, epoch: int) -> (images, labels) on the device
    train_size: int
    test_size: int
    info: DataInfo = CIFAR10
    pipeline: str = "device"
    notes: list[str] = field(default_factory=list)  # which pipeline and why, decode rates, statistics

    def describe(self) -> str:
        return f"data {self.info.name}: {self.info.num_classes} classes at {self.info.image_size}x" \
               f"{self.info.image_size}; pipeline {self.pipeline}: " + "; ".join(self.notes)


def build_data(cfg: TrainConfig, device, splits=None, info: DataInfo | None = None, eval_only: bool = False,
               budget: int | None = None) -> Data:
    """The loaders. `splits` ({'train'|'test': (uint8 images, labels)}) replaces reading from disk (tests);
    `budget`: bytes the device pipeline may use (rank 0's measure under several ranks, see device_budget)."""
    if splits is None:
        info, splits, pipeline, notes = load_data(cfg, device, info, eval_only, budget)
    else:
        splits = {k: Split(y, images=x) for k, (x, y) in splits.items()}
        info, pipeline, notes = info or CIFAR10, ("cpu" if cfg.pipeline == "cpu" else "device"), "given tensors"
    notes = notes if isinstance(notes, list) else [notes]
    train, test = splits.get("train"), splits["test"]
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format

    if pipeline == "device":
        train_x, train_y = (train.images.to(device), train.labels.to(device)) if train is not None else (None, None)
        test_x, test_y = test.images.to(device), test.labels.to(device)
        normalize = Normalize(device, info.mean, info.std)

        def inputs(idx, train, epoch=0):
            images = (train_x if train else test_x)[idx]
            if train and cfg.augment:
                images = crop_flip(images, *crop_flip_params(idx, epoch, cfg.seed, info.pad, cfg.hflip), pad=info.pad)
            x = normalize(images).contiguous(memory_format=memory_format)
            return x, (train_y if train else test_y)[idx]

        train_ds = IndexDataset(len(train)) if train is not None else None
        test_ds = IndexDataset(len(test))
        collate, workers = _identity, 0
    else:
        def inputs(batch, train, epoch=0):
            x, y = batch
            return x.contiguous(memory_format=memory_format), y

        augment = (cfg.seed, info.pad, cfg.hflip) if cfg.augment else None
        train_ds = TransformDataset(train, cpu_transforms(info), info.image_size, augment) if train is not None \
            else None
        test_ds = TransformDataset(test, cpu_transforms(info), info.image_size)
        collate, workers = None, cfg.num_workers

    # On an accelerator, batches are pinned so that Accelerate's copy to the device (non_blocking=True, see
    # loop.make_accelerator) does not wait for the device: a pageable host-to-device copy is a host sync.
    common = dict(batch_size=cfg.batch_size, num_workers=workers, collate_fn=collate,
                  worker_init_fn=_ignore_ctrl_c if workers else None, pin_memory=torch.device(device).type != "cpu")
    # training workers restart each epoch so they see the epoch (set_epoch) their augmentation depends on
    train_loader = DataLoader(train_ds, shuffle=True, drop_last=True, persistent_workers=False, **common) \
        if train is not None else None
    test_loader = DataLoader(test_ds, shuffle=False, drop_last=False, persistent_workers=workers > 0, **common)
    return Data(train_loader, test_loader, inputs, len(train) if train is not None else 0, len(test), info,
                pipeline, notes)
