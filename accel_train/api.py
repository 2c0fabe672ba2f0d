"""The Python entry point: `from accel_train import TrainConfig, train`.

    train(TrainConfig(epochs=2, output_dir="out"), model=MyNet, train_set=my_train, test_set=my_test)

from your own script, started with `python my_script.py`, `accelerate launch my_script.py` (every rank runs it) or
launch.sh with ACCEL_TRAIN_SCRIPT=my_script.py (README: Your own model). The same run as the command line's, with
every guarantee; it returns what that run returns.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .config import TrainConfig
from .errors import ConfigError
from .files import MODEL_FILE, missing_dirs, remove_if_empty
from .user import Given, name_of


def train(config: TrainConfig | None = None, *, model=None, train_set=None, test_set=None, classes=None) -> dict:
    """Train as `accel-train` does, with `config`'s flags.

    `model`: an nn.Module, or a factory called with `num_classes` and `config.model_kwargs` (None: `config.model`, a
    timm name or module.path:callable). `train_set` / `test_set`: map-style Datasets of (image tensor (C, H, W), int
    label), loaded as they are (None: `config.data`); `classes`: their class names or count (default: the Dataset's
    `classes`, else its labels). Returns the final metrics (final_test_acc, best_test_acc, ...) and the outputs
    (output_dir, model_file). Bad input raises accel_train.errors.ConfigError (one line, nothing written); a stop by a
    signal raises Preempted (the checkpoint is written: run again with resume="auto"); divergence raises Diverged."""
    cfg = config if config is not None else TrainConfig()
    if (train_set is None) != (test_set is None):
        raise ConfigError("pass train_set and test_set together (or neither: config.data)")
    if model is not None:
        cfg.model = name_of(model)  # what config.yaml and model_config.json record
    if not logging.getLogger().handlers:  # a script that set up no logging still sees the run's lines
        logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
        logging.getLogger("accelerate").setLevel(logging.WARNING)
    from .loop import train as run
    created = missing_dirs(cfg.output_dir)
    try:
        summary = run(cfg, Given(model, train_set, test_set, classes))
    except ConfigError:
        remove_if_empty(created)  # a refused start leaves no empty --output_dir behind
        raise
    return {**summary, "output_dir": str(cfg.output_dir), "model_file": str(Path(cfg.output_dir) / MODEL_FILE)}
