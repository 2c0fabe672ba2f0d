"""What a data set is (`DataInfo`, its CIFAR-10 instance) and DataError, which every reader raises.

`DataInfo` is the one description of a data set: class names, mean/std, input size. CIFAR-10 is one
instance (`CIFAR10`); an image folder gets its own from its folder names and its training images. The
model's head, the export (model_config.json), `evaluate` and `predict` all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


class DataError(ConfigError):
    """The data on disk is missing, unreadable or not in the expected layout. Raised in a DataLoader worker, it is
    rebuilt in the trainer by torch's ExceptionWrapper from one argument, "Caught <type> in DataLoader worker process
    N.\nOriginal Traceback ...": the message is the traceback's last line, without the traceback."""

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
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    image_size: int
    crop_pct: float = 1.0  # evaluation: shorter side resized to image_size / crop_pct, then the centre square

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
                "interpolation": "bilinear", "crop_pct": self.crop_pct, "resize": "shorter side, then centre crop"}

    @classmethod
    def from_model_config(cls, meta: dict) -> "DataInfo":
        return cls(meta.get("data", "cifar10"), tuple(meta["classes"]), tuple(meta["mean"]), tuple(meta["std"]),
                   int(meta["input_size"][-1]), float(meta.get("crop_pct", 1.0)))


# CIFAR-10: channel statistics computed on the 50,000 training images; random data borrows them.
CIFAR10 = DataInfo("cifar10", ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                               "truck"), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), 32)
