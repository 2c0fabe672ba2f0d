import pytest
import torch
import torch.nn as nn

from accel_train.errors import ConfigError
from accel_train.model import create_model


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
