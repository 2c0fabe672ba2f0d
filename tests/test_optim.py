"""timm's optimizers, schedules and Mixup from the flags;
their lr and weight decay defaults; the lr the run reports for every schedule; mixup's draws a
function of (seed, step, rank); a resume that refuses what cannot carry over; and a small ViT
fine-tuned on 2 ranks, resumed exactly, evaluated.
"""

import json
import re
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import timm
import torch
from conftest import launch, steps_logged
from safetensors.torch import load_file

from accel_train.checkpoint.changes import check_changes, settings
from accel_train.checkpoint.resume import keep_run_math
from accel_train.config.train_config import TrainConfig
from accel_train.errors import ConfigError
from accel_train.training.exports import lr_of_step
from accel_train.training.loop import reseed
from accel_train.training.metrics import EpochMeter
from accel_train.training.optim import (
    build_optimizer,
    criterion,
    known_optimizers,
    mixing,
    schedule,
)


def cfg(**kw):
    return TrainConfig(**{"data": "random", "batch_size": 8, "epochs": 4, **kw})


@pytest.mark.parametrize(
    "name, lr_base, decay, kind",
    [
        ("sgd", 0.2, 5e-4, "SGD"),
        ("adamw", 2.5e-4, 0.05, "AdamW"),
        ("adam", 2.5e-4, 0.0, "Adam"),
        ("lamb", 6.25e-4, 0.01, "Lamb"),
        ("lion", 2.5e-5, 0.5, "Lion"),
        ("adan", 2.5e-4, 0.05, "Adan"),
    ],
)
def test_each_optimizer_is_timms_with_its_familys_defaults(name, lr_base, decay, kind):
    if name == "adan" and not known_optimizers():
        pytest.skip("timm gained adan with its optimizer registry (1.0.12)")
    c = cfg(optimizer=name)
    assert c.optimizer_defaults() == (lr_base, decay)
    opt = build_optimizer(c, timm.create_model("test_resnet", num_classes=10), 2)
    assert type(opt).__name__ == kind
    assert [g["lr"] for g in opt.param_groups] == pytest.approx(
        [lr_base * 8 * 2 / 256] * len(opt.param_groups)
    )
    # (norm, bias: none)
    assert sorted({g["weight_decay"] for g in opt.param_groups}) == sorted({0.0, decay})
    # a flag wins over the family's default
    given = cfg(optimizer=name, lr_base=0.1, weight_decay=0.3)
    assert given.optimizer_defaults() == (0.1, 0.3)


def test_timm_spellings_parse():
    from accel_train.cli import parse_train_args

    c = parse_train_args(
        ["--opt", "adamw", "--sched", "tanh", "--layer_decay", "0.75", "--mixup", "0.8"]
    )
    assert (c.optimizer, c.sched, c.layer_decay, c.mixup) == ("adamw", "tanh", 0.75, 0.8)
    with pytest.raises(ConfigError, match="--sched: invalid choice: 'plateau'"):
        # (it follows a metric, not the step)
        parse_train_args(["--sched", "plateau"])
    with pytest.raises(ConfigError, match="--layer_decay must be in"):
        cfg(layer_decay=1.5)


def test_drop_rates_reach_timm_and_a_second_spelling_is_refused():
    from accel_train.training.startup import model_extras

    fresh, resumed = SimpleNamespace(meta=None), SimpleNamespace(meta={"step": 3})
    assert model_extras(cfg(drop_path=0.1), fresh) == {"drop_path_rate": 0.1}
    # (0: not passed, so a model that takes none still builds)
    assert model_extras(cfg(), fresh) == {}
    assert model_extras(cfg(model="test_resnet", pretrained=True), fresh)["pretrained"] is True
    # (its weights win)
    assert "pretrained" not in model_extras(cfg(model="test_resnet", pretrained=True), resumed)
    with pytest.raises(ConfigError, match="--drop_rate and --model_kwargs' drop_rate both set it"):
        model_extras(cfg(drop_rate=0.1, model_kwargs='{"drop_rate": 0.2}'), fresh)


