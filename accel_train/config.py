"""TrainConfig: the one home of every default.

Each field carries its command-line help, its --help group and, where the platform spells it
differently (ModelArts passes --data_url / --train_url), its aliases. `cli.py` builds the argument
parser from these fields, so a default is written exactly once, here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import yaml

from .defaults import BATCH_SIZE, MIN_STEPS, auto_stem_said, infer_data, resolve_batch
from . import recipes
from .errors import ConfigError
from .flag_types import check_types_and_choices


# Automatic defaults (README: Train on your own images). The cifar stem keeps the full resolution into the first
# block: at 224 px that is ~49x the compute of timm's own stem (7x7/2 conv + maxpool, 4x smaller each side), so it
# is the default only for small images.
CIFAR_STEM_MAX = 64    # largest --image_size that --stem auto trains through the cifar stem
MAX_AUTO_SIZE = 224    # largest image size --image_size auto picks (timm's resnet input size)
SIZE_SAMPLE = 256      # image-folder files whose header is read to find the images' own size
MAX_WORKERS = 8        # most DataLoader workers per process that --num_workers auto starts
AUTO = (None, "auto")  # the values that stand for an automatic default


def opt(default, help, group, **extra):
    return field(default=default, metadata=dict(help=help, group=group, **extra))


@dataclass
class TrainConfig:
    # data
    data: str | None = opt(None, "'cifar10' reads <data_dir>/cifar-10-batches-py, 'imagefolder' <data_dir>/train/"
                           "<class>/* and val|valid|validation|test/<class>/*, 'random' random images (by --seed); "
                           "default: what --data_dir holds", "data", choices=("cifar10", "imagefolder", "random"))
    data_dir: str = opt("input_dir", "directory that holds cifar-10-batches-py/ (cifar10) or train/ and val/ "
                        "(imagefolder)", "data", aliases=("--data_url",))
    image_size: int | None = opt(None, "training and evaluation resolution (square); default 32 for cifar10 and "
                                 "random; for imagefolder the training images' own size (the median shorter side "
                                 f"of up to {SIZE_SAMPLE} of them), at most {MAX_AUTO_SIZE} (images are resized, "
                                 "shorter side, then centre-cropped)", "data")
    train_samples: int | None = opt(None, "use only the first N training samples (image folders: N evenly "
                                    "spaced files; random data: its size, default 50000)", "data")
    test_samples: int | None = opt(None, "use only the first N test samples (random data: its size, "
                                   "default 10000)", "data")
    pipeline: str = opt("auto", "'device': uint8 images live on the accelerator, batches are gathered and "
                        "augmented there; 'cpu': image decoding and augmentation in DataLoader workers; 'cache': "
                        "the cpu pipeline reading an image folder decoded once per machine; 'auto': device when the "
                        "decoded data fits --device_data_mb, else cache where the local disk has room, else cpu",
                        "data", choices=("auto", "device", "cpu", "cache"))
    device_data_mb: float | None = opt(None, "most MiB of decoded uint8 images the device pipeline may keep on "
                                       "the device; default: a quarter of its free memory (a CPU's: shared by "
                                       "the machine's processes; none where torch cannot measure it)", "data")
    augment: bool = opt(True, "random crop (zero padding of image_size/8 pixels: 4 at 32) + horizontal flip "
                        "on training images", "data")
    hflip: bool = opt(True, "mirror half the training images (with --augment); false for digits, text and "
                      "other data that is not mirror-invariant", "data")
    train_crop: str = opt("auto", "'random_resized': timm's RandomResizedCrop from the whole image (--scale, --ratio); "
                          "'pad': random crop with zero padding of image_size/8 (CIFAR's); auto: random_resized for "
                          "imagefolder, pad for cifar10 and random (README: Recipes)", "data",
                          choices=("auto", "random_resized", "pad"))
    scale: str = opt("0.08,1", "RandomResizedCrop: range of the crop's area, a fraction of the image's", "data")
    ratio: str = opt("3/4,4/3", "RandomResizedCrop: range of the crop's aspect ratio (log-uniform)", "data")
    train_interpolation: str = opt("bilinear", "RandomResizedCrop's resampling: bilinear (roi_align, batched, "
                                   "area-averaged) or bicubic (per crop, antialiased)", "data",
                                   choices=("bilinear", "bicubic"))
    crop_pct: float | None = opt(None, "image folders' evaluation: shorter side resized to image_size / crop_pct, "
                                 "centre crop; default: the weights' pretrained_cfg crop_pct, else timm's 0.875",
                                 "data")
    color_jitter: float = opt(0.0, "timm's colour jitter (brightness, contrast, saturation) per sample; 0: off. "
                              "Per-sample transforms run in DataLoader workers (--pipeline cpu or cache)", "data")
    aa: str | None = opt(None, "timm's auto-augment string: rand-m9-mstd0.5 (RandAugment), v0/original "
                         "(AutoAugment), augmix-...; trivial: torchvision's TrivialAugmentWide", "data")
    reprob: float = opt(0.0, "timm's random erasing probability (per-pixel noise)", "data")
    mean: str | None = opt(None, "per-channel mean 'R,G,B' in [0, 1] for normalisation; default: with --init_from "
                           "the weights' own (their model_config.json, or timm's pretrained_cfg), else CIFAR-10's "
                           "for cifar10/random, computed from the training images for imagefolder", "data")
    std: str | None = opt(None, "per-channel std 'R,G,B' (see --mean)", "data")
    num_workers: int | None = opt(None, "DataLoader worker processes per process (the cpu pipeline); default: the "
                                  "cores of the process's CPU affinity (its cgroup's CPU quota if fewer) / the "
                                  "processes on this machine, at most "
                                  f"{MAX_WORKERS}", "data")

    # model
    model: str = opt("resnet18", "any timm model name, or your own module.path:callable (called with num_classes "
                     "and --model_kwargs, it returns an nn.Module; README: Your own model)", "model")
    trust_model_code: bool = opt(False, "import the model code a model_config.json names (--init_from)", "model")
    stem: str = opt("auto", "'cifar': 3x3/stride-1 first conv and no maxpool, for 32x32 inputs; "
                    f"'imagenet': timm's model unchanged; 'auto': cifar up to --image_size {CIFAR_STEM_MAX}, "
                    "imagenet above", "model", choices=("auto", "cifar", "imagenet"))
    model_kwargs: str | None = opt(None, "extra arguments to timm.create_model (or your callable) as JSON, e.g. "
                                   "'{\"drop_rate\": 0.1}' or '{\"norm_layer\": \"groupnorm\"}'", "model")
    channels_last: bool | None = opt(None, "channels_last memory format for model and inputs; default: on for CPU "
                                     "and CUDA (measured faster), off on NPUs (not measured there)", "model")
    init_from: str | None = opt(None, "start from the weights of a model.safetensors on disk (an earlier export "
                                "or timm weights); a classifier with another class count is re-created", "model")
    compile: bool = opt(False, "torch.compile the model", "model")
    compile_mode: str = opt("default", "torch.compile mode", "model",
                            choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"))

    # optimisation
    epochs: int = opt(30, "training epochs (the schedule's length)", "optimisation")
    max_steps: int | None = opt(None, "stop after N optimizer steps (smoke runs); the schedule stays the "
                                "full run's", "optimisation")
    batch_size: int | None = opt(None, f"batch size per process; default {BATCH_SIZE}, less for a small data set: the "
                                 f"largest power of two that gives an epoch {MIN_STEPS} steps", "optimisation")
    lr: float | None = opt(None, "peak learning rate; default: --lr_base x global batch / 256", "optimisation")
    lr_base: float = opt(0.2, "learning rate per 256 images of global batch (0.1 at batch 128)",
                         "optimisation")
    min_lr: float = opt(0.0, "learning rate at the end of the cosine decay", "optimisation")
    momentum: float = opt(0.9, "SGD (nesterov) momentum", "optimisation")
    weight_decay: float = opt(5e-4, "weight decay (not applied to norm and bias parameters)", "optimisation")
    label_smoothing: float = opt(0.1, "label smoothing of the training loss", "optimisation")
    warmup_epochs: float = opt(1.0, "linear warmup length in epochs, then cosine decay", "optimisation")
    grad_accum: int = opt(1, "gradient accumulation steps per optimizer step", "optimisation")
    clip_grad: float | None = opt(None, "clip the gradient norm to this value", "optimisation")
    seed: int = opt(42, "random seed (weights, data order, augmentation, random data)", "optimisation")
    ema: bool = opt(False, "keep an exponential moving average of the weights (timm ModelEmaV3), "
                    "evaluated alongside", "optimisation")
    ema_decay: float = opt(0.999, "EMA decay per optimizer step", "optimisation")
    tta: bool = opt(False, "evaluate with horizontal-flip test-time augmentation", "optimisation")

    # checkpointing
    output_dir: str = opt("output_dir", "where model, metrics and checkpoints go", "checkpointing",
                          aliases=("--train_url",))
    checkpoint_every: int = opt(0, "also checkpoint every N optimizer steps (0: only at epoch ends)",
                                "checkpointing")
    checkpoint_minutes: float | None = opt(None, "also checkpoint after this many minutes of training since the last "
                                           "checkpoint (default: 100x the measured write, so writes cost at most a "
                                           "hundredth of the time, at least 1 min, 10 min to the first; 0: never by "
                                           "time)", "checkpointing")
    keep_checkpoints: int = opt(2, "keep the newest K complete checkpoints", "checkpointing")
    resume: str | None = opt(None, "'auto' (newest complete checkpoint in output_dir, else a fresh start) "
                             "or a checkpoint directory", "checkpointing")
    overwrite: bool = opt(False, "let a fresh run delete another run's checkpoints in --output_dir: set aside at "
                          "start, deleted once it has saved one of its own (without it, such a start is refused)",
                          "checkpointing")
    timeout_s: int = opt(300, "collective timeout in seconds: a lost peer fails the job after this long",
                         "checkpointing")

    # logging
    log_with: str | None = opt(None, "an Accelerate tracker name (tensorboard, wandb, ...), or several "
                               "separated by commas", "logging")
    log_every: int = opt(50, "every N optimizer steps: the loss averaged over ranks and the lr to "
                         "steps.jsonl and the trackers", "logging")
    log_all_ranks: bool = opt(False, "let every rank print, not only the main process", "logging")
    plot: bool = opt(True, "write training_curves.png at the end (needs matplotlib)", "logging")

    # performance
    ddp_bucket_cap_mb: int = opt(25, "DDP gradient bucket size in MiB", "performance")
    ddp_grad_as_bucket_view: bool = opt(True, "DDP gradient_as_bucket_view", "performance")
    mixed_precision: str = opt("auto", "'auto': the launcher's config (accelerate launch, launch.sh), and without a "
                               "launcher the fastest precision the device has natively (bf16 on Ampere+ GPUs, "
                               "Ascend A2/A3 and CPUs with avx512_bf16/AMX/aarch64 bf16; fp16 on older GPUs and "
                               "910A; fp32 on other CPUs); no|fp16|bf16: that one (overrides the launcher's); "
                               "one the device lacks is refused", "performance",
                               choices=("auto", "no", "fp16", "bf16"))
    force_precision: bool = opt(False, "use the asked precision even where the device lacks it (emulated, slow)",
                                "performance")

    # platform: flags the ModelArts seed passes; device and ranks come from the launch config
    custom_data: bool | None = opt(None, "ModelArts seed flag: true = --data random, false = --data cifar10",
                                   "platform")
    enable_gpu: bool | None = opt(None, "ModelArts seed flag; accepted, the device comes from the "
                                  "accelerate config", "platform")
    init_method: str | None = opt(None, "ModelArts rank-0 address tcp://HOST:PORT; launch.sh consumes it",
                                  "platform")
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
        positive = ("epochs", "grad_accum", "keep_checkpoints", "log_every", "timeout_s", "ddp_bucket_cap_mb")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_minutes is not None and not self.checkpoint_minutes >= 0:
            raise ConfigError(f"--checkpoint_minutes must be >= 0, got {self.checkpoint_minutes}")
        for name in ("batch_size", "max_steps", "train_samples", "test_samples"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name} must be >= 1, got {value}")
        for name in ("checkpoint_every", "num_workers", "warmup_epochs", "weight_decay", "min_lr"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.lr is not None and not self.lr > 0:
            raise ConfigError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"--label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0 < self.ema_decay < 1:
            raise ConfigError(f"--ema_decay must be in (0, 1), got {self.ema_decay}")
        self.model_kwargs_dict()
        if self.image_size is not None and not 8 <= self.image_size <= 4096:
            raise ConfigError(f"--image_size must be in 8..4096, got {self.image_size}")
        if self.data == "cifar10" and self.image_size not in (None, 32):
            raise ConfigError(f"CIFAR-10 images are 32x32: drop --image_size {self.image_size} or use "
                              "--data imagefolder")
        if self.device_data_mb is not None and self.device_data_mb < 0:
            raise ConfigError(f"--device_data_mb must be >= 0, got {self.device_data_mb}")
        self.normalisation()
        recipes.check(self)
        if self.clip_grad is not None and not self.clip_grad > 0:
            raise ConfigError(f"--clip_grad must be > 0, got {self.clip_grad}")
        if self.num_workers and self.pipeline == "device":
            raise ConfigError(f"--num_workers {self.num_workers} needs --pipeline cpu (the device pipeline has "
                              "no DataLoader workers); add --pipeline cpu or drop --num_workers")
        if self.pipeline == "cache" and self.data != "imagefolder":
            raise ConfigError(f"--pipeline cache decodes an image folder once; {self.data} needs no decoding: use "
                              "--pipeline cpu or auto")

    def model_kwargs_dict(self) -> dict:
        if not self.model_kwargs:
            return {}
        try:
            value = json.loads(self.model_kwargs)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--model_kwargs is not valid JSON ({e.msg}); "
                              "write it like '{\"drop_rate\": 0.1}'") from None
        if not isinstance(value, dict):
            raise ConfigError("--model_kwargs must be a JSON object, like '{\"drop_rate\": 0.1}'")
        return value

    def resolution(self, native: int | None = None) -> int:
        """--image_size, or the default for the data: 32 for cifar10/random; for an image folder its images' own
        size `native` (the median shorter side), rounded down to a multiple of 8, within 8..MAX_AUTO_SIZE."""
        if self.image_size:
            return self.image_size
        if self.data != "imagefolder":
            return 32
        return max(8, min(MAX_AUTO_SIZE, (native or MAX_AUTO_SIZE) // 8 * 8))

    def stem_for(self, image_size: int, cifar_fits: bool = True) -> str:
        """'auto': the cifar stem for small images on a model it fits (a ResNet's conv1 + maxpool), else timm's."""
        if self.stem != "auto":
            return self.stem
        return "cifar" if image_size <= CIFAR_STEM_MAX and cifar_fits else "imagenet"

    def resolve(self, info, pipeline: str, cifar_fits: bool = True, train_size: int | None = None,
                num_processes: int = 1) -> str:
        """The one place where automatic values become the run's: 'auto'/None replaced by what the data (its
        DataInfo: image size, mean/std; its size: the batch) and the machine (the pipeline chosen) gave, so the log,
        config.yaml, model_config.json and the checkpoints all say the values the run used. Returns the log line."""
        auto = [name for name in ("image_size", "stem", "mean", "std", "pipeline", "train_crop") if getattr(self, name)
                in AUTO] + (["crop_pct"] if self.crop_pct is None and self.data == "imagefolder" else [])
        why = {"stem": auto_stem_said(self.model)} if self.stem == "auto" and not cifar_fits \
            and info.image_size <= CIFAR_STEM_MAX else {}
        self.image_size = info.image_size
        self.stem = self.stem_for(info.image_size, cifar_fits)
        self.mean, self.std = (",".join(repr(float(v)) for v in values) for values in (info.mean, info.std))
        self.pipeline = pipeline
        self.train_crop = recipes.train_crop(self)
        self.crop_pct = info.crop_pct if self.data == "imagefolder" else None
        if pipeline == "device":  # workers had nothing to do; config.yaml must load again (see validate)
            self.num_workers = 0
        said = [why.get(name, f"--{name} {getattr(self, name)}") for name in auto]
        said.append(resolve_batch(self, train_size, num_processes))  # (None: given, or no data size to follow)
        return "resolved defaults: " + (", ".join(filter(None, said)) or "none (all given)")

    def normalisation(self) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
        """(mean, std) from --mean/--std, each three floats or None."""
        out = []
        for name in ("mean", "std"):
            text = getattr(self, name)
            if text is None:
                out.append(None)
                continue
            try:  # 'R,G,B' from a flag, or a list in a --config YAML
                values = tuple(float(v) for v in (text if isinstance(text, (list, tuple)) else str(text).split(",")))
            except (TypeError, ValueError):
                values = ()
            low = 0 if name == "mean" else 1e-6
            if len(values) != 3 or not all(low <= v <= 1 for v in values):
                raise ConfigError(f"--{name} must be three numbers in [{low:g}, 1] like 0.5,0.5,0.5; got {text!r}")
            out.append(values)
        return out[0], out[1]

    def peak_lr(self, num_processes: int) -> float:
        if self.lr is not None:
            return self.lr
        return self.lr_base * self.batch_size * num_processes * self.grad_accum / 256

    def trackers(self) -> list[str]:
        return [t.strip() for t in self.log_with.split(",")] if self.log_with else []

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def save_yaml(self, path, **recorded) -> None:
        """`recorded`: values in place of the run's. Never trust_model_code: a file does not grant it (cli.py)."""
        with open(path, "w") as f:
            f.write("# accel_train resolved configuration: `accel-train --config config.yaml` reproduces it\n")
            values = {k: v for k, v in {**self.to_dict(), **recorded}.items() if k != "trust_model_code"}
            yaml.safe_dump(values, f, sort_keys=False)


def fields():
    return dataclasses.fields(TrainConfig)
