"""Your own Datasets (`accel_train.train(cfg, train_set=..., test_set=...)`): map-style torch
Datasets of (image tensor (C, H, W), int label), loaded as they are (your Dataset normalises and
augments; `set_epoch(epoch)`, if it has one, is called before each epoch) by the cpu pipeline's
DataLoaders with --num_workers, sharded by prepare().

Exact resume holds when the Dataset gives the same item for an index every time (its randomness, if
any, a function of the index and the epoch)."""

from __future__ import annotations

import numbers

import torch
from torch.utils.data import DataLoader

from ..config.defaults import auto_batch
from ..config.recipes import per_sample
from ..config.train_config import TrainConfig
from ..errors import ConfigError
from ..platform.cores import worker_count
from .info import DataError, DataInfo
from .pipeline import Data
from .workers import loader_kwargs

# items checked at start, evenly spaced (0 and the last among them); the rest as each batch is built
SAMPLE = 8


def check_item(dataset, name: str) -> torch.Tensor:
    """A sample of the Dataset's items (SAMPLE, evenly spaced) must be (image float tensor
    (C, H, W), int label), the images of one shape: item 0's image, or one line naming the first
    item that is not."""
    try:
        size = len(dataset)
        first = dataset[0]
    except Exception as e:
        raise DataError(
            f"{name}: len() and [0] of a map-style Dataset failed ({type(e).__name__}: "
            + " ".join(str(e).split())[:200]
            + ")"
        ) from None
    if size < 1 or (problem := item_problem(first)):
        raise DataError(f"{name}[0] is {problem or 'an empty Dataset'}; {EACH}")
    for i in sample(size)[1:]:
        problem = item_problem(read(dataset, name, i), tuple(first[0].shape))
        if problem:
            raise DataError(f"{name}[{i}] is {problem}; {EACH}")
    return first[0]


EACH = "each item must be (image float tensor (C, H, W), int label), every image of one shape"


def sample(size: int) -> list[int]:
    return sorted({round(k * (size - 1) / (SAMPLE - 1)) for k in range(SAMPLE)}) if size > 0 else []


def read(dataset, name: str, i: int):
    try:
        return dataset[i]
    except Exception as e:
        raise DataError(
            f"{name}[{i}] failed ({type(e).__name__}: " + " ".join(str(e).split())[:200] + ")"
        ) from None


def item_problem(item, shape: tuple | None = None, classes: int | None = None) -> str:
    """What is wrong with one item ("" if nothing): not (image float tensor (C, H, W), int label),
    an image of another shape than `shape`, a label outside 0..classes-1."""
    ok = (
        isinstance(item, (tuple, list))
        and len(item) == 2
        and isinstance(item[0], torch.Tensor)
        and item[0].ndim == 3
        and item[0].is_floating_point()
        and is_label(item[1])
    )
    if not ok:
        return (
            "(" + ", ".join(describe(v) for v in item) + ")"
            if isinstance(item, (tuple, list))
            else describe(item)
        )
    if shape is not None and tuple(item[0].shape) != shape:
        return f"an image of shape {tuple(item[0].shape)}, not {shape} (item 0's)"
    if classes is not None and not 0 <= int(item[1]) < classes:
        return f"label {int(item[1])}, outside 0..{classes - 1} ({classes} classes)"
    return ""


class BadItem(DataError):
    """An item found wrong as a batch is built: raised in a DataLoader worker, which torch re-raises
    in the training process as BadItem("Caught BadItem in DataLoader worker ...\nOriginal Traceback
    ...: <line>"): the line kept."""

    def __init__(self, message: str):
        last = message.rstrip().splitlines()[-1] if "\n" in message else message
        super().__init__(last.partition(f"{type(self).__name__}: ")[2] or last)


