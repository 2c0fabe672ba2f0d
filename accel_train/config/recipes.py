"""The training recipe's flags (docs/training.md: Recipes): which crop each kind of data gets,
RandomResizedCrop's ranges, the evaluation crop, timm's per-sample augmentations; their checks and
automatic values. The math is data/crops.py and data/train_augment.py.

An image folder (photos) trains with RandomResizedCrop from the whole image (timm's train.py,
torchvision's reference scripts, FFCV, DALI) and is evaluated at --crop_pct; CIFAR-10 and random
data keep the pad crop of 32-px CIFAR (He et al. 2016): a RandomResizedCrop of down to 8% of a 32-px
image is a few pixels wide.
"""

from __future__ import annotations

from fractions import Fraction

from ..errors import ConfigError

# run math
RECIPE_FLAGS = (
    "train_crop",
    "scale",
    "ratio",
    "train_interpolation",
    "color_jitter",
    "aa",
    "reprob",
)
# timm's PIL transforms: DataLoader workers only (cpu, cache)
PER_SAMPLE = ("color_jitter", "aa", "reprob")
# --aa trivial: torchvision's TrivialAugmentWide (timm parses no TrivialAugment string)
TRIVIAL = "trivial"
CROP_PCT = 0.875  # timm's default evaluation crop (timm.data.constants.DEFAULT_CROP_PCT)


def parse_pair(name: str, text, low: float, high: float | None = None) -> tuple[float, float]:
    """'A,B' (or 'A B', fractions like 3/4 allowed; a list from a --config YAML) -> (A, B),
    low < A <= B (<= high)."""
    try:
        parts = text if isinstance(text, (list, tuple)) else str(text).replace(",", " ").split()
        a, b = (float(Fraction(str(v))) for v in parts)
    except (TypeError, ValueError, ZeroDivisionError):
        a = b = None
    if a is None or not (low < a <= b) or (high is not None and b > high):
        top = f", B <= {high:g}" if high is not None else ""
        raise ConfigError(
            f"--{name} must be two numbers A,B with {low:g} < A <= B{top}, like "
            f"{'0.08,1' if name == 'scale' else '3/4,4/3'}; got {text!r}"
        )
    return a, b


def train_crop(data: str, asked: str) -> str:
    """'random_resized' or 'pad': --train_crop (`asked`), 'auto' by the --data kind (the module's
    text)."""
    if asked != "auto":
        return asked
    return "random_resized" if data == "imagefolder" else "pad"


def default_crop_pct(cfg) -> float:
    """--crop_pct, else the pretrained weights' own (timm's pretrained_cfg crop_pct, where the run
    starts from timm's pretrained weights; the model_config.json beside --init_from weights trained
    on an image folder), else timm's 0.875."""
    if cfg.crop_pct is not None:
        return cfg.crop_pct
    if getattr(cfg, "init_from", None):
        from ..model.create import init_facts

        facts = init_facts(cfg.init_from)
        if facts.get("data") == "imagefolder" and isinstance(facts.get("crop_pct"), (int, float)):
            return float(facts["crop_pct"])
    if getattr(cfg, "pretrained", False) and ":" not in cfg.model:
        try:
            from timm.models import get_pretrained_cfg

            found = get_pretrained_cfg(cfg.model)
            if found is not None and found.crop_pct:
                return float(found.crop_pct)
        except (RuntimeError, ValueError, KeyError):
            pass
    return CROP_PCT


def per_sample(cfg) -> list[str]:
    """The per-sample transforms asked for, as flags ('--aa rand-m9-mstd0.5', ...)."""
    return [f"--{k} {getattr(cfg, k)}" for k in PER_SAMPLE if getattr(cfg, k)]


def check(cfg) -> None:
    """One line naming the fix for a recipe flag that cannot be: ranges, timm's --aa string, a
    pipeline that cannot apply the transforms asked for, --crop_pct on data that is not resized for
    evaluation."""
    parse_pair("scale", cfg.scale, 0, 1)
    parse_pair("ratio", cfg.ratio, 0)
    if cfg.crop_pct is not None and not 0 < cfg.crop_pct <= 1:
        raise ConfigError(f"--crop_pct must be in (0, 1], got {cfg.crop_pct}")
    if cfg.crop_pct is not None and cfg.data != "imagefolder":
        raise ConfigError(
            f"--crop_pct resizes image folders for evaluation; {cfg.data} is "
            "evaluated as it is: drop --crop_pct"
        )
    if not cfg.color_jitter >= 0:
        raise ConfigError(f"--color_jitter must be >= 0, got {cfg.color_jitter}")
    if not 0 <= cfg.reprob <= 1:
        raise ConfigError(f"--reprob must be in [0, 1], got {cfg.reprob}")
    if cfg.aa and cfg.aa != TRIVIAL:
        try:
            from timm.data.transforms_factory import transforms_imagenet_train

            transforms_imagenet_train(32, auto_augment=cfg.aa)
        # timm asserts, or fails in its parsing (KeyError, ValueError, IndexError, ...)
        except Exception as e:
            raise ConfigError(
                f"--aa {cfg.aa!r} is not an augmentation string timm parses "
                f"({type(e).__name__}{': ' + str(e) if str(e) else ''}); e.g. "
                "rand-m9-mstd0.5-inc1 (RandAugment), v0 or original (AutoAugment), "
                "augmix-m5-w4-d2, trivial (torchvision's "
                "TrivialAugmentWide)"
            ) from None
    asked = per_sample(cfg)
    if asked and cfg.pipeline == "device":
        raise ConfigError(
            f"--pipeline device cannot apply {', '.join(asked)} (timm's per-sample "
            "transforms on PIL images, which DataLoader workers run): use --pipeline "
            "cpu (or cache for an image folder), or auto, which picks one"
        )
