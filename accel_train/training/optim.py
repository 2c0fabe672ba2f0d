"""The optimizer, the lr schedule and the training loss, from the flags, through timm
(docs/fine-tuning.md).

- `--opt`: any `timm.optim.create_optimizer_v2` name; its lr and weight decay default by family
  (defaults.OPTIMIZER_DEFAULTS, TrainConfig.optimizer_defaults); `--layer_decay` is timm's
  layer-wise decay (param_groups_layer_decay, by the model's group_matcher). Frozen parameters
  (requires_grad False) are left out of every group by timm's grouping.
- `--sched`: any step-wise `create_scheduler_v2` name, after a linear warmup (warmup_prefix), per
  optimizer step.
- the loss: label smoothing, or with --mixup/--cutmix timm's Mixup (the smoothing folded into its
  soft targets) and SoftTargetCrossEntropy, as timm's train.py does. Mixup draws from numpy's global
  generator: loop.reseed seeds it per micro-batch from (seed, step, micro-batch, rank), so a resume
  draws what the uninterrupted run drew.
"""

from __future__ import annotations

import difflib

import timm
import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2

from ..config.flag_types import json_kwargs
from ..errors import ConfigError


def build_optimizer(cfg, model: torch.nn.Module, num_processes: int) -> torch.optim.Optimizer:
    """timm's optimizer `--opt` over the parameters that train, with weight decay off for norm and
    bias parameters."""
    lr_base, decay = cfg.optimizer_defaults()
    name, known = cfg.optimizer.lower(), known_optimizers()
    if known and name.split("_")[-1] not in known:
        near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        raise ConfigError(
            f"--opt {cfg.optimizer}: not a timm optimizer; "
            + (f"did you mean {', '.join(near)}? " if near else "")
            + "timm.optim.list_optimizers() lists them, e.g. sgd, adamw, lamb, lion"
        )
    if cfg.layer_decay is not None and not callable(getattr(model, "group_matcher", None)):
        raise ConfigError(
            "--layer_decay needs a model that names its layers (timm's "
            f"group_matcher()); {type(model).__name__} has none: drop --layer_decay"
        )
    try:
        return create_optimizer_v2(
            model,
            name,
            lr=cfg.peak_lr(num_processes),
            weight_decay=decay,
            momentum=cfg.momentum,
            layer_decay=cfg.layer_decay,
        )
    # (bnb* without bitsandbytes; an older timm)
    except (ImportError, ValueError, TypeError, AssertionError) as e:
        why = " ".join(str(e).split())[:160] or f"timm {timm.__version__} has no such optimizer"
        raise ConfigError(
            f"--opt {cfg.optimizer}: timm could not build it ({why}); pick another --opt"
        ) from None


def schedule(cfg, optimizer, num_processes: int, steps_per_epoch: int):
    """The lr is a function of the global optimizer step and the current flags, set with
    step_update(step): no scheduler object is stepped per process, so num_processes never changes
    the schedule."""
    # warmup_prefix: the schedule starts at the peak where the warmup ends
    peak = cfg.peak_lr(num_processes)
    # (when every epoch is warmup, `after` is unused)
    after = cfg.epochs - cfg.warmup_epochs if cfg.epochs > cfg.warmup_epochs else cfg.epochs
    try:
        scheduler, _ = create_scheduler_v2(
            optimizer,
            cfg.sched,
            num_epochs=after,
            warmup_epochs=cfg.warmup_epochs,
            warmup_prefix=True,
            min_lr=cfg.min_lr,
            warmup_lr=peak / 100,
            step_on_epochs=False,
            updates_per_epoch=steps_per_epoch,
            **json_kwargs(cfg, "sched_kwargs"),
        )
    except (TypeError, ValueError, AssertionError) as e:
        if "nknown sched" in str(e) or "nvalid sched" in str(e):
            scheduler = None  # (said below)
        else:
            raise ConfigError(
                f"--sched {cfg.sched} with --sched_kwargs "
                f"{cfg.sched_kwargs or '{}'}: {' '.join(str(e).split())[:160]}; "
                "see timm's create_scheduler_v2 arguments"
            ) from None
    if scheduler is None:  # (an older timm returns none for a name it lacks)
        raise ConfigError(
            f"--sched {cfg.sched}: this timm ({timm.__version__}) has no such "
            "schedule; upgrade timm or pick cosine"
        )
    return scheduler


def known_optimizers() -> list[str]:
    """timm's optimizer names ([] for a timm before its optimizer registry, 1.0.12: its factory
    says)."""
    try:
        from timm.optim import list_optimizers
    except ImportError:
        return []
    return list_optimizers()


def mixing(mixup: float, cutmix: float, label_smoothing: float, num_classes: int) -> Mixup | None:
    """timm's Mixup for --mixup/--cutmix (its defaults: every batch, mixup or cutmix half each when
    both, one lambda per batch), or None."""
    if not (mixup or cutmix):
        return None
    return Mixup(
        mixup_alpha=mixup,
        cutmix_alpha=cutmix,
        label_smoothing=label_smoothing,
        num_classes=num_classes,
    )


def criterion(label_smoothing: float, soft: bool = False) -> torch.nn.Module:
    """The training loss: on Mixup's soft targets (`soft`), else --label_smoothing's (or plain
    cross-entropy)."""
    if soft:
        return SoftTargetCrossEntropy()
    return (
        LabelSmoothingCrossEntropy(label_smoothing)
        if label_smoothing
        else torch.nn.CrossEntropyLoss()
    )


def check_mixing(mixup: float, cutmix: float, batch_size: int) -> None:
    """Mixup pairs each sample with the batch's mirror image (flip(0)): it needs an even per-process
    batch."""
    if (mixup or cutmix) and batch_size % 2:
        raise ConfigError(
            f"--mixup/--cutmix pair the samples of a batch: --batch_size {batch_size} must be even"
        )


def recipe_line(cfg, num_processes: int, mixed: bool) -> str:
    """The optimizer, schedule and loss the run trains with, and where their defaults came from."""
    lr_base, decay = cfg.optimizer_defaults()
    default = f"--opt {cfg.optimizer}'s default"
    base = f"({lr_base:g} per 256 images" + (f", {default})" if cfg.lr_base is None else ")")
    return (
        f"optimizer {cfg.optimizer} (timm), lr {cfg.peak_lr(num_processes):.4g} "
        + ("(--lr)" if cfg.lr is not None else base)
        + f", weight decay {decay:g}"
        + (f" ({default})" if cfg.weight_decay is None else "")
        + (f", layer decay {cfg.layer_decay:g}" if cfg.layer_decay else "")
        + f"; {cfg.warmup_epochs:g} warmup epoch(s), then {cfg.sched}"
        + (
            f"; mixup {cfg.mixup:g} / cutmix {cfg.cutmix:g} on soft targets (label smoothing "
            f"{cfg.label_smoothing:g})"
            if mixed
            else f"; label smoothing {cfg.label_smoothing:g}"
        )
    )
