"""Model: timm.create_model + the 32x32 ("cifar") stem, --init_from (weights from a local file), and
the user's module inside what prepare() wrapped it in."""

from __future__ import annotations

import difflib
from pathlib import Path

import timm
import torch
import torch.nn as nn

from ..errors import ConfigError
from ..files import MODEL_CONFIG_FILE, MODEL_FILE
from .own_model import build, import_callable, is_import_path


def apply_cifar_stem(model: nn.Module) -> nn.Module:
    """Replace the 7x7/stride-2 stem conv and the maxpool with one 3x3/stride-1 conv.

    At 32x32 the ImageNet stem shrinks the image 4x before the first block; this is the change
    every CIFAR ResNet recipe makes. timm equivalent: `model.conv1 = nn.Conv2d(3, 64, 3, 1, 1,
    bias=False); model.maxpool = nn.Identity()`.
    """
    conv1, maxpool = getattr(model, "conv1", None), getattr(model, "maxpool", None)
    if not isinstance(conv1, nn.Conv2d) or maxpool is None:
        raise ConfigError(
            "--stem cifar needs a ResNet-style model with a conv1/maxpool stem; "
            f"{type(model).__name__} has none: use --stem imagenet"
        )
    model.conv1 = nn.Conv2d(
        conv1.in_channels, conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False
    )
    model.maxpool = nn.Identity()
    return model


def create_model(
    name: str,
    stem: str = "cifar",
    num_classes: int = 10,
    image_size: int | None = None,
    factory=None,
    **kwargs,
) -> nn.Module:
    """`num_classes`: the data set's (DataInfo.num_classes); 10 is CIFAR-10's. `image_size`: the
    run's; a model built for one size (a ViT's patch grid and position embeddings) is built for this
    one through timm's `img_size`. `name`: a timm name, or an import path module.path:callable
    (user.py), or (`factory`) a module or factory given to train() under that name."""
    if is_import_path(name) or factory is not None:
        model = build(
            factory if factory is not None else import_callable(name), num_classes, kwargs, name
        )
        return apply_cifar_stem(model) if stem == "cifar" else model
    if not timm.is_model(name):
        near = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        raise ConfigError(
            f"unknown timm model {name!r}; "
            + (f"did you mean {', '.join(near)}? " if near else "")
            + "timm.list_models() lists them all, e.g. resnet18"
        )
    fixed = fixed_input_size(name)
    resized = bool(image_size and fixed and fixed != image_size and "img_size" not in kwargs)
    size = {"img_size": image_size} if resized else {}
    try:
        model = timm.create_model(name, num_classes=num_classes, **kwargs, **size)
    except (RuntimeError, OSError) as e:
        if not kwargs.get("pretrained"):
            raise
        raise ConfigError(
            f"--pretrained: timm could not load {name}'s weights ({' '.join(str(e).split())[:200]})"
        ) from None
    except (TypeError, ValueError, KeyError, AssertionError) as e:
        if resized:
            why = (
                "takes no img_size"
                if isinstance(e, TypeError) and "img_size" in str(e)
                else f"timm could not build it for {image_size} px ({e})"
            )
            raise ConfigError(
                f"{name} is built for {fixed} px and {why}; train it with "
                f"--image_size {fixed}, or pick a model without a fixed input size "
                "(e.g. resnet18)"
            ) from None
        raise ConfigError(
            f"timm could not build {name!r} with {kwargs} ({e}); check --model_kwargs"
        ) from None
    return apply_cifar_stem(model) if stem == "cifar" else model


def fixed_input_size(name: str) -> int | None:
    """The size a timm model is built for when it takes no other without being told (timm's
    pretrained_cfg `fixed_input_size`: ViTs, Swin, ... whose patch grid is fixed at creation), else
    None."""
    cfg = timm.models.get_pretrained_cfg(name) if timm.is_model(name) else None
    return (
        cfg.input_size[-1] if cfg is not None and cfg.fixed_input_size and cfg.input_size else None
    )


