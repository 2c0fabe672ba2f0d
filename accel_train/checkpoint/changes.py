"""What a resume may change. Every TrainConfig field is one of three kinds:

- the run's math (output_dir.RUN_MATH, --grad_accum, the global batch, the training data's size):
  refused, naming the flag (resume.reconcile, resume.check_data);
- APPLIED, the optimisation settings: they take effect from the resumed step and the change is
  logged in one line. The checkpoint carries the optimizer's state (momentum buffers), not its
  settings: those are the flags' (`settings_from_flags` around load_state), and the lr schedule is
  rebuilt from the flags (setup.schedule);
- free: paths, logging, checkpointing, performance and evaluation-only flags, which leave the
  weights alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError

APPLIED = (
    "epochs",
    "lr",
    "lr_base",
    "min_lr",
    "warmup_epochs",
    "momentum",
    "weight_decay",
    "label_smoothing",
    "clip_grad",
    "ema",
    "ema_decay",
    "mixed_precision",
    "optimizer",
    "layer_decay",
    "sched",
    "sched_kwargs",
    "drop_path",
    "drop_rate",
    "mixup",
    "cutmix",
)


def settings(cfg, precision: str) -> dict:
    """The applied settings a checkpoint records (mixed_precision: the one the run used, `auto`
    resolved; lr_base and weight_decay: --opt's defaults where not given)."""
    lr_base, decay = cfg.optimizer_defaults()
    return {
        **{key: getattr(cfg, key) for key in APPLIED},
        "mixed_precision": precision,
        "lr_base": lr_base,
        "weight_decay": decay,
    }


def check_changes(old: dict, cfg) -> None:
    """Refuse what cannot be applied: another --opt (the checkpoint's optimizer state is its
    optimizer's), weight decay or --layer_decay switched on or off (the optimizer's parameter groups
    change: norm and bias parameters are not decayed; layer decay groups by layer)."""
    now = settings(cfg, "")
    if old.get("optimizer", "sgd") != cfg.optimizer:
        raise ConfigError(
            f"--opt {cfg.optimizer} cannot follow the checkpoint's "
            f"{old.get('optimizer', 'sgd')} (its optimizer state is "
            f"{old.get('optimizer', 'sgd')}'s); resume with --opt "
            f"{old.get('optimizer', 'sgd')} or start a fresh run"
        )
    for key, off in (("weight_decay", 0), ("layer_decay", None)):
        if key in old and (old[key] == off) != (now[key] == off):
            raise ConfigError(
                f"--{key} {_said(now[key])} cannot follow the checkpoint's "
                f"{_said(old[key])} ({key} on or off changes the optimizer's "
                f"parameter groups); resume with {'no' if old[key] == off else 'a'} "
                f"--{key} or start a fresh run"
            )


def log_changes(meta: dict, cfg, precision: str, log) -> None:
    """One line naming each applied setting that differs from the checkpoint's run (--epochs:
    resume.reconcile)."""
    old = (meta.get("run") or {}).get("settings")
    if not old:  # a checkpoint of an older accel_train: no settings recorded, an older schedule
        log(
            "resume: a checkpoint of an earlier accel_train, whose cosine ran from step 1 under "
            f"the warmup: from step {meta['step'] + 1} on the lr follows this version's schedule "
            "(the cosine starts at the peak, after the warmup), a little higher than before"
        )
        return
    now = settings(cfg, precision)
    changed = [
        f"--{k} {_said(old[k])} -> {_said(now[k])}"
        for k in APPLIED
        if k != "epochs" and k in old and old[k] != now[k]
    ]
    if changed:
        log(
            f"resume: {', '.join(changed)}: applied from step {meta['step'] + 1} on (the "
            "checkpoint's run used the values on the left)"
        )


# a step's lr follows these
SCHEDULE = ("epochs", "lr", "lr_base", "min_lr", "warmup_epochs", "sched", "sched_kwargs")


def schedule_changed(meta: dict, cfg) -> bool:
    """Whether the lr schedule from the checkpoint's step on differs from its run's, compared as the
    checkpoint records them (settings: --opt's lr_base where not given). An older checkpoint, whose
    settings are not recorded (or not all of them): taken as changed."""
    old, now = (meta.get("run") or {}).get("settings"), settings(cfg, "")
    return not old or any(k not in old or old[k] != now[k] for k in SCHEDULE)


def _said(value) -> str:
    return (
        "unset"
        if value is None
        else (
            f"{value:g}"
            if isinstance(value, float)
            else str(value).lower()
            if isinstance(value, bool)
            else str(value)
        )
    )


@contextmanager
def settings_from_flags(optimizers):
    """Around accelerator.load_state: the optimizers keep the settings they were built with from the
    flags (momentum, weight decay, ...) and take only the checkpoint's state; load_state would
    restore its param groups'."""
    built = [
        [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
        for opt in optimizers
    ]
    yield
    for opt, groups in zip(optimizers, built):
        for group, values in zip(opt.param_groups, groups):
            group.update(values)


# What identifies a run's data beyond the checkpoint's run math (image size, mean/std:
# resume.keep_run_math takes them from the checkpoint).
RUN_DATA = ("data", "data_dir", "train_samples", "test_samples", "val_split")
DATA_KINDS = ("cifar10", "imagefolder", "random")
# what start-up resolved from the run's data (config/defaults.py): not the values for another kind
DATA_RESOLVED = ("image_size", "mean", "std", "pipeline", "crop_pct", "train_crop")
# Settings that may differ between the machines of one job (paths of each machine's own disk, its
# workers, its logging, the platform's rendezvous arguments, the seed's aliases)
PER_MACHINE = frozenset(
    {
        "output_dir",
        "data_dir",
        "log_all_ranks",
        "num_workers",
        "init_method",
        "rank",
        "world_size",
        "custom_data",
        "enable_gpu",
        "overwrite",
        "resume",
        "init_from",
        "pretrained_path",
    }
)
# What a resume never takes from the run's record: this command's own (where it writes, what it
# continues, where this invocation stops) and trust, which a file never grants (cli.py)
OWN = (PER_MACHINE - {"data_dir"}) | {"max_steps", "trust_model_code"}


def run_config(output_dir, resume) -> Path:
    """The config.yaml of the run a --resume continues: the one beside the checkpoints of a
    --resume PATH (<run>/checkpoints/step_N), else --output_dir's."""
    given = Path(str(resume))
    beside = given.parent.parent / "config.yaml"
    if resume != "auto" and given.parent.name == "checkpoints" and beside.is_file():
        return beside
    return Path(output_dir) / "config.yaml"


def run_settings(values: dict, named: set[str], read) -> tuple[str | None, dict | None]:
    """A resume continues the run: every setting that the command line (and its --config) leaves
    out is the run's own, from its config.yaml (`read`: cli.load_yaml), never the default, so that
    `--output_dir D --resume auto` continues the run in D as it was started. Changes `values` in
    place; returns the line that says what was taken (None: nothing) and what was taken (None: no
    record was read; a machine whose disk lost it takes another machine's at start: resume.decide).

    The data: --data named alone takes the run's --data_dir only if the run read the same kind;
    --data_dir named alone says its own kind (config.infer_data). A value that is named and
    conflicts with the checkpoint is refused later, naming both (resume.keep_run_math). Model code
    (module:callable) is imported only when named (--model, or train(model=...)). Under
    --overwrite (launch.sh's relaunch of a run that replaced another, whose command line it gives
    again) only the data is taken: the config.yaml may still be the replaced run's."""
    if not values.get("resume"):
        return None, None
    path = run_config(values["output_dir"], values["resume"])
    try:
        recorded = read(path) if path.is_file() else {}
    except ConfigError:  # (a config.yaml this version cannot read: the flags as given)
        return None, None
    if not recorded:
        return None, None
    drop, kind_named = set(OWN), bool(named & {"data", "custom_data"})
    if kind_named or "data_dir" in named:  # the kind named, or said by the folder named
        drop.add("data")
        if "data_dir" in named or values.get("data") != recorded.get("data"):
            drop.add("data_dir")
        if kind_named and values.get("data") != recorded.get("data"):  # (not the run's folder)
            drop |= {"val_split", *DATA_RESOLVED}
    if recorded.get("data") not in DATA_KINDS:  # (a run on a script's own Datasets reads no folder)
        drop |= {"data", "data_dir"}
    if ":" in str(recorded.get("model", "")):
        drop.add("model")
    keys = [
        k
        for k in recorded
        if k not in named | drop and k in values and (k in RUN_DATA or not values.get("overwrite"))
    ]
    taken = {k: recorded[k] for k in keys if recorded[k] != values.get(k)}
    if not taken:
        return None, {}
    values.update(taken)
    said = " ".join(f"--{k} {_said(v)}" for k, v in taken.items())
    return (
        (
            f"resume: the run's own settings from {path}, where this command line names none: "
            f"{said}; its image size, classes and mean/std follow the checkpoint"
        ),
        taken,
    )
