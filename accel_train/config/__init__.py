"""What a run is asked to do: TrainConfig, the one home of every default and every check of a
flag, the rules that fill in the automatic ones, and the training recipe's flags.

Modules: train_config (TrainConfig: defaults, validate, resolve), flag_types (a flag's value
checked alike from the command line, a --config YAML and train()), defaults (the rules resolve
applies), recipes (the crop, --crop_pct and timm's per-sample augmentations).
"""

from .train_config import TrainConfig

__all__ = ["TrainConfig"]
