"""Datasets and loaders: `build_data`, the two pipelines.

Two pipelines, one contract. Both return DataLoaders that `accelerator.prepare` shards, and an
`inputs(batch, train, epoch)` function that turns what a prepared loader yields into
(normalised images, labels) on the device.

- `device`: the uint8 images (150 MB for all of CIFAR-10; an image folder is decoded and resized
  once) live on the accelerator; the loaders yield only index batches; each batch is gathered there
  and augmented there, batched.
- `cpu`: DataLoader workers (cores.worker_count: the machine's cores shared by its processes) read,
  crop and flip each batch (an image folder's files are decoded there, per sample) into uint8,
  pinned on an accelerator; normalised on the device. For data that does not fit.
- `cache`: the cpu pipeline reading an image folder decoded once per machine (cache.py),
  memory-mapped.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ..config.defaults import BATCH_SIZE, auto_batch
from ..config.recipes import per_sample
from ..config.train_config import TrainConfig
from ..lines import counted
from ..platform.cores import worker_count
from .augment import Normalize, crop_flip, crop_flip_params
from .cache import as_images, open_cache
from .images import decode_image, never
from .info import CIFAR10, DataInfo
from .load import Split, load_data
from .train_augment import TrainAugment, plan
from .workers import loader_kwargs

logger = logging.getLogger("accel_train")


class IndexDataset(Dataset):
    """Yields sample indices: the device pipeline gathers the samples itself. With a
    RandomResizedCrop `augment`, a batch is (indices, crop boxes, flips, bicubic choices), computed
    here on the CPU (crops.rrc_boxes: the cpu pipeline's float64 math) for the device to resample
    (bilinear: no host sync there). `aspects`: the images' width / height."""

    def __init__(
        self, n: int, augment: TrainAugment | None = None, aspects: torch.Tensor | None = None
    ):
        self.n, self.augment, self.aspects, self.epoch = n, augment, aspects, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i

    def __getitems__(self, indices):
        idx = torch.as_tensor(indices, dtype=torch.long)
        if self.augment is None or not self.augment.resized:
            return idx
        return (idx, *self.augment.boxes(idx, self.epoch, self.aspects))


def _identity(batch):
    return batch


class TransformDataset(Dataset):
    """uint8 images (tensors, the decoded cache's mapped rows, or image files decoded here), cropped
    and flipped per sample into a uint8 batch in the run's memory format: the cpu pipeline, run in
    DataLoader workers. Inside a worker the batch is written straight into shared memory (as torch's
    default_collate allocates one there), which is how it reaches the trainer without another copy;
    `inputs` then normalises it on the device (on a CPU too: Finish). uint8 is a quarter of the
    float bytes to write, send, pin and copy: on a CPU device, making float32 batches in the workers
    cost them ~0.3 ms an image in fresh shared memory's page faults alone (bench/RESULTS.md).

    The crop and flip of sample i in epoch e are the device pipeline's hash of (seed, e, i), not the
    workers' RNG, so a resumed run (and any number of workers or ranks) augments exactly alike. The
    epoch lives in shared memory: persistent workers hold their own copy of this dataset (pickled or
    forked when they start), so an epoch set on the main process's copy (set_loader_epoch, before
    the epoch's iterator sends them its indices) reaches them only that way. `augment`: the
    TrainAugment (crop, flip, timm's per-sample transforms), or None for none.
    """

    def __init__(
        self,
        split: Split,
        size: int,
        augment: TrainAugment | None = None,
        memory_format=torch.contiguous_format,
    ):
        self.split, self.size, self.augment, self.memory_format = (
            split,
            size,
            augment,
            memory_format,
        )
        self._epoch = torch.zeros((), dtype=torch.long).share_memory_()
        # the decoded cache, mapped in each process on first use (never pickled)
        self._mapped = None

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __getstate__(self):
        return {**self.__dict__, "_mapped": None}

    def __len__(self):
        return len(self.split)

    def images(self, indices: list[int]) -> torch.Tensor:
        s = self.split
        if s.images is not None:
            return s.images[torch.as_tensor(indices)]
        if self._mapped is None:
            mapped = open_cache(s.cache, len(s), s.decode or self.size) if s.cache else None
            self._mapped = False if mapped is None else mapped  # (False: decode)
            if s.cache and self._mapped is False:  # (its writer said why on its own rank)
                logger.warning(
                    f"the decoded cache {s.cache} cannot be read here: decoding per sample"
                )
        if self._mapped is not False:
            return as_images(self._mapped[np.asarray(indices)])
        # (as decoded, H x W x 3: channels-last, as the cache's rows, for the crop's uint8 resize)
        decoded = [
            decode_image(s.files[i], s.decode or self.size, channels_last=True) for i in indices
        ]
        return torch.stack([image.permute(1, 2, 0) for image in decoded]).permute(0, 3, 1, 2)

    def __getitems__(self, indices):
        images = self.images(indices)
        idx = torch.as_tensor(indices, dtype=torch.long)
        out = _batch_zeros((len(idx), 3, self.size, self.size), self.memory_format)
        if self.augment is not None:
            self.augment.crop_batch(
                images, idx, self.epoch, self.split.aspects, out=out, per_image=True
            )
            if self.augment.per_sample is not None:
                self.augment.per_sample(out, idx, self.epoch, self.augment.seed)
        else:
            out.copy_(images)
        return out, self.split.labels[idx]

    def __getitem__(self, i):
        x, y = self.__getitems__([i])
        return x[0], y[0]


def _batch_zeros(shape, memory_format) -> torch.Tensor:
    """uint8 zeros of `shape` (N, C, H, W) in `memory_format`; in shared memory inside a DataLoader
    worker (a new shared file is zeros), as torch's default_collate allocates a batch there
    (torch/utils/data/_utils/collate.py, collate_tensor_fn): sent to the main process without
    another copy."""
    n, c, h, w = shape
    dims = (n, h, w, c) if memory_format == torch.channels_last else (n, c, h, w)
    if get_worker_info() is None:
        out = torch.zeros(dims, dtype=torch.uint8)
    else:
        out = torch.empty(0, dtype=torch.uint8).set_(
            torch.UntypedStorage._new_shared(math.prod(dims)), 0, dims
        )
    return out.permute(0, 3, 1, 2) if memory_format == torch.channels_last else out


class Finish:
    """uint8 batch (either memory format) -> normalised floats in the run's memory format, on the
    batch's device (picklable). On a CPU: copied into new floats, then scaled and shifted in place
    (~1.6x faster than Normalize's addcmul); channels_last as NHWC rows of W x 3 values, whose
    constants repeat per pixel (a last dimension of 3 broadcast per channel is ~5x slower). Fresh
    batches of 38 MB and more are new pages for the CPU allocator each time: the trainer turns on
    torch's transparent huge pages for them (cli.main), 0.44 -> 0.14 ms an image."""

    def __init__(self, normalize: Normalize, memory_format):
        self.normalize, self.memory_format = normalize, memory_format
        self.rows = {}  # (width, device) -> the constants of one NHWC row, made once

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        scale, shift = (
            self.normalize.scale.to(images.device),
            self.normalize.shift.to(images.device),
        )
        if self.memory_format != torch.channels_last:
            return (
                torch.empty(images.shape, device=images.device)
                .copy_(images)
                .mul_(scale)
                .add_(shift)
            )
        # (no copy when the workers made it channels_last)
        nhwc = images.permute(0, 2, 3, 1).contiguous()
        n, h, w, c = nhwc.shape
        key = (w, images.device)
        if key not in self.rows:
            self.rows[key] = scale.view(c).repeat(w), shift.view(c).repeat(w)
        row_scale, row_shift = self.rows[key]
        x = torch.empty(nhwc.shape, device=images.device).copy_(nhwc)
        x.view(n * h, w * c).mul_(row_scale).add_(row_shift)
        return x.permute(0, 3, 1, 2)


def set_loader_epoch(loader, epoch: int) -> None:
    """The epoch to a (prepared) training loader's sampler, the data order, and to its dataset, the
    cpu pipeline's augmentation. Accelerate's DataLoaderShard.set_epoch (1.15) gives it to a sharded
    loader's sampler and then (`elif`) to the dataset only when no sampler took it: with 2+
    processes the dataset would stay at epoch 0. (Call it before iterating the epoch: persistent
    workers read the dataset's epoch from shared memory when they prepare.)"""
    loader.set_epoch(epoch)
    if hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch)