def test_a_wrong_optimizer_name_is_one_line_with_the_nearest():
    # (a timm before its optimizer registry, 1.0.12: no names to offer)
    says = (
        r"--opt adamww: not a timm optimizer; did you mean adamw"
        if known_optimizers()
        else r"--opt adamww: timm could not build it"
    )
    with pytest.raises(ConfigError, match=says):
        build_optimizer(cfg(optimizer="adamww"), timm.create_model("test_resnet"), 1)


def test_layer_decay_scales_each_blocks_lr_and_leaves_frozen_parameters_out():
    model = timm.create_model("test_vit", num_classes=10, img_size=32, patch_size=8)
    model.patch_embed.requires_grad_(False)
    opt = build_optimizer(cfg(optimizer="adamw", layer_decay=0.5), model, 1)
    scales = sorted({g["lr_scale"] for g in opt.param_groups})
    # stem, blocks, head
    assert scales[-1] == 1.0 and scales[-2] == 0.5 and len(scales) == len(model.blocks) + 2
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert not any(id(p) in in_opt for p in model.patch_embed.parameters())
    with pytest.raises(ConfigError, match="--layer_decay needs a model that names its layers"):
        build_optimizer(cfg(layer_decay=0.5), torch.nn.Linear(3, 2), 1)


@pytest.mark.parametrize(
    "sched", ["cosine", "tanh", "step", "multistep", "poly", "wsd", "rsqrt", "constant"]
)
def test_the_reported_lr_is_the_lr_each_schedule_sets(sched):
    # outputs.lr_of_step (the lr curve, steps.jsonl, the epoch rows) against the lr step_update
    # gives the optimizer, for every --sched, with timm's lr noise too, and under --layer_decay (the
    # classifier's group, lr_scale 1)
    kwargs = {"decay_epochs": 1, "noise": [0.3]} if sched in ("step", "cosine") else {}
    c = cfg(
        sched=sched,
        sched_kwargs=json.dumps(kwargs) if kwargs else None,
        layer_decay=0.5,
        warmup_epochs=0.5,
    )
    model = timm.create_model("test_vit", num_classes=10, img_size=32, patch_size=8)
    opt = build_optimizer(c, model, 1)
    try:
        scheduler = schedule(c, opt, 1, steps_per_epoch=4)
    except ConfigError as e:  # (the minimum timm, 1.0.10, predates wsd, rsqrt and constant)
        if "has no such schedule" in str(e):
            pytest.skip(str(e))
        raise
    head = next(g for g in opt.param_groups if g["lr_scale"] == 1.0)
    seen = []
    for step in range(16):
        scheduler.step_update(step)
        assert lr_of_step(scheduler, step + 1) == pytest.approx(head["lr"], rel=1e-12), (
            sched,
            step,
        )
        seen.append(head["lr"])
    assert len(set(seen)) > 2  # warmup, then the schedule moves


def test_a_bad_schedule_argument_is_one_line():
    c = cfg(sched="cosine", sched_kwargs='{"decay_epoch": 4}')
    with pytest.raises(ConfigError, match=r"--sched cosine with --sched_kwargs .*decay_epoch"):
        schedule(c, build_optimizer(c, torch.nn.Linear(3, 2), 1), 1, 4)


def fake_run(step, rank=0, micro=0):
    state = SimpleNamespace(step=step, batch_in_epoch=micro)
    return SimpleNamespace(
        state=state,
        run_math={"seed": 42},
        accelerator=SimpleNamespace(gradient_accumulation_steps=2, process_index=rank),
    )


