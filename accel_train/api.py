"""The Python entry point: `from accel_train import TrainConfig, train`.

    train(TrainConfig(epochs=2, output_dir="out"), model=MyNet, train_set=my_train,
          test_set=my_test)

from your own script, started with `python my_script.py`, `accelerate launch my_script.py` (every
rank runs it) or launch.sh with ACCEL_TRAIN_SCRIPT=my_script.py (docs/own_data_and_models.md). The
same run as the command line's, with every guarantee; it returns what that run returns.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

from .config.resolved import NOTHING_TAKEN, Taken, with_values
from .config.train_config import TrainConfig
from .errors import ConfigError, Diverged, Preempted, is_lost_peer
from .exits import exit_rank, lost_peer, note_aborts
from .files import MODEL_FILE, missing_dirs, remove_if_empty
from .model.own_model import Given, name_of
from .resilience.preempt import SIGNALS, watch_launcher
from .status import status_of


def train(
    config: TrainConfig | None = None, *, model=None, train_set=None, test_set=None, classes=None
) -> dict:
    """Train as `accel-train` does, with `config`'s flags.

    `model`: an nn.Module, or a factory called with `num_classes` and `config.model_kwargs`, or a
    timm name or module.path:callable (None: `config.model`). `train_set` / `test_set`: map-style
    Datasets of (image tensor (C, H, W), int label), loaded as they are (None: `config.data`);
    `classes`: their class names or count (default: the Dataset's `classes`, else its labels).
    Returns the final metrics (final_test_acc, best_test_acc, ...) and the outputs (output_dir,
    model_file). Bad input raises accel_train.errors.ConfigError (one line, nothing written); a stop
    by a signal raises Preempted (the checkpoint is written: run again with resume="auto");
    divergence raises Diverged."""
    # only read: what start-up resolves (image size, batch, precision, ...) goes into new configs,
    # so the caller's stays as built and a script that trains twice with it trains alike
    cfg = config if config is not None else TrainConfig()
    taken = cfg.taken  # (what the command line took from the resumed run's record: cli.py)
    cfg.validate()  # (a config changed after it was made: checked again before anything is touched)
    if (train_set is None) != (test_set is None):
        raise ConfigError("pass train_set and test_set together (or neither: config.data)")
    if isinstance(model, str):  # a timm name or module.path:callable, as config.model takes it
        cfg, model = with_values(cfg, {"model": model}), None
    if model is not None:
        # what config.yaml and model_config.json record
        cfg = with_values(cfg, {"model": name_of(model)})
    # a script that set up no logging still sees the run's lines
    if not logging.getLogger().handlers:
        logging.basicConfig(
            format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO
        )
        logging.getLogger("accelerate").setLevel(logging.WARNING)
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        summary = run_training(cfg, Given(model, train_set, test_set, classes), taken)
    # the script goes on (a notebook, a sweep): its Ctrl-C and SIGTERM are its own again; not
    # after a stop: a further SIGTERM while the process ends is no death by it
    except Exception as e:
        if not isinstance(e, Preempted):
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        raise
    return {
        **summary,
        "output_dir": str(cfg.output_dir),
        "model_file": str(Path(cfg.output_dir) / MODEL_FILE),
    }


def run_training(
    cfg: TrainConfig, given: Given | None = None, taken: Taken = NOTHING_TAKEN
) -> dict:
    """The run (loop.train) for the command line and for train(): a refused start leaves no empty
    --output_dir behind; a stop by a signal is said by every rank under --log_all_ranks; a lost peer
    is one line and exit 3. `taken`: what the command line took from a resumed run's record."""
    note_aborts()
    watch_launcher()  # (from here: a launcher that ends during start-up leaves no rank behind)
    created = missing_dirs(cfg.output_dir)
    from tqdm.contrib.logging import logging_redirect_tqdm

    from .checkpoint.output_dir import release_output_dir
    from .training.loop import train as loop_train  # (the heavy imports: torch, timm, accelerate)

    try:
        # log lines while the progress bar is open go above it, each on its own line
        with logging_redirect_tqdm():
            return loop_train(cfg, given, taken)
    except ConfigError:
        release_output_dir(cfg.output_dir, refused=True)
        remove_if_empty(created)
        raise
    # said by the main process (status.status_of), by every rank with --log_all_ranks
    except Preempted as e:
        e.every_rank = cfg.log_all_ranks
        raise
    # a lost peer, by exception type and by where the message comes from (the transport layer of
    # the collective library), never by loose words
    except Exception as e:
        if isinstance(e, Diverged) or not is_lost_peer(e):
            raise
        lost_peer(e, cfg.output_dir)
    finally:
        release_output_dir(cfg.output_dir)


def main(script) -> None:
    """`script()` (your own main, which calls train()) with the command line's lines and exit
    statuses (docs/failures.md): bad input one line and 2, preempted 4 (launch.sh
    --restart_on_preempt relaunches it), diverged 5.
    Ends the process: `if __name__ == "__main__": accel_train.api.main(my_main)`. What `script`
    returns (train()'s metrics, or nothing) is status 0; an int it returns is its status."""
    code = status_of(lambda: status(script()))
    exit_rank(code)
    sys.exit(code)


def status(returned) -> int:
    """What a script's main returned -> its exit status: an int as it is, anything else (train()'s
    dict) 0."""
    return returned if isinstance(returned, int) and not isinstance(returned, bool) else 0