def _names(keys: list[str], limit: int = 4) -> str:
    return ", ".join(keys[:limit]) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_init_weights(model: nn.Module, path) -> str:
    """--init_from: copy the tensors of a safetensors file into `model` (before prepare, on every
    rank).

    A classifier whose class count differs from the model's is re-created with timm's
    `reset_classifier`; tensors the file lacks keep their initialisation. Any other mismatch (a
    shape, a tensor the model does not have) is a ConfigError. Returns one line saying what was
    loaded, re-initialised and missing."""
    path = weights_file(path)
    weights = read_weights(path)
    own = model.state_dict()
    head = getattr(model, "pretrained_cfg", {}).get("classifier") or "fc"
    head_keys = [k for k in own if k.startswith(head + ".")]
    unexpected = [k for k in weights if k not in own]
    wrong = [
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in weights and k not in head_keys and weights[k].shape != own[k].shape
    ]
    if unexpected or wrong or not set(weights) & set(own):
        detail = (
            f"shape mismatch {_names(wrong)}"
            if wrong
            else f"tensors the model lacks: {_names(unexpected)}"
        )
        raise ConfigError(
            f"--init_from {path} does not fit this model ({detail}); check --model, "
            "--stem and --model_kwargs against the run that wrote it"
        )
    reset = [k for k in head_keys if k in weights and weights[k].shape != own[k].shape]
    if reset and not hasattr(model, "reset_classifier"):
        raise ConfigError(
            f"--init_from {path}: its classifier {_names(reset)} has another class "
            f"count, and {type(model).__name__} has no reset_classifier() to make a "
            "new one; train on the same classes"
        )
    if reset:
        model.reset_classifier(model.num_classes)  # a fresh head of the data set's class count
        own = model.state_dict()
    loaded = {k: v for k, v in weights.items() if k not in reset}
    missing = [k for k in own if k not in weights]
    model.load_state_dict({**own, **loaded})
    line = f"--init_from {path}: loaded {len(loaded)} tensors"
    if reset:
        line += (
            f"; re-initialised {_names(reset)} ({weights[reset[0]].shape[0]} classes in the "
            f"file, {model.num_classes} here)"
        )
    return line + (f"; missing (kept at init) {_names(missing)}" if missing else "; none missing")


TORCH_SUFFIXES = (".pth", ".pt", ".bin", ".ckpt")


def read_weights(path: Path) -> dict:
    """The tensors of --init_from's file: safetensors, or a PyTorch state dict (.pth/.pt/.bin, read
    with weights_only=True: no code runs; timm's and torchvision's checkpoints, a dict under
    "state_dict", "model" or "state_dict_ema" as timm's load_checkpoint takes it), without a
    prepared model's prefixes."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ConfigError(
            f"--init_from {path}: no such file; pass a model.safetensors (an earlier "
            "run's export or timm weights on disk), a .pth state dict, or a folder "
            "holding a model.safetensors"
        )
    if path.suffix in TORCH_SUFFIXES:
        try:
            weights = torch.load(path, map_location="cpu", weights_only=True)
        # pickle, zipfile and torch raise their own kinds; a pickled object is refused
        except Exception as e:
            raise ConfigError(
                f"--init_from {path} does not load as a state dict of tensors with "
                f"weights_only=True ({' '.join(str(e).split())[:160]}); save "
                "model.state_dict() with torch.save"
            ) from None
        for key in ("state_dict", "model", "state_dict_ema"):
            weights = (
                weights[key]
                if isinstance(weights, dict) and isinstance(weights.get(key), dict)
                else weights
            )
        tensors = (
            {k: v for k, v in weights.items() if isinstance(v, torch.Tensor)}
            if isinstance(weights, dict)
            else {}
        )
        if not tensors:
            raise ConfigError(
                f"--init_from {path} holds no tensors by name; save "
                "model.state_dict() with torch.save"
            )
        return plain_state_dict(tensors)
    try:
        return plain_state_dict(load_file(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ConfigError(
            f"--init_from {path} is not a safetensors file "
            f"({str(e).splitlines()[0][:120]}); pass a {MODEL_FILE} or a .pth state "
            "dict"
        ) from None


def weights_file(path) -> Path:
    """--init_from: a safetensors file, or a folder holding model.safetensors (an output dir, a
    checkpoint)."""
    path = Path(path)
    return path / MODEL_FILE if path.is_dir() else path


def plain_state_dict(weights: dict) -> dict:
    """A state dict without the prefixes a prepared model adds (`module.` of DDP, `_orig_mod.` of
    torch.compile): Accelerate's save_state writes checkpoints' model.safetensors from the prepared
    model."""
    out = {}
    for key, value in weights.items():
        while key.startswith(("module.", "_orig_mod.")):
            key = key.split(".", 1)[1]
        out[key.replace("._orig_mod.", ".")] = value
    return out


def cifar_stem_fits(model_name: str) -> bool:
    """Whether --stem cifar applies to a timm model: a ResNet-style single conv1 (timm's
    pretrained_cfg first_conv; the maxpool comes with it). resnet*d / resnet10t have a deep stem
    (conv1.0): they keep timm's."""
    cfg = timm.models.get_pretrained_cfg(model_name) if timm.is_model(model_name) else None
    return bool(cfg) and cfg.first_conv == "conv1"


