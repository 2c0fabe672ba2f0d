"""Your own Datasets (`accel_train.train(cfg, train_set=..., test_set=...)`): map-style torch Datasets of (image
tensor (C, H, W), int label), loaded as they are (your Dataset normalises and augments; `set_epoch(epoch)`, if it has
one, is called before each epoch) by the cpu pipeline's DataLoaders with --num_workers, sharded by prepare().

Exact resume holds when the Dataset gives the same item for an index every time (its randomness, if any, a function of
the index and the epoch)."""

from __future__ import annotations

import numbers

import torch
from torch.utils.data import DataLoader

from ..config import TrainConfig
from ..defaults import auto_batch
from .info import DataError, DataInfo
from .load import loader_kwargs, worker_count
from .pipeline import Data


def check_item(dataset, name: str) -> torch.Tensor:
    """dataset[0] must be (image tensor (C, H, W), int label): the image, or one line naming what it is."""
    try:
        size, item = len(dataset), dataset[0]
    except Exception as e:
        raise DataError(f"{name}: len() and [0] of a map-style Dataset failed ({type(e).__name__}: "
                        + " ".join(str(e).split())[:200] + ")") from None
    ok = isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], torch.Tensor) \
        and item[0].ndim == 3 and item[0].is_floating_point() and is_label(item[1])
    if not ok or size < 1:
        what = "(" + ", ".join(describe(v) for v in item) + ")" if isinstance(item, (tuple, list)) else describe(item)
        raise DataError(f"{name}[0] is {what}; each item must be (image float tensor (C, H, W), int label)")
    return item[0]


def is_label(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.is_floating_point() and not value.dtype == torch.bool
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)  # (numpy's integers too)


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def class_names(dataset, classes=None) -> tuple[str, ...]:
    """`classes` (names or a count), else the Dataset's own `classes` (torchvision's convention), else its labels
    (`targets`, or every item's: one pass over the data)."""
    classes = classes if classes is not None else getattr(dataset, "classes", None)
    if classes is None:
        labels = getattr(dataset, "targets", None)
        labels = labels if labels is not None else [int(dataset[i][1]) for i in range(len(dataset))]
        classes = int(max(int(v) for v in labels)) + 1
    names = tuple(str(i) for i in range(classes)) if isinstance(classes, int) else tuple(map(str, classes))
    if len(names) < 2:
        raise DataError(f"the data has {len(names)} class(es); a classifier needs at least 2 (pass classes=)")
    return names


def check_labels(dataset, name: str, classes) -> None:
    """Labels are class indices 0..len(classes)-1 (outside, the loss raises at the first step; on CUDA a device-side
    assert): the Dataset's `targets` if it has them, else its first item's label."""
    targets = getattr(dataset, "targets", None)
    try:
        labels = torch.as_tensor(targets if targets is not None else [int(dataset[0][1])]).reshape(-1)
    except (TypeError, ValueError, RuntimeError):  # `targets` of another kind (class names): the first item's label
        labels = torch.as_tensor([int(dataset[0][1])])
    outside = labels[(labels < 0) | (labels >= len(classes))]
    if len(outside):
        some = ", ".join(classes[:4]) + (", ..." if len(classes) > 4 else "")
        raise DataError(f"{name} has label {int(outside[0])}, but there are {len(classes)} classes ({some}): labels "
                        f"are 0..{len(classes) - 1}; pass classes= with every class")


def given_data(cfg: TrainConfig, given, device, processes: int = 1) -> Data:
    """Your Datasets as the run's Data (pipeline 'cpu'). mean/std are recorded (--mean/--std, else 0 and 1: predict
    scales images to [0, 1]), not applied: the Dataset's tensors go to the model as they are."""
    image = check_item(given.train_set, "train_set")
    check_item(given.test_set, "test_set")
    mean, std = cfg.normalisation()
    info = DataInfo(type(given.train_set).__name__, class_names(given.train_set, given.classes),
                    mean or (0.0, 0.0, 0.0), std or (1.0, 1.0, 1.0), int(image.shape[-1]))
    for dataset, name in ((given.train_set, "train_set"), (given.test_set, "test_set")):
        check_labels(dataset, name, info.classes)
    batch = cfg.batch_size or auto_batch(len(given.train_set), processes * cfg.grad_accum)
    workers, why = worker_count(cfg)
    common = dict(batch_size=batch, **loader_kwargs(cfg, device, workers))
    # training workers start anew each epoch: your Dataset's set_epoch (if any) reaches them
    train_loader = DataLoader(given.train_set, shuffle=True, drop_last=True, **{**common, "persistent_workers": False})
    test_loader = DataLoader(given.test_set, shuffle=False, drop_last=False, **common)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return Data(train_loader, test_loader, cpu_inputs(memory_format), len(given.train_set), len(given.test_set), info,
                "cpu", [f"your Datasets ({type(given.train_set).__name__}), as they are; {why}"])


def cpu_inputs(memory_format):
    """A batch of your Dataset's (images, labels) -> the model's inputs. Labels as int64, the class indices the loss
    takes: int32 / numpy int32 labels collate to an int32 tensor, which cross_entropy refuses."""
    def inputs(batch, train, epoch=0):
        x, y = batch
        return x.contiguous(memory_format=memory_format), y.long()
    return inputs