class Checked(torch.utils.data.Dataset):
    """Your Dataset as the loaders read it: each item checked as it is read (cheap, on the CPU,
    before the batch goes to the device: a label outside the classes is one line naming its index,
    never a CUDA device-side assert). Its other attributes (set_epoch, targets, classes) are your
    Dataset's."""

    def __init__(self, dataset, name: str, shape: tuple, classes: int):
        self.dataset, self.name, self.shape, self.classes = dataset, name, shape, classes

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        item = self.dataset[i]
        if problem := item_problem(item, self.shape, self.classes):
            raise BadItem(f"{self.name}[{i}] is {problem}; {EACH}, labels 0..{self.classes - 1}")
        return item

    def __getattr__(self, attr):
        # (unpickling in a worker; no __getitems__ past the checks)
        if attr.startswith("__") or attr == "dataset":
            raise AttributeError(attr)
        return getattr(self.dataset, attr)


def is_label(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.is_floating_point() and not value.dtype == torch.bool
    # (numpy's integers too)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    kind = type(value)
    return (
        f"a {kind.__name__}"
        if kind.__module__ == "builtins"
        else f"a {kind.__module__}.{kind.__qualname__}"
    )


def class_names(dataset, classes=None) -> tuple[str, ...]:
    """`classes` (names or a count), else the Dataset's own `classes` (torchvision's convention),
    else its labels (`targets`, or every item's: one pass over the data)."""
    classes = classes if classes is not None else getattr(dataset, "classes", None)
    if classes is None:
        labels = getattr(dataset, "targets", None)
        labels = labels if labels is not None else [int(dataset[i][1]) for i in range(len(dataset))]
        classes = int(max(int(v) for v in labels)) + 1
    names = (
        tuple(str(i) for i in range(classes))
        if isinstance(classes, int)
        else tuple(map(str, classes))
    )
    if len(names) < 2:
        raise DataError(
            f"the data has {len(names)} class(es); a classifier needs at least 2 (pass classes=)"
        )
    return names


def check_labels(dataset, name: str, classes) -> None:
    """Labels are class indices 0..len(classes)-1 (outside, the loss raises at the first step; on
    CUDA a device-side assert): the Dataset's `targets` if it has them, and a sample of its items'
    labels (the rest: as batches are built, Checked)."""
    targets = getattr(dataset, "targets", None)
    try:
        labels = torch.as_tensor(targets if targets is not None else []).reshape(-1).long()
    # `targets` of another kind (class names): the items' labels
    except (TypeError, ValueError, RuntimeError):
        labels = torch.zeros(0, dtype=torch.long)
    bad = ((labels < 0) | (labels >= len(classes))).nonzero().reshape(-1)
    found = [(int(labels[bad[0]]), f"{name}.targets[{int(bad[0])}]")] if len(bad) else []
    for i in sample(len(dataset)) if not found else ():
        label = int(read(dataset, name, i)[1])
        if not 0 <= label < len(classes):
            found = [(label, f"{name}[{i}]")]
            break
    if found:
        (label, where), some = (
            found[0],
            ", ".join(classes[:4]) + (", ..." if len(classes) > 4 else ""),
        )
        raise DataError(
            f"{name} has label {label}, but there are {len(classes)} classes ({some}): "
            f"labels are 0..{len(classes) - 1} ({where} is {label}); "
            "pass classes= with every class"
        )


def seen_normalisation(dataset) -> tuple[tuple, tuple, str] | None:
    """(mean, std, what showed them) of the images a Dataset gives, read from its torchvision
    transform: a Normalize (v1 or v2) -> its mean/std; a conversion to [0, 1] floats (ToTensor,
    ToDtype(scale=True), ConvertImageDtype) without one -> 0 and 1. None where it cannot be seen: no
    transform, a Lambda or a transform of your own (then evaluate/predict of raw files need
    --mean/--std)."""
    # Subset and the like
    while getattr(dataset, "transform", None) is None and hasattr(dataset, "dataset"):
        dataset = dataset.dataset
    steps = flatten(getattr(dataset, "transform", None))
    names = [type(t).__name__ for t in steps]
    known = {
        "Normalize",
        "ToTensor",
        "ToImage",
        "ToDtype",
        "ConvertImageDtype",
        "PILToTensor",
        "Resize",
        "CenterCrop",
        "RandomResizedCrop",
        "RandomCrop",
        "RandomHorizontalFlip",
        "Grayscale",
        "Pad",
    }
    if not steps or not set(names) <= known or names.count("Normalize") > 1:
        return None
    if "Normalize" in names:
        t = steps[names.index("Normalize")]
        return (
            tuple(map(float, t.mean)),
            tuple(map(float, t.std)),
            "the Normalize in train_set's transform",
        )
    if any(
        n in ("ToTensor", "ConvertImageDtype") or (n == "ToDtype" and getattr(t, "scale", False))
        for n, t in zip(names, steps)
    ):
        return (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), "train_set's transform (to [0, 1], no Normalize)"
    return None


def flatten(transform) -> list:
    if transform is None:
        return []
    inner = getattr(transform, "transforms", None)  # Compose (v1, v2)
    return (
        [t for step in inner for t in flatten(step)]
        if isinstance(inner, (list, tuple))
        else [transform]
    )


def given_data(cfg: TrainConfig, given, device, processes: int = 1) -> Data:
    """Your Datasets as the run's Data (pipeline 'cpu'). mean/std are recorded, not applied (the
    Dataset's tensors go to the model as they are): --mean/--std, else what the Dataset's transform
    shows (seen_normalisation), else unknown (None: evaluate and predict of raw files then ask for
    --mean/--std)."""
    asked = per_sample(cfg) + (
        ["--train_crop random_resized"] if cfg.train_crop == "random_resized" else []
    )
    if asked:
        raise ConfigError(
            f"{', '.join(asked)}: your Datasets are loaded as they are, the trainer "
            "augments none; augment in your Dataset "
            "(e.g. timm.data.create_transform(..., is_training=True))"
        )
    image, test_image = (
        check_item(given.train_set, "train_set"),
        check_item(given.test_set, "test_set"),
    )
    mean, std = cfg.normalisation()
    seen = seen_normalisation(given.train_set) or (None, None, "")
    info = DataInfo(
        "dataset",
        class_names(given.train_set, given.classes),
        mean or seen[0],
        std or seen[1],
        int(image.shape[-1]),
        dataset=type(given.train_set).__name__,
        normalised_by=seen[2],
    )
    for dataset, name in ((given.train_set, "train_set"), (given.test_set, "test_set")):
        check_labels(dataset, name, info.classes)
    batch = cfg.batch_size or auto_batch(len(given.train_set), processes * cfg.grad_accum)
    workers, why = worker_count(cfg.num_workers)
    common = dict(batch_size=batch, **loader_kwargs(cfg.num_workers, device, workers))
    # training workers start anew each epoch: your Dataset's set_epoch (if any) reaches them
    classes = info.num_classes
    train_loader = DataLoader(
        Checked(given.train_set, "train_set", tuple(image.shape), classes),
        shuffle=True,
        drop_last=True,
        **{**common, "persistent_workers": False},
    )
    test_loader = DataLoader(
        Checked(given.test_set, "test_set", tuple(test_image.shape), classes),
        shuffle=False,
        drop_last=False,
        **common,
    )
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    notes = [
        f"your Datasets ({info.dataset}), as they are; {why}",
        said_normalisation(info, mean is not None),
    ]
    return Data(
        train_loader,
        test_loader,
        cpu_inputs(memory_format),
        len(given.train_set),
        len(given.test_set),
        info,
        "cpu",
        notes,
    )


def said_normalisation(info: DataInfo, flags: bool) -> str:
    if info.mean is None or info.std is None:
        return (
            "mean/std not seen in your Dataset (no torchvision Normalize/ToTensor transform): "
            "recorded as unknown; pass --mean/--std to record what it applies "
            "(evaluate/predict of image files need them)"
        )
    return f"mean/std {list(info.mean)} / {list(info.std)} recorded, from " + (
        "--mean/--std" if flags else info.normalised_by
    )


def cpu_inputs(memory_format):
    """A batch of your Dataset's (images, labels) -> the model's inputs. Labels as int64, the class
    indices the loss takes: int32 / numpy int32 labels collate to an int32 tensor, which
    cross_entropy refuses."""

    def inputs(batch, train, epoch=0):
        x, y = batch
        return x.contiguous(memory_format=memory_format), y.long()

    return inputs
