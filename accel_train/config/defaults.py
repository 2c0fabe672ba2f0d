"""The rules behind automatic defaults (TrainConfig keeps the values; its resolve() applies these):
the per-process batch a small data set can fill without leaving much of it out of every epoch, the
one line said when a given --batch_size does, and why --stem auto keeps timm's stem at a small size.

An epoch is whole global batches (batch_size x processes x grad_accum): the loaders drop the
incomplete last batch (drop_last) and the micro-batches of an incomplete accumulation window, so
`samples % global batch` samples (all of them, when they cannot fill one) are left out of every
epoch.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from . import recipes

# The cifar stem keeps the full resolution into the first block: at 224 px that is ~49x the compute
# of timm's own stem (7x7/2 conv + maxpool, 4x smaller each side), so it is the default only for
# small images.
CIFAR_STEM_MAX = 64  # largest --image_size that --stem auto trains through the cifar stem

# the recipe's per-process batch, kept wherever the data has MIN_STEPS global batches of it
BATCH_SIZE = 128
# the default batch gives an epoch at least this many steps: under 1/MIN_STEPS of samples dropped
MIN_STEPS = 10
MAX_DROP = 0.1  # a given --batch_size that leaves more than this share out of every epoch is said
# BatchNorm needs 2 samples per process in training: a smaller data set is refused, not run at 1
MIN_BATCH = 2


def dropped(samples: int, global_batch: int) -> int:
    """Training samples left out of every epoch."""
    return samples % global_batch if samples >= global_batch else samples


def auto_batch(samples: int, replicas: int = 1) -> int:
    """The default per-process batch: the largest power of two up to BATCH_SIZE whose epoch has
    MIN_STEPS steps (`replicas`: processes x grad_accum), so at most a tenth of the samples is
    dropped; MIN_BATCH below that (a data set that cannot fill it is refused at start-up, in one
    line)."""
    batch = BATCH_SIZE
    while batch > MIN_BATCH and samples // (batch * replicas) < MIN_STEPS:
        batch //= 2
    return batch


def auto_batch_said(samples: int, batch: int, replicas: int) -> str:
    """The resolved-defaults entry for an automatic batch: what it gives, and what the recipe's
    would have."""
    if batch == BATCH_SIZE:
        return f"--batch_size {batch}"
    steps, full = samples // (batch * replicas), samples // (BATCH_SIZE * replicas)
    lost = dropped(samples, BATCH_SIZE * replicas)
    instead = (
        f"{BATCH_SIZE} would give {full} step{'s' * (full != 1)} and drop {lost}"
        if full
        else f"{BATCH_SIZE} would not fill one batch"
    )
    return (
        f"--batch_size {batch} ({samples} training samples: {steps} step{'s' * (steps != 1)} "
        f"an epoch, {dropped(samples, batch * replicas) or 'none'} dropped; {instead})"
    )


def resolve_batch(
    batch_size: int | None, grad_accum: int, train_size: int | None, num_processes: int
) -> tuple[dict, str | None]:
    """An automatic --batch_size (None) becomes auto_batch's for the training set's size: ({the
    batch_size}, what the resolved-defaults line says of it); ({}, None) when given, or before the
    data's size is known. data/pipeline.py built the loaders with the same auto_batch."""
    if batch_size is not None or train_size is None:
        return {}, None
    batch = auto_batch(train_size, num_processes * grad_accum)
    return {"batch_size": batch}, auto_batch_said(train_size, batch, num_processes * grad_accum)


def dropped_note(batch_size: int, grad_accum: int, samples: int, num_processes: int) -> str | None:
    """One line when a given --batch_size leaves more than MAX_DROP of the training samples out of
    every epoch."""
    replicas = num_processes * grad_accum
    lost = dropped(samples, batch_size * replicas)
    if lost <= MAX_DROP * samples:
        return None
    better = auto_batch(samples, replicas)
    return (
        f"--batch_size {batch_size} leaves {lost} of the {samples} training samples "
        f"({lost / samples:.0%}) out of every epoch (an epoch is whole global batches of "
        f"{batch_size * replicas}); --batch_size {better} (the default for this data) "
        f"drops {dropped(samples, better * replicas) or 'none'}"
    )


def auto_stem_said(model: str) -> str:
    """The resolved-defaults entry for --stem auto at a small size on a model the cifar stem does
    not fit."""
    if ":" in model:  # your own model (model/own_model.py)
        return (
            f"--stem imagenet ({model}, your own model, unchanged; --stem cifar replaces a "
            "ResNet conv1 + maxpool)"
        )
    return (
        f"--stem imagenet ({model} has no ResNet conv1 + maxpool for the cifar stem to "
        "replace: timm's stem unchanged; --stem cifar fits resnet18-style models)"
    )


def infer_data(data_dir: str, default_dir: bool) -> str:
    """--data not given: the kind of data --data_dir holds, as timm infers a folder from its path (a
    --data_dir of photos without --data must not train on random noise, silently). The default
    --data_dir trains the embedded default, random data; a --data_dir that holds neither kind is
    refused rather than ignored."""
    if default_dir:
        return "random"
    root = Path(data_dir)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise ConfigError(
            f"--data_dir {data_dir} {what}; pass the folder that holds "
            "cifar-10-batches-py/ or train/<class>/, or --data random (random data "
            "reads no folder)"
        )
    if (root / "cifar-10-batches-py").is_dir():
        return "cifar10"
    if (root / "train").is_dir():
        return "imagefolder"
    raise ConfigError(
        f"--data_dir {data_dir} holds neither cifar-10-batches-py/ (cifar10) nor "
        "train/<class>/ (imagefolder): point it at the folder that holds one of "
        "them, or pass --data to say which (--data random reads no folder)"
    )