def test_mixup_draws_are_a_function_of_seed_step_and_rank():
    # timm's Mixup draws lambda, mixup-or-cutmix and the box from numpy's global generator:
    # loop.reseed seeds it with the step's seed, so a resumed run (or the same step again) mixes the
    # same way, another step or rank another way
    mix = mixing(0.8, 1.0, cfg().label_smoothing, 10)
    x, y = torch.rand(8, 3, 16, 16), torch.arange(8) % 10

    def mixed(step, rank=0, micro=0):
        np.random.seed(0)  # whatever ran before
        reseed(fake_run(step, rank, micro))
        return mix(x.clone(), y)

    a, b = mixed(5), mixed(5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    others = [mixed(6), mixed(5, rank=1), mixed(5, micro=1)] + [mixed(s) for s in range(7, 12)]
    assert all(not torch.equal(a[0], o[0]) for o in others)
    # soft targets, smoothing folded in
    assert a[1].shape == (8, 10) and torch.allclose(a[1].sum(1), torch.ones(8))
    assert type(criterion(cfg().label_smoothing, soft=True)).__name__ == "SoftTargetCrossEntropy"


def test_training_accuracy_on_soft_targets_counts_the_larger_share():
    meter = EpochMeter("cpu")
    logits = torch.tensor([[3.0, 0.0], [0.0, 3.0], [3.0, 0.0]])
    # the class that covers most of each mixed image
    soft = torch.tensor([[0.7, 0.3], [0.4, 0.6], [0.2, 0.8]])
    meter.update(torch.tensor(1.0), logits, soft)
    assert meter.correct.item() == 2 and meter.samples == 3


def test_a_resume_refuses_another_optimizer_layer_decay_on_or_off_and_another_freeze():
    old = settings(cfg(optimizer="adamw", layer_decay=0.75), "no")
    # applied
    check_changes(
        old, cfg(optimizer="adamw", layer_decay=0.5, sched="step", mixup=0.2, drop_path=0.1)
    )
    with pytest.raises(
        ConfigError,
        match="--opt sgd cannot follow the checkpoint's adamw .*resume with --opt adamw",
    ):
        check_changes(old, cfg())
    with pytest.raises(
        ConfigError, match="--layer_decay unset cannot follow the checkpoint's 0.75"
    ):
        check_changes(old, cfg(optimizer="adamw"))
    # the value the run used, recorded
    assert settings(cfg(optimizer="lamb"), "no")["weight_decay"] == 0.01
    run = {"freeze": "backbone"}
    assert keep_run_math(run, cfg()) == {"freeze": "backbone"}  # not given: the checkpoint's
    with pytest.raises(
        ConfigError, match="--freeze 'layer1' differs from the checkpoint's 'backbone'"
    ):
        keep_run_math(run, cfg(freeze="layer1"))
    with pytest.raises(ConfigError, match="resume without --freeze"):
        keep_run_math({"freeze": None}, cfg(freeze="layer1"))


def test_mixup_needs_an_even_batch():
    from accel_train.training.optim import check_mixing

    with pytest.raises(ConfigError, match="--batch_size 7 must be even"):
        check_mixing(0.0, 1.0, 7)


# A fine-tune: timm's test ViT at 32 px (patch 8: 16 tokens) on an image
# folder of PNGs (RandomResizedCrop, RandAugment and random erasing in the workers; evaluation at
# crop_pct 0.875), 2 ranks x 8, 4 steps an epoch, 2 epochs
VIT = [
    "--model",
    "test_vit",
    "--model_kwargs",
    '{"patch_size": 8}',
    "--data",
    "imagefolder",
    "--image_size",
    "32",
    "--batch_size",
    "8",
    "--epochs",
    "2",
    "--mixed_precision",
    "no",
    "--log_every",
    "1",
    "--plot",
    "false",
    "--opt",
    "adamw",
    "--layer_decay",
    "0.75",
    "--drop_path",
    "0.1",
    "--aa",
    "rand-m9-mstd0.5",
    "--mixup",
    "0.8",
    "--cutmix",
    "1.0",
    "--reprob",
    "0.25",
    "--lr",
    "0.002",
]


def png_folder(root, train: int = 16, val: int = 4):
    """4 classes of PNGs of assorted sizes (lossless: timm's loader and ours decode the same
    pixels)."""
    from PIL import Image

    rng = np.random.default_rng(3)
    for split, n in (("train", train), ("val", val)):
        for c, level in enumerate((40, 100, 160, 220)):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(n):
                w, h = (int(v) for v in rng.integers(32, 57, 2))
                pixels = np.clip(level + rng.integers(-40, 41, (h, w, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / f"c{c}" / f"{i}.png")
    return root


def timm_validate(out, folder) -> float:
    """timm's validate.py, as it scores a checkpoint: the model from its file, the data config from
    its pretrained_cfg (resolve_data_config), timm's dataset and eval loader (create_dataset,
    create_loader).
    """
    from timm.data import create_dataset, create_loader, resolve_data_config

    meta = json.loads((out / "model_config.json").read_text())
    model = timm.create_model(
        "test_vit",
        num_classes=meta["num_classes"],
        img_size=32,
        patch_size=8,
        pretrained=True,
        pretrained_cfg_overlay=dict(meta["pretrained_cfg"], file=str(out / "model.safetensors")),
    )
    config = resolve_data_config(model=model)
    loader = create_loader(
        create_dataset("", root=str(folder / "val")),
        input_size=config["input_size"],
        batch_size=8,
        use_prefetcher=False,
        interpolation=config["interpolation"],
        mean=config["mean"],
        std=config["std"],
        num_workers=0,
        crop_pct=config["crop_pct"],
        crop_mode=config["crop_mode"],
    )
    right = total = 0
    with torch.no_grad():
        for x, y in loader:
            right += int((model.eval()(x).argmax(1) == y).sum())
            total += len(y)
    return right / total


@pytest.mark.launches
def test_a_vit_fine_tune_trains_on_two_ranks_resumes_exactly_and_evaluates(tmp_path):
    full, part, data = tmp_path / "full", tmp_path / "part", png_folder(tmp_path / "photos")
    args = [*VIT, "--data_dir", data]
    proc = launch("2proc_cpu.yaml", [*args, "--output_dir", full])
    assert re.search(
        r"optimizer adamw \(timm\), lr 0.002 \(--lr\), weight decay 0.05 \(--opt adamw's"
        r" default\), "
        r"layer decay 0.75; .*then cosine; "
        r"mixup 0.8 / cutmix 1 on soft targets",
        proc.stderr,
    ), proc.stderr[-3000:]
    # one step into epoch 2
    launch("2proc_cpu.yaml", [*args, "--output_dir", part, "--max_steps", "5"])
    shutil.rmtree(part / "checkpoints" / "step_00000004")  # resume from step 5, mid-epoch
    resumed = launch("2proc_cpu.yaml", [*args, "--output_dir", part, "--resume", "auto"])
    assert "step 5, 1 batches into the epoch" in resumed.stderr, resumed.stderr[-3000:]
    a, b = load_file(full / "model.safetensors"), load_file(part / "model.safetensors")
    # crops, aa, erasing, mixup drew alike
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert steps_logged(full) == 8
    # layer decay in the optimizer: the checkpoint's groups, each block's lr 0.75x the next one's
    groups = torch.load(
        full / "checkpoints" / "step_00000008" / "optimizer.bin", weights_only=True
    )["param_groups"]
    assert sorted({round(g["lr_scale"], 6) for g in groups})[-3:] == [0.5625, 0.75, 1.0]
    rows = [json.loads(r) for r in (full / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["train_acc"] <= 1 for r in rows)
    # the export is the plain ViT: timm builds it; accel-train evaluate scores what the run's last
    # epoch did, and timm's validate.py (its loader at the recorded crop_pct) the same
    meta = json.loads((full / "model_config.json").read_text())
    timm.create_model("test_vit", num_classes=4, img_size=32, patch_size=8).load_state_dict(
        a, strict=True
    )
    assert meta["architecture"] == "test_vit" and meta["pretrained_cfg"]["crop_pct"] == 0.875
    # (the run's data)
    proc = launch("2proc_cpu.yaml", ["evaluate", "--checkpoint", full, "--batch_size", "8"])
    m = re.search(r"test accuracy ([\d.]+)% on 16 samples", proc.stdout)
    assert m and float(m.group(1)) / 100 == pytest.approx(rows[-1]["test_acc"], abs=1e-6), (
        proc.stdout
    )
    assert timm_validate(full, data) == pytest.approx(float(m.group(1)) / 100, abs=1e-6)
