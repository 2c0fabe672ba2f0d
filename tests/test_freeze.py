"""--pretrained (timm's weights from the Hugging Face cache or a file, never
downloaded under HF_HUB_OFFLINE=1) and --freeze (a linear probe, or up to a named stage): frozen
weights and BatchNorm statistics end bit-identical, the precision check skips frozen layers, and 2
ranks train without DDP's unused-parameter error.
"""

import copy
import json
import re

import pytest
import timm
import torch
import torch.nn as nn
from conftest import clean_env, launch
from safetensors.torch import load_file, save_file
from test_precision_check import BF16_CPU

from accel_train.config.train_config import TrainConfig
from accel_train.errors import ConfigError
from accel_train.model import pretrained
from accel_train.model.freeze import freeze, frozen_names
from accel_train.precision import check as gradcheck

REPO = "timm/test_resnet.r160_in1k"  # timm's pretrained_cfg source of test_resnet


def fake_hub_cache(root, seed=1):
    """A Hugging Face cache holding 'timm's weights' for test_resnet (ImageNet's 1000 classes), as
    `hf download` leaves it: models--timm--<name>/snapshots/<commit>/model.safetensors and
    refs/main. Returns the weights.
    """
    torch.manual_seed(seed)
    weights = {k: v.contiguous() for k, v in timm.create_model("test_resnet").state_dict().items()}
    repo = root / f"models--{REPO.replace('/', '--')}"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    save_file(weights, snap / "model.safetensors")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return weights


def test_freeze_backbone_and_up_to_a_stage():
    model = timm.create_model("test_resnet", num_classes=10)
    names = [n for n, _ in model.named_parameters()]
    assert frozen_names(model, "backbone") == [n for n in names if not n.startswith("fc.")]
    up_to = frozen_names(model, "layer2")
    assert up_to[-1].startswith("layer2.") and not any(
        n.startswith(("layer3", "layer4", "fc")) for n in up_to
    )
    vit = timm.create_model("test_vit", num_classes=10, img_size=32, patch_size=8)
    assert frozen_names(vit, "blocks.0")[-1].startswith("blocks.0.")
    for spec, says in (
        ("layer9", "has no module 'layer9'"),
        ("fc", "would freeze every parameter"),
    ):
        with pytest.raises(ConfigError, match=says):
            frozen_names(model, spec)
    with pytest.raises(ConfigError, match="--freeze backbone needs the model's classifier"):
        frozen_names(nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2)), "backbone")


def test_a_frozen_part_keeps_its_weights_and_batchnorm_statistics_through_training():
    model = timm.create_model("test_resnet", num_classes=10)
    keys = list(model.state_dict())
    freeze(model, "layer2")
    assert list(model.state_dict()) == keys  # the export loads strictly into timm's model as before
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        model.train()  # (the loop's every epoch: a frozen BatchNorm stays in eval mode)
        model(torch.randn(4, 3, 32, 32)).logsumexp(1).sum().backward()
        opt.step()
    after = model.state_dict()
    frozen = [k for k in keys if k.startswith(("conv1", "bn1", "layer1", "layer2"))]
    assert all(torch.equal(before[k], after[k]) for k in frozen)
    assert not torch.equal(before["layer3.0.bn1.running_mean"], after["layer3.0.bn1.running_mean"])
    assert not torch.equal(before["fc.weight"], after["fc.weight"])
    copy.deepcopy(model).train()  # the EMA's and the precision check's copies


def test_the_precision_check_skips_the_frozen_layers(monkeypatch):
    # a frozen layer under the precision check: a linear probe's or a
    # partly frozen model's frozen layers have no gradient to compare and are not checked alone; the
    # layers that train are
    model = timm.create_model("test_resnet", num_classes=10)
    freeze(model, "layer2")
    checked = []
    real = gradcheck.layer_errors
    monkeypatch.setattr(
        gradcheck, "layer_errors", lambda layers, *a: checked.extend(layers) or real(layers, *a)
    )
    torch.manual_seed(0)
    v = gradcheck.check(
        model, torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)), nn.CrossEntropyLoss(), "bf16"
    )
    assert v.error == "" and not v.bad, v
    assert checked and not any(n.startswith(("conv1", "layer1", "layer2")) for n in checked), (
        checked
    )
    assert any(n.startswith("layer3") for n in checked) and "fc" in checked
    # a verdict remembered for a partly frozen model is not one for the whole model: its frozen
    # layers went unchecked
    from accel_train.platform.hardware import DeviceFacts
    from accel_train.precision.cache import cache_key

    c, facts = TrainConfig(data="random", model="test_resnet"), DeviceFacts("cpu", "x")
    keys = [
        cache_key(c, 10, (8, 3, 32, 32), "bf16", facts, m)
        for m in (model, timm.create_model("test_resnet", num_classes=10))
    ]
    assert keys[0]["frozen"] != keys[1]["frozen"]


