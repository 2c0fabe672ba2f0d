"""Your own Dataset and model, trained from Python with every guarantee of the command line:

    python examples/train_own_data.py --output_dir /tmp/own_data                  # one process
    accelerate launch --config_file accelerate_configs/2proc_cpu.yaml \
        examples/train_own_data.py --output_dir ...                                # ranks
    ACCEL_TRAIN_SCRIPT=examples/train_own_data.py ./launch.sh --output_dir ...    # clusters

It takes the command line's flags (--epochs, --resume auto, ...); `--output_dir ... --resume auto`
alone continues the run with its own settings. Exact resume needs a Dataset that gives the same item
for an index every time: here each image is a function of its index. The model is recorded as
train_own_data:small_net, with this file's folder; predict with it from any folder (it imports this
file's code, hence the trust flag; the images are fed as Stripes gives them, unnormalised):

    accel-train predict --checkpoint /tmp/own_data --trust_model_code --mean 0,0,0 --std 1,1,1 imgs/
"""

import json
import sys

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import Dataset

from accel_train import train
from accel_train.api import main
from accel_train.cli import parse_train_args


class Stripes(Dataset):
    """Images of horizontal (class 0) or vertical (class 1) stripes with noise: item i is the same
    on every call."""

    classes = ("horizontal", "vertical")

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, seed

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = i % 2
        stripes = (torch.arange(16) // 2 % 2).float()
        image = (stripes[:, None] if label == 0 else stripes[None, :]).expand(16, 16)
        return (image + 0.5 * torch.randn(3, 16, 16, generator=g)), label


def small_net(num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(8 * 16, num_classes),
    )


def run():
    # the command line's flags and defaults (TrainConfig(...) works as well)
    cfg = parse_train_args(sys.argv[1:])
    result = train(
        cfg, model=small_net, train_set=Stripes(256, seed=0), test_set=Stripes(64, seed=1)
    )
    if PartialState().is_main_process:  # every rank returns the same metrics
        print(json.dumps(result))


if __name__ == "__main__":
    # the command line's one-line errors and exit statuses (bad input 2, preempted 4, ...)
    main(run)