@dataclass
class Data:
    train_loader: DataLoader | None
    test_loader: DataLoader
    inputs: Callable  # (batch, train: bool, epoch: int) -> (images, labels) on the device
    train_size: int
    test_size: int
    info: DataInfo = CIFAR10
    pipeline: str = "device"
    # which pipeline and why, decode rates, statistics
    notes: list[str] = field(default_factory=list)
    normalize: Normalize | None = None  # what `inputs` normalises with

    def set_normalisation(self, mean, std) -> None:
        """Another mean/std before the first batch: rank 0's (setup), where a rank could not read
        the decoded cache that its machine's local main process was still writing and took a
        sample's."""
        self.info = replace(self.info, mean=tuple(mean), std=tuple(std))
        self.normalize.__init__(self.normalize.shift.device, self.info.mean, self.info.std)

    def describe(self) -> str:
        name = f"your Dataset {self.info.dataset}" if self.info.dataset else self.info.name
        return (
            f"data {name}: {counted(self.info.num_classes, 'class')} at "
            f"{self.info.image_size}x{self.info.image_size}; pipeline {self.pipeline}: "
            + "; ".join(self.notes)
        )


def build_data(
    cfg: TrainConfig,
    device,
    splits=None,
    info: DataInfo | None = None,
    eval_only: bool = False,
    budget: int | None = None,
    processes: int = 1,
    should_stop=never,
) -> Data:
    """The loaders. `splits` ({'train'|'test': (uint8 images, labels)}) replaces reading from disk
    (tests); `budget`: bytes the device pipeline may use (rank 0's measure under several ranks, see
    device_budget); `processes`: the ranks the training set is sharded over (an automatic
    --batch_size follows the data's size); `should_stop`: what a start-up decode of image files
    answers (images.decode_all's)."""
    if splits is None:
        info, splits, pipeline, notes = load_data(cfg, device, info, eval_only, budget, should_stop)
    else:
        splits = {k: Split(y, images=x) for k, (x, y) in splits.items()}
        info, pipeline, notes = (
            info or CIFAR10,
            ("cpu" if cfg.pipeline in ("cpu", "cache") or per_sample(cfg) else "device"),
            "given tensors",
        )
    notes = notes if isinstance(notes, list) else [notes]
    train, test = splits.get("train"), splits["test"]
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    normalize = Normalize(device, info.mean, info.std)
    augment = plan(cfg, info)
    if pipeline == "device":
        train_x, train_y = (
            (train.images.to(device), train.labels.to(device))
            if train is not None
            else (None, None)
        )
        test_x, test_y = test.images.to(device), test.labels.to(device)
        train_aspects = train.aspects if train is not None else None

        def inputs(batch, train, epoch=0):
            idx, boxes = (
                (batch[0], batch[1:]) if isinstance(batch, (tuple, list)) else (batch, None)
            )
            images = (train_x if train else test_x)[idx]
            # (the crops made by IndexDataset on the CPU)
            if train and augment is not None and augment.resized:
                images = augment.crop_batch(images, idx, epoch, train_aspects, boxes=boxes or None)
            elif train and augment is not None:
                images = crop_flip(
                    images,
                    *crop_flip_params(idx, epoch, cfg.seed, info.pad, cfg.hflip),
                    pad=info.pad,
                )
            x = normalize(images).contiguous(memory_format=memory_format)
            return x, (train_y if train else test_y)[idx]

        train_ds = IndexDataset(len(train), augment, train.aspects) if train is not None else None
        test_ds = IndexDataset(len(test))
        workers = 0
    else:
        finish = Finish(normalize, memory_format)

        def inputs(batch, train, epoch=0):
            x, y = batch
            return finish(x), y

        train_ds = (
            TransformDataset(train, info.image_size, augment, memory_format)
            if train is not None
            else None
        )
        test_ds = TransformDataset(test, info.image_size, None, memory_format)
        workers, why = worker_count(cfg.num_workers)
        notes.append(why)

    batch = cfg.batch_size or (
        BATCH_SIZE if train is None else auto_batch(len(train), processes * cfg.grad_accum)
    )
    common = dict(
        batch_size=batch, collate_fn=_identity, **loader_kwargs(cfg.num_workers, device, workers)
    )
    train_loader = (
        DataLoader(train_ds, shuffle=True, drop_last=True, **common) if train is not None else None
    )
    test_loader = DataLoader(test_ds, shuffle=False, drop_last=False, **common)
    return Data(
        train_loader,
        test_loader,
        inputs,
        len(train) if train is not None else 0,
        len(test),
        info,
        pipeline,
        notes,
        normalize,
    )
