"""The CIFAR-10 reader: <data_dir>/cifar-10-batches-py's pickled batches, unpickled with only the
globals numpy arrays need and validated."""

from __future__ import annotations

import codecs
import pickle
from pathlib import Path

import numpy as np
import torch

from .info import CIFAR10, DataError

CIFAR_DIR = "cifar-10-batches-py"
TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_FILE = "test_batch"


def _numpy_globals() -> dict:
    core = getattr(np, "_core", None) or np.core
    # _codecs.encode: how Python 3 writes bytes in protocol-2 pickles (a pure data transform)
    allowed = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,
    }
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
            raise DataError(
                f"{path} is not a plain CIFAR-10 pickle ({e}); it was not executed - "
                "replace it with the original cifar-10-batches-py file"
            ) from None
        raise DataError(
            f"{path} is truncated or corrupt ({e}); re-extract cifar-10-python.tar.gz"
        ) from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise DataError(
            f"{path} is truncated or corrupt ({type(e).__name__}: {e}); "
            "re-extract cifar-10-python.tar.gz"
        ) from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path} holds a {type(obj).__name__}, not a CIFAR-10 batch dict")
    data = obj.get(b"data", obj.get("data"))
    labels = obj.get(b"labels", obj.get("labels"))
    if data is None or labels is None:
        raise DataError(f"{path} has no 'data'/'labels' entries; is it a CIFAR-10 python batch?")
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 2
        or data.shape[1] != 3072
    ):
        shape = getattr(data, "shape", None)
        dtype = getattr(data, "dtype", type(data).__name__)
        raise DataError(
            f"{path}: data must be an N x 3072 uint8 array, got shape {shape} dtype {dtype}"
        )
    labels = np.asarray(labels)
    if (
        labels.ndim != 1
        or labels.shape[0] != data.shape[0]
        or not np.issubdtype(labels.dtype, np.integer)
    ):
        raise DataError(
            f"{path}: expected {data.shape[0]} integer labels, "
            f"got shape {labels.shape} dtype {labels.dtype}"
        )
    if labels.size and (labels.min() < 0 or labels.max() >= CIFAR10.num_classes):
        raise DataError(
            f"{path}: labels must be in 0..{CIFAR10.num_classes - 1}, "
            f"found {labels.min()}..{labels.max()}"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def read_cifar10(
    data_dir, splits=("train", "test")
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """<data_dir>/cifar-10-batches-py -> {'train': (images u8, labels), 'test': (...)}, only the
    splits asked for."""
    data_dir = Path(data_dir)
    root = data_dir / CIFAR_DIR
    if not data_dir.is_dir():
        what = "is a file, not a folder" if data_dir.exists() else "does not exist"
        raise DataError(
            f"data directory {data_dir} {what}; pass --data_dir "
            f"(or --data_url) pointing at the folder that holds {CIFAR_DIR}/, "
            "or use --data random"
        )
    if not root.is_dir():
        raise DataError(
            f"{data_dir} has no {CIFAR_DIR}/ folder; "
            "extract cifar-10-python.tar.gz there, or use --data random"
        )
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
