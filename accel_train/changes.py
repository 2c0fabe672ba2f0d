"""What a resume may change. Every TrainConfig field is one of three kinds:

- the run's math (runs.RUN_MATH, --grad_accum, the global batch, the training data's size): refused, naming the
  flag (resume.reconcile, resume.check_data);
- APPLIED, the optimisation settings: they take effect from the resumed step and the change is logged in one
  line. The checkpoint carries the optimizer's state (momentum buffers), not its settings: those are the flags'
  (`settings_from_flags` around load_state), and the lr schedule is rebuilt from the flags (setup.schedule);
- free: paths, logging, checkpointing, performance and evaluation-only flags, which leave the weights alone.
"""

from __future__ import annotations

from contextlib import contextmanager

from .errors import ConfigError

APPLIED = ("epochs", "lr", "lr_base", "min_lr", "warmup_epochs", "momentum", "weight_decay", "label_smoothing",
           "clip_grad", "ema", "ema_decay", "mixed_precision")


def settings(cfg, precision: str) -> dict:
    """The applied settings a checkpoint records (mixed_precision: the one the run used, `auto` resolved)."""
    return {**{key: getattr(cfg, key) for key in APPLIED}, "mixed_precision": precision}


def check_changes(old: dict, cfg) -> None:
    """Refuse what cannot be applied: weight decay switched on or off changes the optimizer's parameter groups
    (none without decay, two with it: norm and bias parameters are not decayed)."""
    if "weight_decay" in old and (old["weight_decay"] == 0) != (cfg.weight_decay == 0):
        raise ConfigError(f"--weight_decay {cfg.weight_decay:g} cannot follow the checkpoint's {old['weight_decay']:g} "
                          "(weight decay on or off changes the optimizer's parameter groups); resume with a "
                          f"{'zero' if old['weight_decay'] == 0 else 'non-zero'} --weight_decay or start a fresh run")


def log_changes(meta: dict, cfg, precision: str, log) -> None:
    """One line naming each applied setting that differs from the checkpoint's run (--epochs: resume.reconcile)."""
    old = (meta.get("run") or {}).get("settings")
    if not old:  # a checkpoint of an older accel_train: its settings are not recorded, and its schedule was older
        log(f"resume: a checkpoint of an earlier accel_train, whose cosine ran from step 1 under the warmup: from step "
            f"{meta['step'] + 1} on the lr follows this version's schedule (the cosine starts at the peak, after the "
            "warmup), a little higher than before")
        return
    now = settings(cfg, precision)
    changed = [f"--{k} {_said(old[k])} -> {_said(now[k])}" for k in APPLIED if k != "epochs" and k in old
               and old[k] != now[k]]
    if changed:
        log(f"resume: {', '.join(changed)}: applied from step {meta['step'] + 1} on (the checkpoint's run used the "
            "values on the left)")


SCHEDULE = ("epochs", "lr", "lr_base", "min_lr", "warmup_epochs")  # what the lr of a step is a function of


def schedule_changed(meta: dict, cfg) -> bool:
    """Whether the lr schedule from the checkpoint's step on differs from its run's (an older checkpoint, whose
    settings are not recorded: taken as changed)."""
    old = (meta.get("run") or {}).get("settings")
    return not old or any(k not in old or old[k] != getattr(cfg, k) for k in SCHEDULE)


def _said(value) -> str:
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value).lower() \
        if isinstance(value, bool) else str(value)


@contextmanager
def settings_from_flags(optimizers):
    """Around accelerator.load_state: the optimizers keep the settings they were built with from the flags
    (momentum, weight decay, ...) and take only the checkpoint's state; load_state would restore its param groups'."""
    built = [[{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups] for opt in optimizers]
    yield
    for opt, groups in zip(optimizers, built):
        for group, values in zip(opt.param_groups, groups):
            group.update(values)
