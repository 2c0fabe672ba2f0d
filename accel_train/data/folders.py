"""Image folders: <root>/train/<class>/*, <root>/val|validation|valid|test/<class>/*. Which files
make each split: the class folders scanned, --val_split's hold-out of train/,
--train_samples/--test_samples' subsets."""

from __future__ import annotations

import hashlib
import logging
import math
from pathlib import Path

import numpy as np

from ..lines import counted
from .info import DataError

# an image folder's evaluation split, first found wins (valid/: Roboflow's and many Kaggle sets'
# name)
EVAL_DIRS = ("val", "validation", "valid", "test")


def _image_extensions() -> set[str]:
    from PIL import Image

    return {ext.lower() for ext in Image.registered_extensions()}


def scan_split(
    root: Path, classes: tuple[str, ...] | None = None
) -> tuple[tuple[str, ...], list[Path], list[int]]:
    """<root>/<class>/<files> -> (class names, files, labels). Class names are the sorted folder
    names; with `classes` given (the training split's), the folders must be among them and labels
    index into them. Hidden files, files in hidden folders (.AppleDouble/, .thumbnails/) and files
    whose extension no Pillow plugin claims are skipped."""
    extensions = _image_extensions()
    found = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not found:
        raise DataError(
            f"{root} has no class folders; put each class's images in {root}/<class name>/"
        )
    if classes is None and len(found) == 1:  # it would train to 100% without learning anything
        raise DataError(
            f"{root} has one class folder ({found[0]}); a classifier needs two or more "
            f"classes: add a folder per class in {root}/"
        )
    if classes is None:
        classes = tuple(found)
    unknown = [c for c in found if c not in classes]
    if unknown:
        raise DataError(
            f"{root}: class folder(s) {', '.join(unknown)} are not in the training "
            f"split ({', '.join(classes)}); rename or remove them"
        )
    files, labels, broken = [], [], []
    for name in found:
        named = [
            f
            for f in (root / name).rglob("*")
            if f.suffix.lower() in extensions
            and not any(part.startswith(".") for part in f.relative_to(root / name).parts)
        ]
        images = sorted(f for f in named if f.is_file())
        # (is_file is False for a link that leads nowhere: said, not skipped in silence)
        broken += [f for f in named if f.is_symlink() and not f.exists()]
        if not images:
            raise DataError(
                f"class folder {root / name} has no images; add some or remove the folder"
            )
        files += images
        labels += [classes.index(name)] * len(images)
    if broken:
        logging.getLogger("accel_train").warning(
            f"{root}: skipped {counted(len(broken), 'image link')} to nothing (dangling or "
            f"looping): {', '.join(str(f) for f in sorted(broken)[:3])}"
            + (" ..." if len(broken) > 3 else "")
        )
    return classes, files, labels


def image_folder_splits(
    data_dir, need_train: bool = True, val_split: float | None = None
) -> tuple[Path, Path | None]:
    """(train/, the evaluation folder); with `val_split` (--val_split: held out of train/) no
    evaluation folder."""
    root = Path(data_dir)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(
            f"data directory {root} {what}; pass --data_dir (or --data_url) "
            "pointing at the folder that holds train/ and val/"
        )
    train = root / "train"
    if (need_train or val_split) and not train.is_dir():
        raise DataError(
            f"{root} has no train/ folder; an image folder is "
            f"{root}/train/<class>/... and {root}/val/<class>/..."
        )
    evaluation = next((root / d for d in EVAL_DIRS if (root / d).is_dir()), None)
    if val_split and evaluation is not None:  # two evaluation splits: which one is meant is unsaid
        raise DataError(
            f"--val_split {val_split:g} holds out part of {train}, but {evaluation} "
            "is an evaluation split already; drop --val_split to evaluate on "
            f"{evaluation}, or move it away"
        )
    if evaluation is None and not val_split:
        raise DataError(
            f"{root} has no evaluation split; add {root}/val/<class>/... (or "
            "validation/, valid/ or test/), or hold part of train/ out with "
            "--val_split 0.1"
        )
    return train, evaluation


def held_out(
    root: Path, classes, files: list[Path], labels: list[int], fraction: float, seed: int
) -> tuple[tuple[list, list], tuple[list, list]]:
    """--val_split: ((training files, labels), (held-out files, labels)) of train/ (`root`). Each
    class holds out round(n x fraction) of its n files (stratified), those first in the order of a
    hash of (seed, the file's path under `root`): the same files on every rank and machine
    (wherever the folder lies) and on every resume; a file added later moves no other file between
    the splits. A class left with none in either split is refused."""
    train, test = [], []
    for c, name in enumerate(classes):
        members = [i for i, label in enumerate(labels) if label == c]
        n, k = len(members), math.floor(len(members) * fraction + 0.5)
        if n == 1 or not 0 < k < n:
            fix = (
                f"raise --val_split to at least {math.ceil(50 / n) / 100:g}"
                if k == 0 and n > 1
                else "lower --val_split"
                if n > 1
                else "add images"
            )
            none = "none held out" if k == 0 else "none to train on"
            raise DataError(
                f"--val_split {fraction:g} leaves class {name} "
                f"({counted(n, 'image')} in {root / name}) {none}; {fix}, or add a "
                f"val/<class>/ folder beside {root}"
            )
        rank = sorted(
            members,
            key=lambda i: hashlib.blake2b(
                f"{seed}\0{files[i].relative_to(root).as_posix()}".encode(), digest_size=8
            ).digest(),
        )
        test += sorted(rank[:k])
        train += sorted(rank[k:])
    return tuple(([files[i] for i in part], [labels[i] for i in part]) for part in (train, test))


def subset(files: list, labels: list, n: int | None) -> tuple[list, list]:
    """--train_samples/--test_samples on an image folder: N files, evenly spaced within each class
    (files are sorted by class, so the first N would be the first classes only), each class's share
    as its share of the folder but at least one file while N allows (a small class would fall
    between evenly spaced picks of the whole folder)."""
    if n is None or n >= len(files):
        return files, labels
    counts = np.bincount(labels)
    present = counts > 0
    ideal = n * counts / len(files)
    share = np.where(
        present, np.maximum(np.floor(ideal), 1 if n >= present.sum() else 0), 0
    ).astype(int)
    # (the classes raised to one: taken from the classes furthest above their ideal share)
    while share.sum() > n:
        share[np.argmax(np.where(share > 1, share - ideal, -np.inf))] -= 1
    while share.sum() < n:  # the largest remainders
        share[np.argmax(np.where(share < counts, ideal - share, -np.inf))] += 1
    keep = []
    for c in np.flatnonzero(share):
        members = np.flatnonzero(np.asarray(labels) == c)
        keep += members[np.linspace(0, len(members) - 1, share[c]).round().astype(int)].tolist()
    return [files[i] for i in keep], [labels[i] for i in keep]
