"""EMA and flip-TTA move the evaluated numbers the expected way, on toy cases built to show it,
through the same pieces the trainer uses (timm ModelEmaV3, evaluate.evaluate, the device pipeline)."""

import pytest
import torch
import torch.nn as nn
from accelerate import Accelerator
from timm.utils import ModelEmaV3

from accel_train.config import TrainConfig
from accel_train.data import build_data
from accel_train.evaluate import evaluate


@pytest.fixture(scope="module")
def accelerator():
    return Accelerator(cpu=True)


def evaluated_accuracy(accelerator, model, images, labels, tta=False):
    cfg = TrainConfig(batch_size=16)
    data = build_data(cfg, accelerator.device, splits={"train": (images, labels), "test": (images, labels)})
    preds, gold = evaluate(accelerator, model, data.test_loader, data, tta=tta)
    return (preds == gold).float().mean().item()


class PatchSide(nn.Module):
    """Confidently class 0 when the bright patch is on the left; weakly class 1 when it is on the right."""

    def forward(self, x):
        left, right = x[..., :16].mean((1, 2, 3)), x[..., 16:].mean((1, 2, 3))
        logits = torch.full((x.shape[0], 10), -20.0)
        logits[:, 0] = 10.0 * (left > right)
        logits[:, 1] = 1.0 * (right > left)
        return logits


def test_flip_tta_recovers_mirrored_images(accelerator):
    images = torch.zeros(32, 3, 32, 32, dtype=torch.uint8)
    images[:16, :, :, :16] = 255  # patch left
    images[16:, :, :, 16:] = 255  # patch right: the same object, mirrored
    labels = torch.zeros(32, dtype=torch.long)
    plain = evaluated_accuracy(accelerator, PatchSide(), images, labels)
    tta = evaluated_accuracy(accelerator, PatchSide(), images, labels, tta=True)
    assert plain == 0.5 and tta == 1.0


class ChannelMeans(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 10)

    def forward(self, x):
        return self.fc(x[:, :2].mean((2, 3)))


def test_ema_of_noisy_iterates_evaluates_better_than_the_last_iterate(accelerator):
    g = torch.Generator().manual_seed(0)
    points = torch.randn(400, 2, generator=g)
    labels = (points[:, 0] > 0).long()
    images = (128 + 40 * points).clamp(0, 255).to(torch.uint8)[:, :, None, None].expand(400, 2, 32, 32)
    images = torch.cat([images, torch.zeros(400, 1, 32, 32, dtype=torch.uint8)], 1).contiguous()

    model = ChannelMeans()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(-10)
        model.fc.bias[:2] = 0
    ema = ModelEmaV3(model, decay=0.9)
    best = torch.tensor([[-1.0, 0.0], [1.0, 0.0]])
    for step in range(60):  # SGD-like iterates bouncing around the optimum along the wrong axis
        with torch.no_grad():
            model.fc.weight[:2] = best + torch.tensor([[0.0, 2.5], [0.0, -2.5]]) * (1 if step % 2 else -1)
        ema.update(model, step=step)
    last = evaluated_accuracy(accelerator, model, images, labels)
    averaged = evaluated_accuracy(accelerator, ema, images, labels)
    assert averaged > last + 0.15 and averaged > 0.9, (last, averaged)
