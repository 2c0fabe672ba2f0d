"""Models whose gradient is wrong in the reduced precision only, for tests/test_precision_check.py
(in the test process, and imported by a sitecustomize hook in the ranks of its 2-rank test):
registered as timm models."""

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models import register_model

# per forward with gradients of the registered models: was autocast on? (not counted: the
# start-up check of the logits' shape and the evaluations, which run without gradients)
FORWARDS: list[bool] = []


def wrong_under_autocast(wrong):
    """An autograd Function, the identity on a weight, whose gradient is wrong(g) where the forward
    ran under autocast: a kernel that is wrong in the reduced precision only."""

    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, w):
            ctx.low = torch.is_autocast_enabled(w.device.type)
            return w.view_as(w)

        @staticmethod
        def backward(ctx, g):
            return wrong(g) if ctx.low else g

    return Wrong


# garbage (x1e15)
Corrupt = wrong_under_autocast(lambda g: g * 1e15)


class Net(nn.Module):
    def __init__(self, bad: bool = True, num_classes: int = 10, **kwargs):
        super().__init__()
        self.bad = bad
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.5)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        if torch.is_grad_enabled():
            FORWARDS.append(torch.is_autocast_enabled(x.device.type))
        w = Corrupt.apply(self.conv.weight) if self.bad else self.conv.weight
        x = F.relu(self.bn(F.conv2d(x, w, self.conv.bias, padding=1)))
        return self.fc(self.drop(x.mean((2, 3))))


@register_model
def gradcheck_wrong_in_bf16(pretrained=False, **kwargs):
    return Net(bad=True, **kwargs)


@register_model
def gradcheck_right_in_bf16(pretrained=False, **kwargs):
    return Net(bad=False, **kwargs)


@register_model
def gradcheck_wrong_on_rank_1(pretrained=False, **kwargs):
    return Net(bad=os.environ.get("RANK") == "1", **kwargs)
