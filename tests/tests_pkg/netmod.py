"""A model of the user's own given to train() as a module instance: its
constructor's arguments are not recorded, so only the instance built with the defaults is rebuilt by
its import path tests_pkg.netmod:Net.
"""

import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_classes: int, width: int = 8, act: str = "relu"):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.GroupNorm(2, width),
            nn.Tanh() if act == "tanh" else nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.head(self.features(x))


def build(num_classes: int, width: int = 8, act: str = "relu"):
    return Net(num_classes, width, act)


def tanh_net(num_classes: int):
    """What a user passes to predict --model for the export of Net(..., act="tanh")."""
    return Net(num_classes, act="tanh")
