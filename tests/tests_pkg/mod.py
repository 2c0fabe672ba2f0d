"""A small model of the user's own (not timm), imported as `--model tests_pkg.mod:build`. Importing
it touches the file named by $TESTS_PKG_IMPORTED, if set: a test proves that a command imported
nothing."""

import os
import time
from pathlib import Path

import torch
import torch.nn as nn

if os.environ.get("TESTS_PKG_IMPORTED"):
    Path(os.environ["TESTS_PKG_IMPORTED"]).touch()


class Net(nn.Module):
    def __init__(self, num_classes: int, width: int = 8, out: str = "logits"):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.GroupNorm(2, width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(width, num_classes)
        self.out = out

    def forward(self, x):
        if torch.is_grad_enabled() and os.environ.get("TESTS_PKG_FAIL_WITH_GRAD"):
            # (the start-up check has none)
            raise RuntimeError("the first training step fails (TESTS_PKG_FAIL_WITH_GRAD)")
        if self.training and os.environ.get("TESTS_PKG_DELAY"):
            time.sleep(float(os.environ["TESTS_PKG_DELAY"]))
        logits = self.head(self.features(x))
        if self.out == "tuple" or self.out == "tuple_in_training" and self.training:
            # (the latter: GoogLeNet's aux)
            return logits, x
        if self.out == "dict":
            return {"logits": logits}
        if self.out == "wrong_shape":
            return logits[:, :3]
        return logits


def build(
    num_classes: int,
    width: int = 8,
    out: str = "logits",
    fail: bool = False,
    rank: int | None = None,
):
    """Everything a bad model can do, by --model_kwargs: fail (the callable raises), out (what
    forward returns), on every rank or only on `rank`."""
    if rank is not None and int(os.environ.get("RANK", "0")) != rank:
        fail, out = False, "logits"
    if fail:
        raise RuntimeError("the weights server is down")
    return Net(num_classes, width, out)


def probe(num_classes: int, keyword: bool = False):
    """A linear probe: every parameter frozen (requires_grad=False) but the classifier's. keyword:
    the classifier is called with a keyword argument (`self.head(input=x)`)."""
    net = Net(num_classes)
    for p in net.features.parameters():
        p.requires_grad_(False)
    if keyword:
        net.head = _KeywordCall(net.head)
    return net


class _KeywordCall(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(input=x)


def with_unused(num_classes: int):
    """A model with a parameter its forward never uses (a head left from another task)."""
    net = Net(num_classes)
    net.spare = nn.Linear(8, 3)
    return net


def not_a_module(num_classes: int):
    return "a string"


def no_parameters(num_classes: int):
    return nn.Identity()


NOT_CALLABLE = 3
