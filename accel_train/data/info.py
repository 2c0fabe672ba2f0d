"""What a data set is (`DataInfo`, its CIFAR-10 instance) and DataError, which every reader raises.

`DataInfo` is the one description of a data set: class names, mean/std, input size. CIFAR-10 is one
instance (`CIFAR10`); an image folder gets its own from its folder names and its training images.
The model's head, the export (model_config.json), `evaluate` and `predict` all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


class DataError(ConfigError):
    """The data on disk is missing, unreadable or not in the expected layout. Raised in a DataLoader
    worker, it is rebuilt in the trainer by torch's ExceptionWrapper from one argument, "Caught
    <type> in DataLoader worker process N.\nOriginal Traceback ...": the message is the traceback's
    last line, without the traceback."""

    def __init__(self, message: str):
        if message.startswith("Caught ") and "\nOriginal Traceback" in message:
            last = message.rstrip().splitlines()[-1]  # "<module>.<type>: <message>"
            message = last.split(": ", 1)[1] if ": " in last else last
        super().__init__(message)


@dataclass(frozen=True)
class DataInfo:
    """The facts of a data set that the model, the export, evaluate and predict share."""

    name: str
    classes: tuple[str, ...]
    # None: unknown (your own Dataset's, not seen in its transform)
    mean: tuple[float, float, float] | None
    std: tuple[float, float, float] | None
    image_size: int
    # evaluation: shorter side resized to image_size / crop_pct, then the centre square
    crop_pct: float = 1.0
    dataset: str | None = None  # your own Dataset's class name (name "dataset")
    normalised_by: str = ""  # where an own Dataset's mean/std were seen

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def pad(self) -> int:
        """Crop padding: 4 pixels at 32x32 (the CIFAR recipe), scaled with the image size."""
        return max(1, round(self.image_size / 8))

    def model_config(self) -> dict:
        """The data half of model_config.json (timm's data-config names where there is one), with a
        `pretrained_cfg` that timm resolves to the inputs training saw
        (timm.data.resolve_data_config(pretrained_cfg= ...): input size, mean/std, bilinear,
        crop_pct = the shorter side resized to image_size / crop_pct, centre crop); none where the
        mean/std are unknown (your own Dataset's)."""
        data = {
            "input_size": [3, self.image_size, self.image_size],
            "interpolation": "bilinear",
            "mean": listed(self.mean),
            "std": listed(self.std),
            "crop_pct": self.crop_pct,
            "crop_mode": "center",
        }
        timm_cfg = (
            {"pretrained_cfg": {**data, "num_classes": self.num_classes}}
            if self.mean is not None
            else {}
        )
        return {
            "data": self.name,
            **({"dataset": self.dataset} if self.dataset else {}),
            "num_classes": self.num_classes,
            **data,
            "classes": list(self.classes),
            "resize": "shorter side, then centre crop",
            **timm_cfg,
        }

    @classmethod
    def from_model_config(cls, meta: dict, mean=None, std=None) -> DataInfo:
        """`mean`/`std` (--mean/--std of evaluate and predict) over the recorded ones; a model whose
        data's normalisation is unknown (your own Dataset's) is refused without them: files would be
        scaled at random."""
        mean, std = mean or meta.get("mean"), std or meta.get("std")
        if mean is None or std is None:
            raise ConfigError(
                "the model was trained on your own Dataset "
                f"({meta.get('dataset', 'train()')}) whose normalisation was not "
                "recorded; pass --mean R,G,B --std R,G,B (what its transform "
                "applied to [0, 1] images)"
            )
        return cls(
            meta.get("data", "cifar10"),
            tuple(meta["classes"]),
            tuple(mean),
            tuple(std),
            int(meta["input_size"][-1]),
            float(meta.get("crop_pct", 1.0)),
            meta.get("dataset"),
        )


def listed(values) -> list | None:
    return None if values is None else list(values)


# CIFAR-10: channel statistics computed on the 50,000 training images; random data borrows them.
CIFAR10 = DataInfo(
    "cifar10",
    ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    (0.4914, 0.4822, 0.4465),
    (0.2470, 0.2435, 0.2616),
    32,
)