def init_stem(path) -> str | None:
    """The stem the --init_from weights were trained with: the model_config.json beside them, else
    the shape of their ResNet stem conv1 (7x7: timm's ImageNet stem; 3x3: the cifar stem); None if
    neither says."""
    if stem := init_facts(path).get("stem"):
        return stem
    try:
        kernel = tuple(read_weights(weights_file(path))["conv1.weight"].shape[-2:])
    except (ConfigError, KeyError):
        return None
    return {(7, 7): "imagenet", (3, 3): "cifar"}.get(kernel)


def init_facts(path) -> dict:
    """The model_config.json beside the --init_from weights ({} if none or unreadable)."""
    import json

    beside = weights_file(path).parent / MODEL_CONFIG_FILE
    try:
        facts = json.loads(beside.read_text()) if beside.is_file() else {}
        return facts if isinstance(facts, dict) else {}
    except (OSError, ValueError):
        return {}


def init_model_code(cfg) -> tuple[dict, str | None]:
    """--init_from weights of a model built by code (an import path in their model_config.json) and
    --model names no code of its own: that model and its kwargs when --trust_model_code allows the
    import ({model, model_kwargs}, the line to log); else one line naming the path and how to allow
    it. ({}, None): the weights name no code, or --model does."""
    import json

    from .own_model import allow_import

    arch = init_facts(cfg.init_from).get("architecture")
    if not is_import_path(arch) or is_import_path(cfg.model):
        return {}, None
    allow_import(arch, cfg.trust_model_code, None, f"--init_from {cfg.init_from}")
    kwargs = cfg.model_kwargs or json.dumps(init_facts(cfg.init_from).get("model_kwargs") or {})
    return {"model": arch, "model_kwargs": kwargs}, (
        f"--init_from: --model {arch} --model_kwargs '{kwargs}', as the weights were "
        "trained (--trust_model_code)"
    )


def init_normalisation(path, model_name: str) -> tuple[tuple | None, tuple | None, str]:
    """The mean/std the --init_from weights were trained with (timm's convention: a pretrained model
    keeps its own normalisation): the model_config.json beside the file (an accel_train export or
    checkpoint), else the file's safetensors metadata (accel_train exports carry it), else timm's
    pretrained_cfg of `model_name` (timm weights). (None, None, why) when none says."""
    import json

    from safetensors import safe_open

    path = weights_file(path)
    beside = path.parent / MODEL_CONFIG_FILE
    try:
        meta = json.loads(beside.read_text()) if beside.is_file() else {}
        if meta.get("mean") and meta.get("std"):
            return tuple(meta["mean"]), tuple(meta["std"]), str(beside)
        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        if json.loads(header.get("mean", "null")) and json.loads(header.get("std", "null")):
            return (
                tuple(json.loads(header["mean"])),
                tuple(json.loads(header["std"])),
                f"{path}'s metadata",
            )
    except Exception:  # not readable here: load_init_weights names the problem
        return None, None, "unreadable"
    cfg = timm.models.get_pretrained_cfg(model_name)
    if cfg is not None and cfg.mean and cfg.std:
        return tuple(cfg.mean), tuple(cfg.std), f"timm's pretrained_cfg of {model_name}"
    return None, None, "no normalisation known for these weights"


def bare_model(accelerator, model) -> torch.nn.Module:
    """The user's module: without torch.compile's wrapper (outermost: compiled last) and without
    DDP's.

    The compiled wrapper is taken off first: `unwrap_model` given a compiled model re-points its
    `_orig_mod` at the unwrapped module (keep_torch_compile=True, the default), which would silently
    take DDP out of the training model."""
    return accelerator.unwrap_model(getattr(model, "_orig_mod", model))


def wrappers(model) -> str:
    """The wrapping order prepare() produced, e.g. "OptimizedModule(DDP wrapper(ResNet))"."""
    inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
    return (
        f"{type(model).__name__}({wrappers(inner)})"
        if isinstance(inner, torch.nn.Module)
        else type(model).__name__
    )
