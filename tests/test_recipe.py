"""Flip-TTA moves the evaluated numbers the expected way on a toy case built to show it (through
evaluate.evaluate and the device pipeline), and the trainer's EMA is timm's EMA of its optimizer steps."""

import pytest
import torch
import torch.nn as nn
from accelerate import Accelerator
from safetensors.torch import load_file
from timm.utils import ModelEmaV3

from accel_train.files import EMA_FILE
from accel_train.config import TrainConfig
from accel_train.data import build_data
from accel_train.evaluate import evaluate
from accel_train.model import create_model
from conftest import launch


@pytest.fixture
def accelerator():
    return Accelerator(cpu=True)  # (per test: an in-process run resets Accelerate's state)


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


@pytest.mark.slow
def test_trainers_ema_is_timms_ema_of_each_optimizer_steps_weights(tmp_path):
    """The trainer's own EMA, from a real run: after every optimizer step (not every micro-batch) it moves
    towards that step's weights by timm's warmup decay, and the exported EMA is the last one."""
    out = tmp_path / "out"
    launch("cpu.yaml", ["--train_samples", "64", "--test_samples", "8", "--batch_size", "8", "--epochs", "1",
                        "--grad_accum", "2", "--ema", "--ema_decay", "0.99", "--max_steps", "4",
                        "--checkpoint_every", "1", "--keep_checkpoints", "10", "--output_dir", out])
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert [int(p.name.split("_")[1]) for p in ckpts] == [1, 2, 3, 4]
    weights = [load_file(p / "model.safetensors") for p in ckpts]
    emas = [load_file(p / EMA_FILE) for p in ckpts]
    model, reference = create_model("resnet18", "cifar"), create_model("resnet18", "cifar")
    ema = ModelEmaV3(reference, decay=0.99, use_warmup=True)
    ema.module.load_state_dict(emas[0])
    for step in (2, 3, 4):
        model.load_state_dict(weights[step - 1])
        ema.update(model, step=step)
        worst = max((ema.module.state_dict()[k].double() - emas[step - 1][k].double()).abs().max().item()
                    for k in emas[step - 1])
        assert worst < 1e-6, (step, worst)
        moved = max((emas[step - 1][k] - weights[step - 1][k]).abs().max().item() for k in emas[step - 1]
                    if emas[step - 1][k].is_floating_point())
        assert moved > 1e-4, "the EMA is a copy of the weights, not an average"
    exported = load_file(out / "model_ema.safetensors")
    assert exported.keys() == emas[-1].keys() and all(torch.equal(exported[k], emas[-1][k]) for k in exported)
