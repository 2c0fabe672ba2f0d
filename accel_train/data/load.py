"""Loading: the data set's description, its splits, and which pipeline holds them.

`--pipeline auto` (the default) takes the device pipeline when the decoded uint8 data fits
`--device_data_mb` (default a quarter of the device's free memory; none where torch cannot measure
it), else, for an image folder, the decoded cache (cache.py) where the local disk has room, else the
cpu pipeline. A recipe with per-sample transforms (--aa, --color_jitter, --reprob: timm's, on PIL
images in DataLoader workers) leaves the device pipeline out. Its DataLoader workers: workers.py.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config.recipes import default_crop_pct, per_sample, train_crop
from ..config.train_config import TrainConfig
from ..errors import ConfigError
from ..lines import counted
from .cache import cache_aspects, cache_path, cache_stats, no_room, open_cache, write_cache
from .cifar import read_cifar10
from .crops import store_size
from .folders import held_out, image_folder_splits, scan_split, subset
from .images import Decode, channel_stats, check_images, decode_all, native_size, never
from .info import CIFAR10, DataInfo
from .synthetic import random_data

# training images decoded to estimate mean/std when the cpu pipeline decodes per sample
STATS_SAMPLE = 2048


@dataclass
class Split:
    labels: torch.Tensor
    images: torch.Tensor | None = None  # N x 3 x S x S uint8, decoded
    files: list[Path] | None = None  # decoded per sample by the cpu pipeline
    cache: Path | None = None  # the files decoded once on this machine (cache.py), where
    # it was written
    decode: Decode | None = None  # how the files become images (crop_pct, or the whole image:
    # crops.py)
    aspects: torch.Tensor | None = None  # whole images' width / height, for RandomResizedCrop

    def __len__(self):
        return len(self.labels)


def device_budget(device_data_mb: float | None, device) -> int:
    """Bytes of decoded images the device pipeline may keep on `device`, as measured here: a quarter
    of its free memory (on a CPU, of the available memory shared by the processes on this machine:
    each keeps a copy), none where it cannot be measured. Under several ranks, take rank 0's measure
    for every rank (broadcast it before build_data): all ranks must choose the same pipeline.
    `device_data_mb`: --device_data_mb, the budget given."""
    if device_data_mb is not None:
        return int(device_data_mb * 2**20)
    device = torch.device(device)
    free = free_memory(device)
    if free is None:
        return 0
    # (one memory for the machine's processes, each of which holds its own copy)
    if device.type == "cpu":
        from accelerate.utils.environment import get_cpu_distributed_information

        free //= max(1, get_cpu_distributed_information().local_world_size)
    return free // 4


def free_memory(device: torch.device) -> int | None:
    """Free bytes on `device`, None where nothing says: torch.accelerator.get_memory_info (missing
    from older torch within torch>=2.6, not implemented by every allocator), else the backend's own
    mem_get_info (torch.cuda, torch_npu's torch.npu)."""
    if device.type == "cpu":
        probes = [lambda: os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    else:
        probes = [
            lambda: torch.accelerator.get_memory_info(device)[0],
            lambda: getattr(torch, device.type).mem_get_info(device)[0],
        ]
    for probe in probes:
        try:
            return int(probe())
        except (ValueError, OSError, RuntimeError, AttributeError, NotImplementedError, TypeError):
            pass
    return None


def choose_pipeline(
    cfg: TrainConfig, nbytes: int, device, budget: int | None = None, to_cache: int | None = None
) -> tuple[str, str]:
    """('device', 'cache' or 'cpu', the reason in words). `to_cache`: image files, which the cache
    can hold: the bytes of their caches not yet written on this machine (0: all there, taken
    whatever the free space)."""
    if cfg.pipeline in ("cpu", "cache"):
        return cfg.pipeline, f"as asked (--pipeline {cfg.pipeline})"
    if per_sample(cfg):  # (--pipeline device with them: refused by recipes.check)
        why = (
            f"{', '.join(per_sample(cfg))}: timm's per-sample transforms, "
            "which DataLoader workers run"
        )
        if to_cache is None:
            return "cpu", why
        reason = no_room(to_cache)
        return (
            ("cache", why) if reason is None else ("cpu", f"{why}; not the decoded cache: {reason}")
        )
    budget = device_budget(cfg.device_data_mb, device) if budget is None else budget
    size = f"{nbytes / 2**20:.1f} MiB of decoded uint8 images"
    allowed = f"the {budget / 2**20:.0f} MiB allowed on {device} (--device_data_mb" + (
        "; torch cannot measure its free memory here: none counted)"
        if budget == 0 and cfg.device_data_mb is None
        else ")"
    )
    if nbytes <= budget:
        return "device", f"{size} fit {allowed}"
    if cfg.pipeline == "device":
        raise ConfigError(
            f"--pipeline device: {size} do not fit {allowed}; use --pipeline cpu "
            "(workers decode per sample) or raise --device_data_mb"
        )
    why = f"{size} do not fit {allowed}"
    cacheable = to_cache is not None
    reason = no_room(to_cache) if cacheable else None
    if cacheable and reason is None:
        return "cache", why + (
            ", the local disk has room for them decoded"
            if to_cache
            else ", decoded in the local disk's cache already"
        )
    return "cpu", why + (f", {reason}" if cacheable else "")


def with_flags(info: DataInfo, mean: tuple | None, std: tuple | None) -> DataInfo:
    """`info` with --mean / --std where given (TrainConfig.normalisation)."""
    return replace(info, mean=mean or info.mean, std=std or info.std)


def load_data(
    cfg: TrainConfig,
    device,
    info: DataInfo | None = None,
    eval_only: bool = False,
    budget: int | None = None,
    should_stop=never,
):
    """-> (DataInfo, {split: Split}, pipeline, notes). With `info` (evaluate: from
    model_config.json) the classes, size and mean/std are the model's and nothing is recomputed;
    `eval_only` reads only 'test'. `should_stop`: what a start-up decode of image files answers
    (images.decode_all's)."""
    wanted = ("test",) if eval_only else ("train", "test")
    if cfg.data == "imagefolder":
        return load_image_folder(cfg, device, info, wanted, budget, should_stop)
    size = info.image_size if info else cfg.resolution()
    if cfg.data == "random":
        # CIFAR-10's sizes; the test set no larger than the training set
        train = cfg.train_samples or 50_000
        tensors = random_data(
            train,
            cfg.test_samples or min(10_000, train),
            cfg.seed,
            size,
            info.num_classes if info else CIFAR10.num_classes,
            wanted,
        )
        info = info or with_flags(
            replace(CIFAR10, name="random", image_size=size), *cfg.normalisation()
        )
    else:
        tensors = read_cifar10(cfg.data_dir, wanted)
        limits = {"train": cfg.train_samples, "test": cfg.test_samples}
        tensors = {k: (x[: limits[k]], y[: limits[k]]) for k, (x, y) in tensors.items()}
        info = info or with_flags(CIFAR10, *cfg.normalisation())
    pipeline, why = choose_pipeline(
        cfg, sum(x.numel() for x, _ in tensors.values()), device, budget
    )
    return info, {k: Split(y, images=x) for k, (x, y) in tensors.items()}, pipeline, why


def load_image_folder(
    cfg: TrainConfig,
    device,
    info: DataInfo | None,
    wanted,
    budget: int | None = None,
    should_stop=never,
):
    train_dir, eval_dir = image_folder_splits(cfg.data_dir, "train" in wanted, cfg.val_split)
    classes = info.classes if info else None
    found, limits = {}, {"train": cfg.train_samples, "test": cfg.test_samples}
    split_off = {}  # --val_split: both splits from train/, each a part of it
    if cfg.val_split:
        classes, files, labels = scan_split(train_dir, classes)
        both = held_out(train_dir, classes, files, labels, cfg.val_split, cfg.seed)
        split_off = dict(zip(("train", "test"), both))
    for split in wanted:
        if split in split_off:
            files, labels = split_off[split]
        else:
            folder = train_dir if split == "train" else eval_dir
            classes, files, labels = scan_split(folder, classes)
        found[split] = subset(files, labels, limits[split])
        # (chose fewer: a subset)
        limits[split] = limits[split] if len(found[split][0]) < len(files) else None
    # the decoded cache's name tells a part of train/ from the whole folder (and its other part)
    parts = {
        split: f"{'val' if split == 'test' else 'fit'}{cfg.val_split:g}s{cfg.seed}"
        for split in split_off
    }
    size = (
        info.image_size
        if info
        else cfg.resolution(
            native_size(found["train"][0]) if cfg.image_size is None and "train" in found else None
        )
    )
    crop_pct = info.crop_pct if info else default_crop_pct(cfg)
    crop = train_crop(cfg.data, cfg.train_crop)
    whole = "train" in found and cfg.augment and crop == "random_resized"  # (crops.py)
    specs = {
        "train": Decode(store_size(size), whole=True) if whole else Decode(size),
        "test": Decode(size, crop_pct),
    }
    nbytes = {split: len(f) * 3 * specs[split].size ** 2 for split, (f, _) in found.items()}
    homes = (
        {
            split: home(f, specs[split], limits[split], parts.get(split))
            for split, (f, _) in found.items()
        }
        if cfg.pipeline == "auto"
        else {}
    )
    pipeline, why = choose_pipeline(
        cfg,
        sum(nbytes.values()),
        device,
        budget,
        to_cache=sum(
            n for split, n in nbytes.items() if cfg.pipeline != "auto" or not homes[split][1]
        ),
    )
    splits, notes = {}, [why]
    if split_off:
        notes.append(
            f"test: {len(split_off['test'][0])} files of {train_dir} held out "
            f"(--val_split {cfg.val_split:g}, --seed {cfg.seed}; the same on every rank "
            "and resume)"
        )
    if "train" in found and (said := imbalance(classes, found["train"][1])):
        notes.append(said)
    # the training files' mean/std: decoded below
    sampled = info is None and None in cfg.normalisation()
    for split, (files, labels) in found.items():
        labels, spec = torch.tensor(labels, dtype=torch.long), specs[split]
        later, aspects = sampled and split == "train", None
        if pipeline == "device":
            images, rate = decode_all(files, spec, say_small=True, should_stop=should_stop)
            notes.append(f"{split}: {len(files)} images decoded once at {rate:.0f} images/s")
            splits[split] = Split(labels, images=images)
            aspects = check_images(files) if spec.whole else None
        elif pipeline == "cache":
            cache = cached(
                files,
                spec,
                split,
                notes,
                limits[split],
                later,
                homes.get(split, (None,))[0],
                parts.get(split),
                should_stop,
            )
            splits[split] = Split(labels, files=files, cache=cache)
            aspects = cache_aspects(splits[split].cache, files) if spec.whole else None
        else:
            aspects = checked(files, spec, later, should_stop)
            splits[split] = Split(labels, files=files)
        splits[split].decode, splits[split].aspects = spec, aspects if spec.whole else None
    if info is None:
        mean, std = cfg.normalisation()
        if mean is None or std is None:
            train = splits["train"]
            mapped = open_cache(train.cache, len(train), train.decode) if train.cache else None
            if train.images is not None:
                stats = channel_stats(train.images)
            # the device pipeline's numbers, not decoded again (setup: rank 0's for all)
            elif mapped is not None:
                stats = cache_stats(train.cache, mapped)
            else:  # an evenly spaced sample of the training files, the same on every rank
                step = max(1, len(train.files) // STATS_SAMPLE)
                stats = channel_stats(
                    decode_all(train.files[::step], train.decode, should_stop=should_stop)[0]
                )
            mean, std = mean or stats[0], std or stats[1]
            notes.append(f"mean {mean} std {std} from the training images")
        info = DataInfo("imagefolder", classes, mean, std, size, crop_pct)
    return info, splits, pipeline, notes


IMBALANCE = 10  # the largest class this many times the smallest: said at start


def imbalance(classes: list[str], labels: list[int]) -> str | None:
    """The start line's note of classes far apart in size (no weighting is applied: the accuracy is
    the large classes' mostly), or None."""
    counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=len(classes))
    small, large = int(counts.argmin()), int(counts.argmax())
    if counts[small] * IMBALANCE > counts[large]:
        return None
    return (
        f"unbalanced classes: {classes[small]!r} has "
        f"{counted(int(counts[small]), 'training image')}, {classes[large]!r} "
        f"{int(counts[large])}; the loss weighs every image alike, so the accuracy is mostly "
        "the large classes' (evaluate's per-class table shows each)"
    )


def home(
    files: list[Path], size: int | Decode, samples: int | None, part: str | None = None
) -> tuple[Path | None, bool]:
    """(Where the split's decoded cache lives on this machine, whether a complete one is there
    already)."""
    try:
        path = cache_path(files, size, samples, part)
    except OSError:  # (a file gone meanwhile: cached() says so)
        return None, False
    return path, path is not None and open_cache(path, len(files), size) is not None


def checked(
    files: list[Path], size: int | Decode, sampled: bool = False, should_stop=never
) -> torch.Tensor:
    """Files decoded per sample later: every header read now (check_images), and a split of up to
    STATS_SAMPLE files decoded (a few seconds), unless `sampled` (the mean/std's sample decodes all
    of it anyway), so that a file whose header reads but whose pixels end early is named now, alike
    on every rank, not by one rank's DataLoader worker mid-run (that rank exits 2; the others lose a
    peer). Returns the images' aspect ratios (check_images)."""
    aspects = check_images(files, size)
    if len(files) <= STATS_SAMPLE and not sampled:
        for start in range(0, len(files), 256):
            decode_all(files[start : start + 256], size, should_stop=should_stop)
    return aspects


def cached(
    files: list[Path],
    size: int | Decode,
    split: str,
    notes: list[str],
    samples: int | None = None,
    sampled: bool = False,
    path: Path | None = None,
    part: str | None = None,
    should_stop=never,
) -> Path | None:
    """The split's decoded cache on this machine: written by its local main process (the other local
    ranks map it once start-up's next collective has passed: setup's on_every_rank around
    build_data). Where it cannot be written (a full or read-only disk, no home) the files are
    decoded per sample, said in one line. `samples`: the --train_samples/--test_samples that chose
    `files` from more (cache_path); `sampled`: as checked's; `path`: the cache_path already found
    (home: every file's stat once); `part`: cache_path's."""
    from accelerate import PartialState

    try:
        path = path or cache_path(files, size, samples, part)
        if path is None:
            raise OSError("no home directory for ~/.cache")
        if PartialState().is_local_main_process:
            notes.append(f"{split}: " + write_cache(files, size, path, should_stop))
        # (the writer decodes every file: a bad one is its error, on every rank: setup's
        # on_every_rank)
        else:
            check_images(files)
            notes.append(
                f"{split}: the decoded cache {path}, written by this machine's local main process"
            )
        return path
    except OSError as e:
        notes.append(
            f"{split}: the decoded cache cannot be written ({e.strerror or e}"
            f"{': ' + str(e.filename) if getattr(e, 'filename', None) else ''}): "
            "decoding per sample"
        )
        checked(files, size, sampled, should_stop)
        return None
