"""TrainConfig: the one home of every default.

Each field carries its command-line help, its --help group and, where the platform spells it
differently (ModelArts passes --data_url / --train_url), its aliases. `cli.py` builds the argument
parser from these fields, so a default is written exactly once, here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import ConfigError
from . import recipes
from .defaults import (
    BATCH_SIZE,
    CIFAR_STEM_MAX,
    MIN_STEPS,
    OPTIMIZER_DEFAULTS,
    infer_data,
    optimizer_family,
    resolve_auto,
)
from .flag_types import at_least, check_types_and_choices, json_kwargs, rgb
from .resolved import NOTHING_TAKEN, Taken, write_yaml

# Automatic defaults (docs/own_data_and_models.md): CIFAR_STEM_MAX in defaults.py.
MAX_AUTO_SIZE = 224  # largest image size --image_size auto picks (timm's resnet input size)
SIZE_SAMPLE = 256  # image-folder files whose header is read to find the images' own size
MAX_WORKERS = 8  # most DataLoader workers per process that --num_workers auto starts
AUTO = (None, "auto")  # the values that stand for an automatic default
SEED_MAX = 2**32 - 1  # the largest seed numpy takes (accelerate's set_seed seeds numpy with it)


def opt(default, help, group, **extra):
    return field(default=default, metadata=dict(help=help, group=group, **extra))


@dataclass
class TrainConfig:
    # what the command line took from the record of the run a --resume continues: set by the parser
    # (cli.parse_train_args), read by train(); no flag and no setting (a ClassVar is no field)
    taken: ClassVar[Taken] = NOTHING_TAKEN

    # data
    data: str | None = opt(
        None,
        "'cifar10' reads <data_dir>/cifar-10-batches-py, 'imagefolder' "
        "<data_dir>/train/<class>/* and val|valid|validation|test/<class>/*, "
        "'random' random images (by --seed); default: what --data_dir holds",
        "data",
        choices=("cifar10", "imagefolder", "random"),
    )
    data_dir: str = opt(
        "input_dir",
        "directory that holds cifar-10-batches-py/ (cifar10) or "
        "train/ and val/ (imagefolder); the default input_dir is ./input_dir, read "
        "only with --data cifar10|imagefolder (neither --data nor --data_dir: "
        "random data)",
        "data",
        aliases=("--data_url",),
    )
    image_size: int | None = opt(
        None,
        "training and evaluation resolution (square); default 32 "
        "for cifar10 and random; for imagefolder the training images' own "
        f"size (the median shorter side of up to {SIZE_SAMPLE} of them), "
        f"at most {MAX_AUTO_SIZE} (images are resized, shorter side, "
        "then centre-cropped)",
        "data",
    )
    train_samples: int | None = opt(
        None,
        "use only the first N training samples (image folders: N "
        "evenly spaced files; random data: its size, default 50000)",
        "data",
    )
    test_samples: int | None = opt(
        None,
        "use only the first N test samples (random data: its "
        "size, default 10000 or --train_samples, the smaller)",
        "data",
    )
    val_split: float | None = opt(
        None,
        "an image folder without val/: hold out this fraction of "
        "each class of train/ as the evaluation split (chosen by --seed: "
        "the same files on every rank, machine and resume; evaluate and "
        "predict --held_out read them)",
        "data",
    )
    pipeline: str = opt(
        "auto",
        "'device': uint8 images live on the accelerator, batches are "
        "gathered and augmented there; 'cpu': image decoding and augmentation in "
        "DataLoader workers; 'cache': the cpu pipeline reading an image folder "
        "decoded once per machine; 'auto': device when the decoded data fits "
        "--device_data_mb, else cache where the local disk has room, else cpu",
        "data",
        choices=("auto", "device", "cpu", "cache"),
    )
    device_data_mb: float | None = opt(
        None,
        "most MiB of decoded uint8 images the device pipeline "
        "may keep on the device; default: a quarter of its free "
        "memory (a CPU's: shared by the machine's processes; none "
        "where torch cannot measure it)",
        "data",
    )
    augment: bool = opt(
        True,
        "augment the training images: --train_crop's random crop "
        "(RandomResizedCrop for imagefolder, the zero-padded crop for cifar10 and "
        "random), --hflip's mirror and --color_jitter/--aa/--reprob where given; "
        "false: none of them",
        "data",
    )
    hflip: bool = opt(
        True,
        "mirror half the training images (with --augment); false for digits, "
        "text and other data that is not mirror-invariant",
        "data",
    )
    train_crop: str = opt(
        "auto",
        "'random_resized': timm's RandomResizedCrop from the whole image "
        "(--scale, --ratio); 'pad': random crop with zero padding of "
        "image_size/8 (CIFAR's); auto: random_resized for imagefolder, pad for "
        "cifar10 and random (docs/training.md: Recipes)",
        "data",
        choices=("auto", "random_resized", "pad"),
    )
    scale: str = opt(
        "0.08,1", "RandomResizedCrop: range of the crop's area, a fraction of the image's", "data"
    )
    ratio: str = opt(
        "3/4,4/3", "RandomResizedCrop: range of the crop's aspect ratio (log-uniform)", "data"
    )
    train_interpolation: str = opt(
        "bilinear",
        "RandomResizedCrop's resampling: bilinear "
        "(antialiased; uint8 in the workers), bicubic (per crop, "
        "antialiased) or random (either, per sample: timm train.py's "
        "default)",
        "data",
        choices=("bilinear", "bicubic", "random"),
    )
    crop_pct: float | None = opt(
        None,
        "image folders' evaluation: shorter side resized to "
        "image_size / crop_pct, centre crop; default: the weights' "
        "pretrained_cfg crop_pct, else timm's 0.875",
        "data",
    )
    color_jitter: float = opt(
        0.0,
        "timm's colour jitter (brightness, contrast, saturation) per "
        "sample; 0: off. Per-sample transforms run in DataLoader workers "
        "(--pipeline cpu or cache)",
        "data",
    )
    aa: str | None = opt(
        None,
        "timm's auto-augment string: rand-m9-mstd0.5 (RandAugment), "
        "v0/original (AutoAugment), augmix-...; trivial: torchvision's "
        "TrivialAugmentWide",
        "data",
    )
    reprob: float = opt(0.0, "timm's random erasing probability (per-pixel noise)", "data")
    mean: str | None = opt(
        None,
        "per-channel mean 'R,G,B' in [0, 1] for normalisation; default: "
        "with --init_from the weights' own (their model_config.json, or timm's "
        "pretrained_cfg), else CIFAR-10's for cifar10/random, computed from "
        "the training images for imagefolder",
        "data",
    )
    std: str | None = opt(None, "per-channel std 'R,G,B' (see --mean)", "data")
    num_workers: int | None = opt(
        None,
        "DataLoader worker processes per process (the cpu "
        "pipeline); default: the cores of the process's CPU affinity "
        "(its cgroup's CPU quota if fewer) / the processes on this "
        f"machine, at most {MAX_WORKERS}",
        "data",
    )

    # model
    model: str = opt(
        "resnet18",
        "any timm model name, or your own module.path:callable (called "
        "with num_classes and --model_kwargs, it returns an nn.Module; "
        "docs/own_data_and_models.md)",
        "model",
    )
    trust_model_code: bool = opt(
        False, "import the model code a model_config.json names (--init_from)", "model"
    )
    stem: str = opt(
        "auto",
        "'cifar': 3x3/stride-1 first conv and no maxpool, for 32x32 inputs; "
        "'imagenet': timm's model unchanged; 'auto': cifar up to --image_size "
        f"{CIFAR_STEM_MAX}, imagenet above",
        "model",
        choices=("auto", "cifar", "imagenet"),
    )
    model_kwargs: str | None = opt(
        None,
        "extra arguments to timm.create_model (or your callable) "
        "as JSON, e.g. '{\"drop_rate\": 0.1}' or "
        '\'{"norm_layer": "groupnorm"}\'',
        "model",
    )
    channels_last: bool | None = opt(
        None,
        "channels_last memory format for model and inputs; "
        "default: on for CPU and CUDA (measured faster), off on NPUs "
        "(not measured there)",
        "model",
    )
    init_from: str | None = opt(
        None,
        "start from the weights of a model.safetensors or .pth state "
        "dict on disk (an earlier export or timm weights); a classifier "
        "with another class count is re-created",
        "model",
    )
    pretrained: bool = opt(
        False,
        "start from timm's pretrained weights for --model (a tag picks "
        "them, e.g. resnet18.a1_in1k), from the Hugging Face cache (none "
        "downloaded under HF_HUB_OFFLINE=1) or --pretrained_path; mean/std "
        "from their config",
        "model",
    )
    pretrained_path: str | None = opt(
        None,
        "a file of timm weights for --model, loaded as timm "
        "loads its own (pretrained_cfg_overlay; implies "
        "--pretrained)",
        "model",
    )
    freeze: str | None = opt(
        None,
        "'backbone': train the classifier only (a linear probe); a "
        "module name (layer3, blocks.5): freeze the parameters up to and with "
        "it; frozen BatchNorm statistics stay fixed",
        "model",
    )
    drop_path: float = opt(0.0, "stochastic depth rate (timm's drop_path_rate)", "model")
    drop_rate: float = opt(0.0, "dropout rate before the classifier (timm's drop_rate)", "model")
    compile: bool = opt(False, "torch.compile the model", "model")
    compile_mode: str = opt(
        "default",
        "torch.compile mode",
        "model",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )

    # optimisation
    epochs: int = opt(30, "training epochs (the schedule's length)", "optimisation")
    max_steps: int | None = opt(
        None,
        "stop after N optimizer steps (smoke runs); the schedule stays the full run's",
        "optimisation",
    )
    patience: int | None = opt(
        None,
        "early stopping: stop after N evaluations without a better "
        "test accuracy (model_best's); default: off",
        "optimisation",
    )
    batch_size: int | None = opt(
        None,
        f"batch size per process; default {BATCH_SIZE}, less for a "
        "small data set: the largest power of two that gives an epoch "
        f"{MIN_STEPS} steps",
        "optimisation",
    )
    lr: float | None = opt(
        None, "peak learning rate; default: --lr_base x global batch / 256", "optimisation"
    )
    lr_base: float | None = opt(
        None,
        "learning rate per 256 images of global batch; default: "
        "--opt's (sgd 0.2, i.e. 0.1 at batch 128; adamw 2.5e-4; "
        "docs/fine-tuning.md)",
        "optimisation",
    )
    optimizer: str = opt(
        "sgd",
        "any timm create_optimizer_v2 name: sgd (nesterov momentum), adamw, lamb, lion, adan, ...",
        "optimisation",
        aliases=("--opt",),
    )
    layer_decay: float | None = opt(
        None,
        "layer-wise lr decay: each block's lr is this times the "
        "next one's, from the classifier down (timm's layer_decay, "
        "e.g. 0.75 to fine-tune a ViT)",
        "optimisation",
    )
    sched: str = opt(
        "cosine",
        "lr schedule after the warmup, timm's create_scheduler_v2 (plateau "
        "is not offered: the lr here is a function of the step)",
        "optimisation",
        choices=("cosine", "tanh", "step", "multistep", "poly", "wsd", "rsqrt", "constant"),
    )
    sched_kwargs: str | None = opt(
        None,
        "extra create_scheduler_v2 arguments as JSON, in epochs, "
        'e.g. \'{"decay_epochs": 10, "decay_rate": 0.5}\' for '
        "--sched step",
        "optimisation",
    )
    min_lr: float = opt(0.0, "learning rate at the end of the cosine decay", "optimisation")
    momentum: float = opt(
        0.9, "momentum of an optimizer that has one (SGD's: nesterov)", "optimisation"
    )
    weight_decay: float | None = opt(
        None,
        "weight decay (not applied to norm and bias "
        "parameters); default: --opt's (sgd 5e-4, adamw 0.05)",
        "optimisation",
    )
    label_smoothing: float = opt(
        0.1,
        "label smoothing of the training loss (with "
        "--mixup/--cutmix: of the mixed targets, as timm's Mixup does)",
        "optimisation",
    )
    mixup: float = opt(
        0.0, "mixup alpha (timm's Mixup; 0: off); the loss is then on soft targets", "optimisation"
    )
    cutmix: float = opt(
        0.0,
        "cutmix alpha (timm's Mixup; 0: off; with --mixup each batch picks one, half each)",
        "optimisation",
    )
    warmup_epochs: float = opt(
        1.0, "linear warmup length in epochs, then cosine decay", "optimisation"
    )
    grad_accum: int = opt(1, "gradient accumulation steps per optimizer step", "optimisation")
    clip_grad: float | None = opt(None, "clip the gradient norm to this value", "optimisation")
    seed: int = opt(
        42,
        "random seed, 0..2**32-1 (weights, data order, augmentation, random data)",
        "optimisation",
    )
    ema: bool = opt(
        False,
        "keep an exponential moving average of the weights (timm ModelEmaV3), evaluated alongside",
        "optimisation",
    )
    ema_decay: float = opt(0.999, "EMA decay per optimizer step", "optimisation")
    tta: bool = opt(False, "evaluate with horizontal-flip test-time augmentation", "optimisation")

    # checkpointing
    output_dir: str = opt(
        "output_dir",
        "where model, metrics and checkpoints go",
        "checkpointing",
        aliases=("--train_url",),
    )
    checkpoint_every: int = opt(
        0, "also checkpoint every N optimizer steps (0: only at epoch ends)", "checkpointing"
    )
    checkpoint_minutes: float | None = opt(
        None,
        "also checkpoint after this many minutes of "
        "training since the last checkpoint (default: 100x the "
        "measured write, so writes cost at most a hundredth of "
        "the time, at least 1 min, 10 min to the first; 0: "
        "never by time)",
        "checkpointing",
    )
    keep_checkpoints: int = opt(2, "keep the newest K complete checkpoints", "checkpointing")
    resume: str | None = opt(
        None,
        "'auto' (newest complete checkpoint in output_dir, else a fresh "
        "start) or a checkpoint directory",
        "checkpointing",
    )
    overwrite: bool = opt(
        False,
        "let a fresh run delete another run's checkpoints in "
        "--output_dir: set aside at start, deleted once it has saved one of its "
        "own (without it, such a start is refused)",
        "checkpointing",
    )
    timeout_s: int = opt(
        300,
        "collective timeout in seconds: a rank whose training thread hangs "
        "fails the job after this long (a frozen or unreachable one: "
        "--heartbeat_timeout_s)",
        "checkpointing",
    )
    heartbeat_s: float = opt(
        2.0,
        "seconds between the heartbeats each rank sends its peers from a thread of its own",
        "checkpointing",
    )
    heartbeat_timeout_s: float = opt(
        15.0,
        "a peer silent this long (stopped, paused, cut off, "
        "or in a C call holding the GIL that long) is lost: the "
        "survivors save the last step, exit 3; 0: off",
        "checkpointing",
    )
    hang_report_s: float = opt(
        30.0,
        "a rank whose training makes no progress this long (a step, "
        "an evaluation batch, a start-up phase; at least 10x the slowest "
        "step, a checkpoint write or a compile excepted) prints where every "
        "rank waits, with every thread's stack; nothing is stopped; 0: off",
        "checkpointing",
    )
    stop_on_hang: bool = opt(
        False,
        "end a hung run at that report: the survivors save the last "
        "completed step and exit 3, as for a lost peer (default: --timeout_s "
        "ends it)",
        "checkpointing",
    )

    # logging
    log_with: str | None = opt(
        None,
        "an Accelerate tracker name (tensorboard, wandb, ...), or several separated by commas",
        "logging",
    )
    tracker_project: str = opt(
        "accel_train",
        "the trackers' project (wandb's project; TensorBoard's subfolder of --output_dir)",
        "logging",
    )
    run_name: str | None = opt(
        None,
        "the run's name in the trackers (wandb's run name); default: the tracker's own",
        "logging",
    )
    log_every: int = opt(
        50,
        "every N optimizer steps: the loss averaged over ranks and the lr to "
        "steps.jsonl and the trackers",
        "logging",
    )
    log_all_ranks: bool = opt(False, "let every rank print, not only the main process", "logging")
    plot: bool = opt(True, "write training_curves.png at the end (needs matplotlib)", "logging")

    # performance
    threads: int | None = opt(
        None,
        "torch intra-op threads per process; default: OMP_NUM_THREADS "
        "if set, else the cores per process, 1 on a machine busy at start",
        "performance",
    )
    ddp_bucket_cap_mb: int = opt(25, "DDP gradient bucket size in MiB", "performance")
    ddp_grad_as_bucket_view: bool = opt(True, "DDP gradient_as_bucket_view", "performance")
    mixed_precision: str = opt(
        "auto",
        "'auto': the launcher's config (accelerate launch, "
        "launch.sh), and without a launcher the fastest precision the "
        "device has natively (bf16 on Ampere+ GPUs, Ascend A2/A3 and CPUs "
        "with avx512_bf16/AMX/aarch64 bf16; fp16 on older GPUs and 910A; "
        "fp32 on other CPUs); no|fp16|bf16: that one (overrides the "
        "launcher's); one the device lacks is refused",
        "performance",
        choices=("auto", "no", "fp16", "bf16"),
    )
    force_precision: bool = opt(
        False,
        "use the asked precision even where the device lacks it (emulated, slow)",
        "performance",
    )

    # platform: flags the ModelArts seed passes; device and ranks come from the launch config
    custom_data: bool | None = opt(
        None, "ModelArts seed flag: true = --data random, false = --data cifar10", "platform"
    )
    enable_gpu: bool | None = opt(
        None,
        "ModelArts seed flag; accepted, the device comes from the accelerate config",
        "platform",
    )
    init_method: str | None = opt(
        None, "ModelArts rank-0 address tcp://HOST:PORT; launch.sh consumes it", "platform"
    )
    rank: int | None = opt(None, "ModelArts node index; launch.sh consumes it", "platform")
    world_size: int | None = opt(None, "ModelArts node count; launch.sh consumes it", "platform")

    def __post_init__(self):
        if self.custom_data is not None:
            self.data = "random" if self.custom_data else "cifar10"
        if self.data is None:
            self.data = infer_data(self.data_dir, self.data_dir == TrainConfig.data_dir)
        self.validate()

    def validate(self) -> None:
        check_types_and_choices(self)
        at_least(
            self,
            1,
            "epochs",
            "grad_accum",
            "keep_checkpoints",
            "log_every",
            "timeout_s",
            "ddp_bucket_cap_mb",
            "batch_size",
            "max_steps",
            "train_samples",
            "test_samples",
            "patience",
        )
        at_least(
            self,
            0,
            "checkpoint_minutes",
            "checkpoint_every",
            "num_workers",
            "threads",
            "warmup_epochs",
            "weight_decay",
            "min_lr",
            "drop_path",
            "drop_rate",
            "mixup",
            "cutmix",
            "device_data_mb",
            "heartbeat_timeout_s",
            "hang_report_s",
        )
        # (numpy's generators take no other: set_seed would raise mid-start)
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"--seed must be in 0..{SEED_MAX}, got {self.seed}")
        if not self.heartbeat_s > 0 or 0 < self.heartbeat_timeout_s < 3 * self.heartbeat_s:
            raise ConfigError(
                "--heartbeat_s must be > 0 and --heartbeat_timeout_s 0 (off) or at "
                "least 3x it (a lost datagram is no lost peer), got "
                f"{self.heartbeat_s:g} and {self.heartbeat_timeout_s:g}"
            )
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0 < self.ema_decay < 1:
            raise ConfigError(f"--ema_decay must be in (0, 1), got {self.ema_decay}")
        self.model_kwargs_dict()
        json_kwargs(self, "sched_kwargs")
        if (
            self.layer_decay is not None
            and not 0 < self.layer_decay <= 1
            or self.drop_rate >= 1
            or self.drop_path >= 1
        ):
            raise ConfigError(
                "--layer_decay must be in (0, 1], --drop_rate and --drop_path in [0, 1)"
            )
        if self.image_size is not None and not 8 <= self.image_size <= 4096:
            raise ConfigError(f"--image_size must be in 8..4096, got {self.image_size}")
        if self.data == "cifar10" and self.image_size not in (None, 32):
            raise ConfigError(
                f"CIFAR-10 images are 32x32: drop --image_size {self.image_size} or "
                "use --data imagefolder"
            )
        self.normalisation()
        recipes.check(self)
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ConfigError(f"--clip_grad must be > 0, got {self.clip_grad}")
        if self.num_workers and self.pipeline == "device":
            raise ConfigError(
                f"--num_workers {self.num_workers} needs --pipeline cpu (the device "
                "pipeline has no DataLoader workers); add --pipeline cpu or drop "
                "--num_workers"
            )
        if self.val_split is not None and not 0 < self.val_split < 1:
            raise ConfigError(
                "--val_split is the fraction of each class held out, in (0, 1); got "
                f"{self.val_split:g}"
            )
        if self.val_split is not None and self.data != "imagefolder":
            raise ConfigError(
                "--val_split holds out part of an image folder's train/; "
                f"{self.data} data has a test split of its own: drop --val_split"
            )
        if self.pipeline == "cache" and self.data != "imagefolder":
            raise ConfigError(
                f"--pipeline cache decodes an image folder once; {self.data} needs "
                "no decoding: use --pipeline cpu or auto"
            )

    def model_kwargs_dict(self) -> dict:
        return json_kwargs(self, "model_kwargs")

    def resolution(self, native: int | None = None) -> int:
        """--image_size, or the default for the data: 32 for cifar10/random; for an image folder its
        images' own size `native` (the median shorter side), rounded down to a multiple of 8, within
        8..MAX_AUTO_SIZE."""
        if self.image_size:
            return self.image_size
        if self.data != "imagefolder":
            return 32
        return max(8, min(MAX_AUTO_SIZE, (native or MAX_AUTO_SIZE) // 8 * 8))

    def stem_for(self, image_size: int, cifar_fits: bool = True) -> str:
        """'auto': the cifar stem for small images on a model it fits (a ResNet's conv1 + maxpool),
        else timm's."""
        if self.stem != "auto":
            return self.stem
        return "cifar" if image_size <= CIFAR_STEM_MAX and cifar_fits else "imagenet"

    def resolve(
        self,
        info,
        pipeline: str,
        cifar_fits: bool = True,
        train_size: int | None = None,
        num_processes: int = 1,
    ) -> tuple[dict, str]:
        """The one place where automatic values become the run's (defaults.resolve_auto): ({setting:
        the run's value}, the log line). This config is only read."""
        return resolve_auto(self, info, pipeline, cifar_fits, train_size, num_processes)

    def normalisation(self) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """(mean, std) from --mean/--std, each three floats or None."""
        return rgb(self, "mean", 0), rgb(self, "std", 1e-6)

    def peak_lr(self, num_processes: int) -> float:
        if self.lr is not None:
            return self.lr
        return (
            self.optimizer_defaults()[0] * self.batch_size * num_processes * self.grad_accum / 256
        )

    def optimizer_defaults(self) -> tuple[float, float]:
        """(lr_base, weight_decay): the flags', else --opt's family's
        (defaults.OPTIMIZER_DEFAULTS)."""
        lr_base, decay = OPTIMIZER_DEFAULTS[optimizer_family(self.optimizer)]
        return (
            lr_base if self.lr_base is None else self.lr_base,
            decay if self.weight_decay is None else self.weight_decay,
        )

    def trackers(self) -> list[str]:
        return [t.strip() for t in self.log_with.split(",")] if self.log_with else []

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save_yaml(self, path, asked: dict | None = None, **recorded) -> None:
        """config.yaml (config/resolved.py): this config as the run's settings (`recorded`: values
        in place of its own), and what was `asked` ({setting: as asked}) where it differs."""
        write_yaml(path, self, asked, **recorded)


def fields():
    return dataclasses.fields(TrainConfig)
