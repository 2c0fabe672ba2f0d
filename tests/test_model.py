import pytest
import torch
import torch.nn as nn

from accel_train.errors import ConfigError
from accel_train.model.create import create_model


@pytest.mark.parametrize("stem", ["cifar", "imagenet"])
def test_both_stems_give_logits_for_32x32(stem):
    model = create_model("resnet18", stem).eval()
    with torch.no_grad():
        out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 10)


def test_cifar_stem_is_3x3_stride1_without_maxpool():
    model = create_model("resnet18", "cifar")
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert isinstance(model.maxpool, nn.Identity)
    # the cifar stem keeps the spatial size through the stem: 32x32 in, 32x32 into layer1
    feats = model.maxpool(model.act1(model.bn1(model.conv1(torch.randn(1, 3, 32, 32)))))
    assert feats.shape[-2:] == (32, 32)
    imagenet = create_model("resnet18", "imagenet")
    assert imagenet.conv1.kernel_size == (7, 7) and imagenet.conv1.stride == (2, 2)
    assert isinstance(imagenet.maxpool, nn.MaxPool2d)


def test_unknown_model_and_unsupported_stem_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown timm model 'resnet1800'"):
        create_model("resnet1800")
    with pytest.raises(ConfigError, match="use --stem imagenet"):
        create_model("vit_tiny_patch16_224", "cifar")


def test_init_from_takes_a_pth_state_dict_and_its_imagenet_stem_at_64px(tmp_path):
    # a .pth/.pt state dict is taken (not "not a safetensors file"), and ImageNet-shaped weights at
    # 64 px take the ImageNet stem (the auto (cifar) stem fails: conv1.weight (64, 3, 7, 7) vs
    # (64, 3, 3, 3))
    from conftest import run_cli

    weights = create_model("resnet18", "imagenet", 1000).state_dict()
    # (timm's train.py checkpoint shape)
    torch.save({"state_dict": weights, "epoch": 90}, tmp_path / "imagenet.pth")
    args = [
        "--data",
        "random",
        "--image_size",
        "64",
        "--train_samples",
        "16",
        "--test_samples",
        "8",
        "--batch_size",
        "8",
        "--max_steps",
        "1",
        "--init_from",
        tmp_path / "imagenet.pth",
    ]
    proc = run_cli([*args, "--output_dir", tmp_path / "out"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--init_from: stem imagenet, as the weights were trained" in proc.stderr
    assert (
        f"loaded {len(weights) - 2} tensors; re-initialised fc.weight, fc.bias (1000 classes"
        in proc.stderr
    )
    # a pickle that is not tensors by name is refused without running it (weights_only=True): one
    # line
    torch.save({"state_dict": {"conv1.weight": nn.Conv2d(3, 8, 3)}}, tmp_path / "object.pth")
    proc = run_cli([*args[:-1], tmp_path / "object.pth", "--output_dir", tmp_path / "bad"])
    assert (
        proc.returncode == 2
        and "does not load as a state dict of tensors with weights_only=True"
        in proc.stderr.strip().splitlines()[-1]
    ), proc.stderr[-2000:]
    assert not (tmp_path / "bad" / "model.safetensors").exists()