def test_pretrained_weights_are_found_in_the_cache_or_named_where_to_put_them(
    tmp_path, monkeypatch
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    c = TrainConfig(data="random", model="test_resnet", pretrained=True)
    with pytest.raises(ConfigError) as e:
        pretrained.check_on_disk(c.model, c.pretrained_path, c.init_from)
    assert (
        "put them in the Hugging Face cache,"
        f" {tmp_path / 'hub'}/models--timm--test_resnet.r160_in1k" in str(e.value)
    )
    assert "HF_HUB_OFFLINE=1 downloads nothing" in str(e.value) and "--pretrained_path FILE" in str(
        e.value
    )
    fake_hub_cache(tmp_path / "hub")
    assert "from the Hugging Face cache" in pretrained.check_on_disk(
        c.model, c.pretrained_path, c.init_from
    )
    # its pretrained_cfg's
    assert pretrained.normalisation("test_resnet") == (
        (0.5,) * 3,
        (0.5,) * 3,
        0.95,
    )
    for bad, says in (
        (dict(pretrained_path=str(tmp_path / "none.safetensors")), "no such file"),
        (dict(init_from="x.safetensors"), "pass one of them"),
        (dict(model="m:f"), "use --init_from"),
    ):
        with pytest.raises(ConfigError, match=says):
            bad_cfg = TrainConfig(**{**c.to_dict(), **bad})
            pretrained.check_on_disk(bad_cfg.model, bad_cfg.pretrained_path, bad_cfg.init_from)


SMALL = [
    "--model",
    "test_resnet",
    "--data",
    "random",
    "--train_samples",
    "64",
    "--test_samples",
    "16",
    "--batch_size",
    "8",
    "--epochs",
    "2",
    "--log_every",
    "1",
    "--plot",
    "false",
    "--timeout_s",
    "120",
]


@pytest.mark.launches
def test_a_linear_probe_from_cached_pretrained_weights_on_two_ranks_leaves_the_backbone_identical(
    tmp_path,
):
    # HF_HUB_OFFLINE=1: the weights come from the cache, nothing is downloaded; bf16 (the precision
    # check runs on the partly frozen model); the backbone and its BatchNorm statistics end exactly
    # as the file had them
    weights = fake_hub_cache(tmp_path / "hub")
    out = tmp_path / "out"
    env = clean_env(
        HF_HUB_OFFLINE="1",
        HF_HUB_CACHE=str(tmp_path / "hub"),
        ACCEL_TRAIN_DEVICE_FACTS=BF16_CPU,
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    proc = launch(
        "2proc_cpu.yaml",
        [
            *SMALL,
            "--pretrained",
            "--freeze",
            "backbone",
            "--mixed_precision",
            "bf16",
            "--output_dir",
            out,
        ],
        env=env,
    )
    assert "--pretrained: test_resnet weights from the Hugging Face cache" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert (
        "--pretrained: mean/std 0.5,0.5,0.5 / 0.5,0.5,0.5 from timm's pretrained_cfg" in proc.stderr
    )
    assert re.search(
        r"--freeze backbone: 45 of 47 parameter tensors frozen \(15 BatchNorm", proc.stderr
    )
    assert re.search(r"precision check: bf16 gradients match fp32 .*\(fc\.\w+\)", proc.stderr), (
        proc.stderr[-3000:]
    )
    assert "get no gradient" not in proc.stderr and "2 process(es)" in proc.stderr
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[k], weights[k]) for k in weights if not k.startswith("fc."))
    assert exported["fc.weight"].shape == (10, 96)  # (a new classifier for the 10 classes)
    config = json.loads((out / "model_config.json").read_text())
    assert config["stem"] == "imagenet" and config["mean"] == [0.5, 0.5, 0.5]


@pytest.mark.launches
def test_partial_fine_tuning_up_to_a_stage_on_two_ranks(tmp_path):
    # --freeze layer1 from a --pretrained_path file (timm loads it: the classifier of another class
    # count dropped), with lamb, a step schedule and dropout: conv1, bn1 and layer1 end as the file
    # had them, the rest trained; a resume keeps the freeze without being told it (the checkpoint's
    # run math)
    torch.manual_seed(3)
    start = {k: v.contiguous() for k, v in timm.create_model("test_resnet").state_dict().items()}
    save_file(start, tmp_path / "start.safetensors")
    out = tmp_path / "out"
    args = [
        *SMALL,
        "--pretrained_path",
        tmp_path / "start.safetensors",
        "--opt",
        "lamb",
        "--sched",
        "step",
        "--sched_kwargs",
        '{"decay_epochs": 1}',
        "--drop_rate",
        "0.1",
        "--output_dir",
        out,
    ]
    first = launch("2proc_cpu.yaml", [*args, "--freeze", "layer1", "--max_steps", "5"])
    assert (
        f"--pretrained: test_resnet weights from {tmp_path / 'start.safetensors'}" in first.stderr
    )
    assert "--freeze layer1: 15 of 47 parameter tensors frozen" in first.stderr, first.stderr[
        -3000:
    ]
    assert "optimizer lamb (timm)" in first.stderr and "then step" in first.stderr
    proc = launch("2proc_cpu.yaml", [*args, "--resume", "auto"])
    assert (
        "get no gradient" not in proc.stderr and "step 5, 1 batches into the epoch" in proc.stderr
    )
    assert "--freeze layer1: 15 of 47 parameter tensors frozen" in proc.stderr, proc.stderr[-3000:]
    exported = load_file(out / "model.safetensors")
    frozen = [k for k in start if k.startswith(("conv1.", "bn1.", "layer1."))]
    assert frozen and all(torch.equal(exported[k], start[k]) for k in frozen)
    assert not torch.equal(exported["layer2.0.conv1.weight"], start["layer2.0.conv1.weight"])
