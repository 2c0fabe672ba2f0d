"""A model in a local file, trained with --model (train_my_model.sh):

    accel-train --model my_model:build --model_kwargs '{"width": 32}' ...

accel_train calls build(num_classes=<the data's>, **model_kwargs) on every rank and trains what it
returns: an nn.Module from images (N, 3, H, W) to logits (N, num_classes)."""

import torch.nn as nn


def block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.GroupNorm(1, c_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


def build(num_classes: int, width: int = 16) -> nn.Module:
    return nn.Sequential(
        block(3, width),
        block(width, 2 * width),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * width, num_classes),
    )
