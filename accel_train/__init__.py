"""accel_train: one training loop, any platform, through Hugging Face Accelerate.

`from accel_train import TrainConfig, train` (api.py): the trainer from your own script; imported on
first use, so `import accel_train` stays light."""

import os as _os

__version__ = "0.1.0"
# the process that started this one, read first thing (preempt.watch_launcher)
PARENT = _os.getppid()
__all__ = ["TrainConfig", "train"]


def __getattr__(name):
    if name == "TrainConfig":
        from .config.train_config import TrainConfig

        return TrainConfig
    if name == "train":
        from .api import train

        return train
    raise AttributeError(f"module 'accel_train' has no attribute {name!r}")
