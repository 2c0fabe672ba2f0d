"""Datasets and loaders: `build_data`, the two pipelines.

Two pipelines, one contract. Both return DataLoaders that `accelerator.prepare` shards, and an
`inputs(batch, train, epoch)` function that turns what a prepared loader yields into
(normalised images, labels) on the device.

- `device`: the uint8 images (150 MB for all of CIFAR-10; an image folder is decoded and resized once)
  live on the accelerator; the loaders yield only index batches; each batch is gathered there and
  augmented there, batched.
- `cpu`: per-sample torchvision transforms in DataLoader workers (an image folder's files are decoded
  there, per sample), for data that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset

from ..config import TrainConfig
from ..defaults import BATCH_SIZE, auto_batch
from ..errors import counted
from .augment import Normalize, cpu_transforms, crop_flip, crop_flip_params
from .images import decode_image
from .info import CIFAR10, DataInfo
from .load import Split, load_data


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


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C, SIGUSR1 and a first SIGTERM to the trainer, which stops at an agreed step
    and checkpoints it: a terminal signals the whole foreground group and torchrun signals each rank's whole
    session (os.killpg), so a worker that ended would fail the batch before that checkpoint. A second SIGTERM ends
    the worker: it is how the DataLoader (and multiprocessing at exit) end a worker that did not stop by itself."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _end_at_the_second_sigterm)


def _end_at_the_second_sigterm(signum, frame) -> None:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _identity(batch):
    return batch


class TransformDataset(Dataset):
    """uint8 tensors (or image files, decoded here), per-sample crop/flip and a torchvision transform (the cpu
    pipeline).

    The crop and flip of sample i in epoch e are the device pipeline's hash of (seed, e, i), not the
    workers' RNG, so a resumed run (and any number of workers or ranks) augments exactly alike. The
    loop sets the epoch before each epoch (set_loader_epoch); the training workers are started per epoch,
    so they see it. `augment`: (seed, pad, hflip), or None for no augmentation.
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


def set_loader_epoch(loader, epoch: int) -> None:
    """The epoch to a (prepared) training loader's sampler, the data order, and to its dataset, the cpu pipeline's
    augmentation. Accelerate's DataLoaderShard.set_epoch (1.15) gives it to a sharded loader's sampler and then
    (`elif`) to the dataset only when no sampler took it: with 2+ processes the dataset would stay at epoch 0."""
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
    notes: list[str] = field(default_factory=list)  # which pipeline and why, decode rates, statistics

    def describe(self) -> str:
        return f"data {self.info.name}: {counted(self.info.num_classes, 'class')} at {self.info.image_size}x" \
               f"{self.info.image_size}; pipeline {self.pipeline}: " + "; ".join(self.notes)


def build_data(cfg: TrainConfig, device, splits=None, info: DataInfo | None = None, eval_only: bool = False,
               budget: int | None = None, processes: int = 1) -> Data:
    """The loaders. `splits` ({'train'|'test': (uint8 images, labels)}) replaces reading from disk (tests);
    `budget`: bytes the device pipeline may use (rank 0's measure under several ranks, see device_budget);
    `processes`: the ranks the training set is sharded over (an automatic --batch_size follows the data's size)."""
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
        inputs = cpu_inputs(memory_format)
        augment = (cfg.seed, info.pad, cfg.hflip) if cfg.augment else None
        train_ds = TransformDataset(train, cpu_transforms(info), info.image_size, augment) if train is not None \
            else None
        test_ds = TransformDataset(test, cpu_transforms(info), info.image_size)
        collate, workers = None, cfg.num_workers

    batch = cfg.batch_size or (BATCH_SIZE if train is None else auto_batch(len(train), processes * cfg.grad_accum))
    train_loader, test_loader = loaders(train_ds, test_ds, batch, workers, collate, device)
    return Data(train_loader, test_loader, inputs, len(train) if train is not None else 0, len(test), info,
                pipeline, notes)


def cpu_inputs(memory_format):
    """What a loader of (images, labels) batches gives -> the model's inputs (the cpu pipeline, your own Datasets).
    Labels as int64 (a no-op for ours), the class indices the loss takes: your Dataset's int32 / numpy int32 labels
    collate to an int32 tensor, which cross_entropy refuses."""
    def inputs(batch, train, epoch=0):
        x, y = batch
        return x.contiguous(memory_format=memory_format), y.long()
    return inputs


def loaders(train_ds, test_ds, batch: int, workers: int, collate, device) -> tuple[DataLoader | None, DataLoader]:
    """The training loader (shuffled, whole batches) and the test loader, which prepare() shards."""
    # On an accelerator, batches are pinned so that Accelerate's copy to the device (non_blocking=True, see
    # accelerator.make_accelerator) does not wait for the device: a pageable host-to-device copy is a host sync.
    common = dict(batch_size=batch, num_workers=workers, collate_fn=collate,
                  worker_init_fn=_leave_signals_to_the_trainer if workers else None, pin_memory=torch.device(device).type != "cpu")
    # training workers restart each epoch so they see the epoch (set_epoch) their augmentation depends on
    train_loader = DataLoader(train_ds, shuffle=True, drop_last=True, persistent_workers=False, **common) \
        if train_ds is not None else None
    return train_loader, DataLoader(test_ds, shuffle=False, drop_last=False, persistent_workers=workers > 0, **common)