# --opt's defaults when --lr_base / --weight_decay are not given: (lr per 256 images of global
# batch, weight decay), by the optimizer's family. The learning rate scales linearly with the global
# batch for every family (Goyal et al. 2017).
OPTIMIZER_DEFAULTS = {
    # this trainer's CIFAR ResNet recipe (README: The default recipe): 0.1 at batch 128, 5e-4
    "sgd": (0.2, 5e-4),
    # DeiT (Touvron et al. 2021, timm's deit recipe): AdamW at 5e-4 x batch/512, weight decay 0.05;
    # also the default of the other adaptive optimizers with decoupled weight decay (adan, nadamw,
    # adopt, laprop, ...): no recipe of their own was verified here, and each paper compares against
    # AdamW at AdamW's settings
    "adamw": (2.5e-4, 0.05),
    # DeiT's lr; Adam's weight decay is an L2 term in the gradient (coupled), off as in
    # torch.optim.Adam
    "adam": (2.5e-4, 0.0),  # (also RMSprop and Adagrad: coupled weight decay)
    # ResNet strikes back A1 (Wightman et al. 2021, timm): LAMB at 5e-3 for batch 2048,
    # weight decay 0.01
    "lamb": (6.25e-4, 0.01),
    # Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"): 3-10x smaller lr and
    # 3-10x larger weight decay than AdamW; their ViT recipe takes 10x: AdamW's row / 10 and x 10
    "lion": (2.5e-5, 0.5),
}
# timm names (their cautious c-, bnb-, fused- and 8bit variants too) -> a row above; others: adamw
OPTIMIZER_FAMILY = {
    **dict.fromkeys(
        (
            "sgd",
            "sgdw",
            "sgdp",
            "sgdc",
            "momentum",
            "nesterov",
            "nesterovw",
            "lars",
            "larc",
            "nlars",
            "nlarc",
        ),
        "sgd",
    ),
    **dict.fromkeys(
        (
            "adam",
            "nadam",
            "radam",
            "adamax",
            "nadamlegacy",
            "radamlegacy",
            "adabelief",
            "radabelief",
            "rmsprop",
            "rmsproptf",
            "adagrad",
        ),
        "adam",
    ),
    **dict.fromkeys(("lamb", "lambc", "lambw", "lambcw", "lambcd"), "lamb"),
    **dict.fromkeys(("lion", "lionc"), "lion"),
}


def optimizer_family(name: str) -> str:
    """The OPTIMIZER_DEFAULTS row of a timm optimizer name (lookahead_ prefix, c-/bnb/fused
    variants, 8bit suffix)."""
    base = name.lower().split("_")[-1].removesuffix("8bit")
    for prefix in ("bnb", "fused", ""):
        stem = base.removeprefix(prefix)
        for candidate in (stem, stem[1:] if stem.startswith("c") else stem):
            if candidate in OPTIMIZER_FAMILY:
                return OPTIMIZER_FAMILY[candidate]
    return "adamw"


def resolve_auto(
    cfg,
    info,
    pipeline: str,
    cifar_fits: bool = True,
    train_size: int | None = None,
    num_processes: int = 1,
) -> tuple[dict, str]:
    """The one place where automatic values become the run's: 'auto'/None replaced by what the data
    (its DataInfo: image size, mean/std; its size: the batch) and the machine (the pipeline chosen)
    gave, so the log, config.yaml, model_config.json and the checkpoints all say the values the run
    used. Returns ({setting: the run's value}, the log line); `cfg` is only read."""
    auto = [
        name
        for name in ("image_size", "stem", "mean", "std", "pipeline", "train_crop")
        if getattr(cfg, name) in (None, "auto")
    ] + (["crop_pct"] if cfg.crop_pct is None and cfg.data == "imagefolder" else [])
    why = (
        {"stem": auto_stem_said(cfg.model)}
        if cfg.stem == "auto" and not cifar_fits and info.image_size <= CIFAR_STEM_MAX
        else {}
    )
    values = {"image_size": info.image_size, "stem": cfg.stem_for(info.image_size, cifar_fits)}
    if info.mean is not None:  # (None: your own Dataset's, not seen: config.yaml keeps null)
        values["mean"], values["std"] = (
            ",".join(repr(float(v)) for v in rgb) for rgb in (info.mean, info.std)
        )
    values["pipeline"] = pipeline
    values["train_crop"] = recipes.train_crop(cfg.data, cfg.train_crop)
    values["crop_pct"] = info.crop_pct if cfg.data == "imagefolder" else None
    # workers had nothing to do; config.yaml must load again (see validate)
    if pipeline == "device":
        values["num_workers"] = 0
    said = [
        why.get(name, f"--{name} {values.get(name, getattr(cfg, name))}")
        for name in auto
        if values.get(name, getattr(cfg, name)) is not None
    ]
    batch, batch_said = resolve_batch(cfg.batch_size, cfg.grad_accum, train_size, num_processes)
    said.append(batch_said)  # (None: given, or no data size to follow)
    return {**values, **batch}, "resolved defaults: " + (
        ", ".join(filter(None, said)) or "none (all given)"
    )
