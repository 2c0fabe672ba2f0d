"""--pretrained / --pretrained_path: timm's pretrained weights, loaded by
timm.create_model(pretrained=True) itself, so timm adapts them as it does for its own users: a
classifier of another class count is dropped and re-created, a ViT's position embeddings are
resampled to --image_size, its patch embedding to another patch size.

Where they come from: --pretrained_path FILE (timm's pretrained_cfg_overlay=dict(file=FILE)), else
the model's pretrained_cfg source: the Hugging Face hub cache (hf_hub_id) or torch.hub's (url).
Under HF_HUB_OFFLINE=1 nothing is downloaded: weights that are not on disk are one line naming where
to put them, before anything is built. (--init_from is the other way in: a model.safetensors of the
model as built here, copied tensor by tensor.)
"""

from __future__ import annotations

from pathlib import Path

import timm

from ..errors import ConfigError

# timm's hub names
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin")


def wanted(pretrained: bool, pretrained_path: str | None) -> bool:
    """--pretrained, or --pretrained_path (timm's weights from a file)."""
    return bool(pretrained or pretrained_path)


def create_kwargs(pretrained: bool, pretrained_path: str | None) -> dict:
    """What timm.create_model needs to load the weights (--pretrained, --pretrained_path)."""
    if not wanted(pretrained, pretrained_path):
        return {}
    return dict(
        pretrained=True,
        **({"pretrained_cfg_overlay": {"file": str(pretrained_path)}} if pretrained_path else {}),
    )


def source_cfg(name: str):
    """timm's pretrained_cfg of `name` (a tag picks the weights: resnet18.a1_in1k), or a
    ConfigError."""
    if ":" in name:
        raise ConfigError(
            f"--pretrained loads timm's weights for a timm model; {name} is your "
            "own: use --init_from FILE.safetensors"
        )
    cfg = timm.models.get_pretrained_cfg(name) if timm.is_model(name) else None
    if cfg is None:
        raise ConfigError(
            f"--pretrained: timm knows no pretrained weights for {name!r}; name a "
            f"tag timm lists (timm.list_pretrained('{name.split('.')[0]}*')) or pass "
            "--pretrained_path FILE"
        )
    return cfg


def check_on_disk(model: str, pretrained_path: str | None, init_from: str | None) -> str:
    """Where --model's timm weights will be read from (the line to log); a ConfigError when they are
    not on disk and may not be downloaded (HF_HUB_OFFLINE=1), --pretrained_path names no file, or
    --init_from names other starting weights."""
    if init_from:
        raise ConfigError(
            "--pretrained and --init_from both name the starting weights: pass one of them"
        )
    source = source_cfg(model)
    if pretrained_path:
        if not Path(pretrained_path).is_file():
            raise ConfigError(
                f"--pretrained_path {pretrained_path}: no such file; pass timm's "
                f"weights for {model} (model.safetensors or a .pth state dict)"
            )
        return f"--pretrained: {model} weights from {pretrained_path}"
    from huggingface_hub import constants, try_to_load_from_cache

    if source.hf_hub_id:
        repo, _, revision = source.hf_hub_id.partition("@")
        names = (source.hf_hub_filename,) if source.hf_hub_filename else WEIGHT_FILES
        for file in names:
            found = try_to_load_from_cache(repo, file, revision=revision or None)
            if isinstance(found, str):
                return f"--pretrained: {model} weights from the Hugging Face cache ({found})"
        where = (
            "the Hugging Face cache, "
            f"{constants.HF_HUB_CACHE}/models--{repo.replace('/', '--')} (`hf download "
            f"{repo}` where there is internet, then copy that folder here)"
        )
    elif source.url:
        import torch.hub

        cached = Path(torch.hub.get_dir()) / "checkpoints" / source.url.rsplit("/", 1)[-1]
        if cached.is_file():
            return f"--pretrained: {model} weights from torch.hub's cache ({cached})"
        where = f"torch.hub's cache, {cached} (from {source.url})"
    else:
        raise ConfigError(
            f"--pretrained: timm has no source for {model}'s weights; pass --pretrained_path FILE"
        )
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(
            f"--pretrained: {model}'s weights are not on disk and "
            f"HF_HUB_OFFLINE=1 downloads nothing; put them in {where}, or pass "
            "--pretrained_path FILE"
        )
    return f"--pretrained: {model} weights not on disk: timm downloads them to {where}"


def normalisation(name: str) -> tuple[tuple, tuple, float | None]:
    """(mean, std, crop_pct) of the weights' config (timm's pretrained_cfg)."""
    source = source_cfg(name)
    return tuple(source.mean), tuple(source.std), source.crop_pct
