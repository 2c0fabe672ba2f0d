"""Model: timm.create_model + the 32x32 ("cifar") stem."""

from __future__ import annotations

import timm
import torch.nn as nn

from .config import NUM_CLASSES, ConfigError


def apply_cifar_stem(model: nn.Module) -> nn.Module:
    """Replace the 7x7/stride-2 stem conv and the maxpool with one 3x3/stride-1 conv.

    At 32x32 the ImageNet stem shrinks the image 4x before the first block; this is the change
    every CIFAR ResNet recipe makes. timm equivalent: `model.conv1 = nn.Conv2d(3, 64, 3, 1, 1,
    bias=False); model.maxpool = nn.Identity()`.
    """
    conv1, maxpool = getattr(model, "conv1", None), getattr(model, "maxpool", None)
    if not isinstance(conv1, nn.Conv2d) or maxpool is None:
        raise ConfigError(f"--stem cifar needs a ResNet-style model with a conv1/maxpool stem; "
                          f"{type(model).__name__} has none: use --stem imagenet")
    model.conv1 = nn.Conv2d(conv1.in_channels, conv1.out_channels, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def create_model(name: str, stem: str = "cifar", num_classes: int = NUM_CLASSES, **kwargs) -> nn.Module:
    if not timm.is_model(name):
        raise ConfigError(f"unknown timm model {name!r}; pick one from timm.list_models(), e.g. resnet18")
    try:
        model = timm.create_model(name, num_classes=num_classes, **kwargs)
    except (TypeError, ValueError, KeyError, AssertionError) as e:
        raise ConfigError(f"timm could not build {name!r} with {kwargs} ({e}); check --model_kwargs") from None
    return apply_cifar_stem(model) if stem == "cifar" else model
