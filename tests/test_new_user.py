"""What a new user meets: defaults that follow the data, a
warning when a run will take hours, the best epoch's weights exported, checkpoints that
evaluate/predict accept, a resume that keeps the run's input size/normalisation/augmentation,
predict that goes on past a bad file, outputs that say what ran, and fine-tuning that keeps the
weights' normalisation.

Pure functions are tested in process; two launched runs (one process, then --init_from on two ranks)
check the same behaviours end to end."""

import json
import os
import stat

import pytest
import torch
import yaml
from conftest import check_best, launch, run_cli
from safetensors import safe_open
from safetensors.torch import save_file
from test_imagefolder import write_image_folder

from accel_train.checkpoint.resume import keep_run_math, reconcile
from accel_train.commands.evaluate import load_exported
from accel_train.commands.predict import main_predict
from accel_train.config.resolved import with_values
from accel_train.config.train_config import TrainConfig
from accel_train.data import DataInfo, build_data, native_size
from accel_train.errors import ConfigError
from accel_train.files import BEST_FILE
from accel_train.model.create import create_model, init_normalisation
from accel_train.training.exports import (
    BestModel,
    best_row,
    export_model,
    exported_best,
    lr_curve,
    plot_curves,
)
from accel_train.training.metrics import Pace, slow_run_warning

TINY = [
    "--data",
    "imagefolder",
    "--batch_size",
    "4",
    "--lr",
    "0.05",
    "--warmup_epochs",
    "0",
    "--epochs",
    "2",
]


def info(size=24, classes=("a", "b", "c")):
    return DataInfo("imagefolder", classes, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), size)


# ---------------------------------------------------------------------------------------------
# Item 4: defaults from the data; a slow run says so early
# ---------------------------------------------------------------------------------------------


def test_image_folder_defaults_follow_the_images_own_size(tmp_path):
    cfg = TrainConfig(data="imagefolder")
    assert cfg.stem == "auto" and cfg.image_size is None
    assert (
        cfg.resolution(native=37) == 32
        and cfg.resolution(native=4000) == 224
        and cfg.resolution(native=3) == 8
    )
    assert TrainConfig(data="random").resolution(native=500) == 32
    assert TrainConfig(data="imagefolder", image_size=100).resolution(native=20) == 100
    assert (
        cfg.stem_for(32) == "cifar"
        and cfg.stem_for(64) == "cifar"
        and cfg.stem_for(96) == "imagenet"
    )
    assert TrainConfig(stem="cifar").stem_for(224) == "cifar"  # given: kept
    root = write_image_folder(tmp_path / "d")  # 20..48 px images
    files = sorted((root / "train").rglob("*.*"))
    assert 20 <= native_size(files) <= 48
    data = build_data(TrainConfig(data="imagefolder", data_dir=str(root), batch_size=4), "cpu")
    # not 224 (main: 224 through the cifar stem)
    assert data.info.image_size == native_size(files) // 8 * 8


def test_resolve_replaces_every_automatic_value_once():
    asked = TrainConfig(data="imagefolder", data_dir="x")
    values, line = asked.resolve(info(size=160), "cpu")
    cfg = with_values(asked, values)
    assert asked == TrainConfig(data="imagefolder", data_dir="x")  # what was asked: only read
    assert (cfg.image_size, cfg.stem, cfg.pipeline) == (160, "imagenet", "cpu")
    assert cfg.normalisation() == ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    # (the info's crop_pct)
    assert (
        line == "resolved defaults: --image_size 160, --stem imagenet, --mean 0.5,0.4,0.3, --std"
        " 0.2,0.25,0.3, --pipeline cpu, --train_crop random_resized, --crop_pct 1.0"
    )
    again = TrainConfig(**cfg.to_dict())  # what config.yaml reproduces passes validation
    assert again.to_dict() == cfg.to_dict()


def test_a_run_that_will_take_hours_says_so_once_with_the_flags_that_help(caplog):
    cfg = TrainConfig(data="imagefolder", image_size=224, stem="cifar")
    line = slow_run_warning(224, "cifar", 24.9, 900)
    assert (
        "6.2 h" in line
        and "--stem imagenet" in line
        and "--image_size 112" in line
        and "--max_steps" in line
    )
    assert slow_run_warning(224, "cifar", 0.1, 900) is None
    small = slow_run_warning(32, "cifar", 10.0, 1000)
    assert "--stem imagenet" not in small and "--image_size" not in small
    pace = Pace(cfg, first_step=10, total_steps=1000, enabled=True)
    said = [pace.step_done(step, now=100.0 + 25 * (step - 11)) for step in range(11, 20)]
    assert [s is not None for s in said] == [
        False,
        False,
        False,
        True,
        False,
        False,
        False,
        False,
        False,
    ]
    assert "25.00 s/step" in said[3] and "986 steps" in said[3]
    assert sum("will take about" in r.message for r in caplog.records) == 1
    # other ranks: nothing, no sync
    assert Pace(cfg, 0, 1000, enabled=False).step_done(4, now=1e9) is None


# ---------------------------------------------------------------------------------------------
# Item 7: a resume keeps the input size, normalisation and augmentation
# ---------------------------------------------------------------------------------------------

OLD_RUN = dict(
    global_batch=8,
    batch_size=8,
    num_processes=1,
    num_machines=1,
    grad_accum=1,
    epochs=2,
    seed=42,
    model="resnet18",
    stem="cifar",
    model_kwargs={},
    data="imagefolder",
    train_size=24,
    image_size=48,
    mean=[0.5, 0.4, 0.3],
    std=[0.2, 0.25, 0.3],
    augment=True,
    hflip=True,
)


@pytest.mark.parametrize(
    "flag,value",
    [
        ("image_size", 32),
        ("mean", "0.1,0.4,0.3"),
        ("std", "0.2,0.2,0.2"),
        ("augment", False),
        ("hflip", False),
        ("stem", "imagenet"),
    ],
)
def test_resume_refuses_a_changed_input_size_normalisation_or_augmentation(flag, value):
    cfg = TrainConfig(data="imagefolder", batch_size=8, epochs=2, **{flag: value})
    with pytest.raises(
        ConfigError, match=f"--{flag} .* differs from the checkpoint's .*resume with --{flag} "
    ):
        reconcile({"run": OLD_RUN}, cfg, 1, print)


def test_resume_takes_the_checkpoints_values_for_automatic_ones():
    cfg = with_values(
        TrainConfig(data="imagefolder", batch_size=8, epochs=2),
        keep_run_math(OLD_RUN, TrainConfig(data="imagefolder", batch_size=8, epochs=2)),
    )
    assert (cfg.image_size, cfg.stem) == (48, "cifar")
    assert cfg.normalisation() == ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    same = TrainConfig(data="imagefolder", image_size=48, mean="0.5,0.4,0.3", stem="cifar")
    assert keep_run_math(OLD_RUN, same) == {  # the same values given: accepted, none taken
        "std": "0.2,0.25,0.3"
    }
    older = {
        k: v
        for k, v in OLD_RUN.items()
        if k not in ("image_size", "mean", "std", "augment", "hflip")
    }
    # an older checkpoint records none
    keep_run_math(older, TrainConfig(data="imagefolder", image_size=32))


# ---------------------------------------------------------------------------------------------
# Item 6: the best epoch's weights; checkpoints are evaluable
# ---------------------------------------------------------------------------------------------


def facts(cfg_size=16):
    return {
        "architecture": "resnet18",
        "stem": "cifar",
        **info(cfg_size).model_config(),
        "model_kwargs": {},
    }


def test_best_model_survives_a_resume_and_a_stale_file_is_removed(tmp_path):
    rows = [
        {"epoch": 1, "step": 3, "test_acc": 0.5},
        {"epoch": 2, "step": 6, "test_acc": 0.8},
        {"epoch": 3, "step": 9, "test_acc": 0.7},
    ]
    assert best_row(rows)["epoch"] == 2 and best_row([]) is None
    model = create_model("resnet18", "cifar", num_classes=3)
    export_model(
        model,
        tmp_path,
        facts(),
        BEST_FILE,
        extra={"epoch": 2, "step": 6, "test_acc": 0.8},
        write_config=False,
    )
    assert exported_best(tmp_path) == {"epoch": 2, "step": 6, "test_acc": 0.8}
    assert not (tmp_path / "model_config.json").exists()
    # resumed after epoch 3: the file is the rows' best
    kept = BestModel(tmp_path, rows, writer=True)
    assert kept.on_disk and kept.row["epoch"] == 2 and not kept.improves(rows[2])
    assert kept.improves({"epoch": 4, "step": 12, "test_acc": 0.81})
    # resumed from epoch 1: the file came after it
    stale = BestModel(tmp_path, rows[:1], writer=True)
    assert not stale.on_disk and not (tmp_path / BEST_FILE).exists()
    # a disk without it: said, not invented
    elsewhere = BestModel(tmp_path / "other_disk", rows, writer=True)
    assert elsewhere.row["epoch"] == 2 and not elsewhere.on_disk
    elsewhere.take({"epoch": 4, "step": 12, "test_acc": 0.9})
    assert elsewhere.on_disk and elsewhere.row["epoch"] == 4


# ---------------------------------------------------------------------------------------------
# Item 8: predict goes on past an unreadable file; a folder is an argument
# ---------------------------------------------------------------------------------------------


def test_predict_names_bad_files_predicts_the_rest_and_fails_at_the_end(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    export_model(create_model("resnet18", "cifar", num_classes=3), out, facts())
    images = write_image_folder(tmp_path / "d", train=1, val=2) / "val"
    (images / "apple" / "broken.png").write_bytes(b"not a png")
    code = main_predict(
        ["--checkpoint", str(out), "--top", "2", str(images), str(tmp_path / "missing.jpg")]
    )
    printed = capsys.readouterr()
    assert code == 2
    assert len(printed.out.splitlines()) == 6 and all(
        ", " in line for line in printed.out.splitlines()
    )
    assert "broken.png is not a readable image" in printed.err
    # (not "[Errno 2] ...")
    assert f"{tmp_path / 'missing.jpg'} does not exist; check the path" in printed.err
    assert "2 of 8 images could not be read" in printed.err


# ---------------------------------------------------------------------------------------------
# Item 11: the lr panel from the schedule, integer epoch ticks
# ---------------------------------------------------------------------------------------------


def test_lr_panel_is_drawn_from_the_schedule_with_whole_epoch_ticks(tmp_path, monkeypatch):
    from timm.scheduler import create_scheduler_v2

    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler, _ = create_scheduler_v2(
        opt,
        "cosine",
        num_epochs=2,
        warmup_epochs=1,
        warmup_prefix=True,
        warmup_lr=0.001,
        step_on_epochs=False,
        updates_per_epoch=4,
    )
    curve = lr_curve(scheduler, 12)
    lrs = [p["lr"] for p in curve]
    assert [p["step"] for p in curve] == list(range(1, 13)) and lrs[0] == pytest.approx(0.001)
    # the warmup, then the decay
    assert lrs[:5] == sorted(lrs[:5]) and lrs[4:] == sorted(lrs[4:], reverse=True)
    assert lrs[4] == pytest.approx(0.1)  # from the peak (warmup_prefix, as the trainer's schedule)
    assert lrs == [scheduler._get_lr(k)[0] for k in range(12)]  # the lr step k + 1 trained with
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [
        {
            "epoch": e,
            "step": 4 * e,
            "train_loss": 1.0,
            "train_acc": 0.5,
            "test_acc": 0.5,
            "lr": lrs[4 * e - 1],
        }
        for e in (1, 2, 3)
    ]
    assert plot_curves(
        rows, tmp_path / "c.png", [{"step": 12, "loss": 1.0, "lr": lrs[-1]}], 4, lr_steps=curve
    )
    # (matplotlib 3.8's backend switch also calls plt.close('all'): the figure is the one that is
    # not a name)
    lr_axis = next(f for f in figures if not isinstance(f, str)).axes[2]
    assert len(lr_axis.lines[0].get_xdata()) == 12  # every step, not the one logged point
    ticks = [t for t in lr_axis.get_xticks() if lr_axis.get_xlim()[0] <= t <= lr_axis.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)


# ---------------------------------------------------------------------------------------------
# Item 12: fine-tuning keeps the weights' normalisation
# ---------------------------------------------------------------------------------------------


def test_init_normalisation_comes_from_the_weights(tmp_path):
    model = create_model("resnet18", "cifar", num_classes=3)
    export_model(model, tmp_path, facts())  # model_config.json beside it
    assert init_normalisation(tmp_path / "model.safetensors", "resnet18")[:2] == (
        (0.5, 0.4, 0.3),
        (0.2, 0.25, 0.3),
    )
    alone = tmp_path / "alone"
    alone.mkdir()
    # travelled without its config
    os.replace(tmp_path / "model.safetensors", alone / "model.safetensors")
    mean, std, source = init_normalisation(alone / "model.safetensors", "resnet18")
    assert (mean, std) == ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3)) and "metadata" in source
    # timm weights: no metadata
    save_file({"fc.weight": torch.zeros(2, 2)}, alone / "timm.safetensors")
    (alone / "model.safetensors").unlink()
    mean, std, source = init_normalisation(alone / "timm.safetensors", "resnet18")
    assert (mean, std) == (
        (0.485, 0.456, 0.406),
        (0.229, 0.224, 0.225),
    ) and "pretrained_cfg" in source


# ---------------------------------------------------------------------------------------------
# End to end: one process with every default, then --init_from on two ranks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("defaults")
    data, out = write_image_folder(tmp / "d", train=4, val=2), tmp / "out"
    old = os.umask(0o022)
    try:
        proc = run_cli([*TINY, "--data_dir", data, "--output_dir", out], timeout=300)
    finally:
        os.umask(old)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout + proc.stderr


def test_defaults_follow_the_data_and_the_outputs_say_what_ran(default_run):
    out, log = default_run
    conf = yaml.safe_load((out / "config.yaml").read_text())
    meta = json.loads((out / "model_config.json").read_text())
    assert 16 <= conf["image_size"] <= 48 and conf["stem"] == "cifar"
    # 'auto': 18 small images fit a quarter of free memory many times over
    assert conf["pipeline"] == "device"
    assert (
        meta["input_size"] == [3, conf["image_size"], conf["image_size"]]
        and meta["stem"] == "cifar"
    )
    # the resolved values, not null/auto
    assert [float(v) for v in conf["mean"].split(",")] == meta["mean"]
    assert f"resolved defaults: --image_size {conf['image_size']}, --stem cifar" in log
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    # the last step of each epoch, though --log_every is 50
    assert [s["step"] for s in steps] == [
        3,
        6,
    ]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
    # model.safetensors and the checkpoints' too (umask 022)
    assert set(modes.values()) == {0o644}, modes
    # model_best.safetensors: the best epoch's (the first of equals) finite weights, that epoch's
    # checkpoint's
    best = check_best(out)
    assert best["epoch"] in (1, 2) and exported_best(out)["step"] == 3 * best["epoch"]
    assert f"--pipeline {conf['pipeline']}" in log


def test_fine_tuning_on_two_ranks_keeps_the_weights_normalisation_and_exports_the_best(
    default_run, tmp_path
):
    first, _ = default_run
    # other images (darker classes): their own mean/std would differ from the first run's
    data = write_image_folder(
        tmp_path / "d",
        train=4,
        val=2,
        seed=1,
        classes={"apple": 20, "banana_split": 60, "cherry-2": 100},
    )
    out = tmp_path / "out"
    proc = launch(
        "2proc_cpu.yaml",
        [
            *TINY,
            "--batch_size",
            "2",
            "--data_dir",
            data,
            "--output_dir",
            out,
            "--init_from",
            first / "model.safetensors",
        ],
        timeout=400,
    )
    log = proc.stdout + proc.stderr
    before, after = (json.loads((d / "model_config.json").read_text()) for d in (first, out))
    assert (after["mean"], after["std"]) == (
        before["mean"],
        before["std"],
    ) and "--init_from: mean/std" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = best_row(rows)
    assert exported_best(out) == {k: best[k] for k in ("epoch", "step", "test_acc")}
    check_best(out)  # its weights: finite, the best epoch's checkpoint's
    with safe_open(str(out / BEST_FILE), "pt") as f:
        assert json.loads(f.metadata()["mean"]) == before["mean"]
    # a checkpoint folder is what evaluate/predict take: it carries the model's facts
    ckpt = sorted((out / "checkpoints").glob("step_*"))[-1]
    model, meta = load_exported(ckpt)
    assert meta["classes"] == after["classes"] and meta["input_size"] == after["input_size"]
    final = load_exported(out)[0].state_dict()
    assert all(torch.equal(v, final[k]) for k, v in model.state_dict().items())
    proc = run_cli(["evaluate", "--checkpoint", ckpt, "--data_dir", data], timeout=120)
    assert proc.returncode == 0 and "test accuracy" in proc.stdout, proc.stderr[-2000:]


def test_auto_stem_fits_the_model_and_the_fine_tuned_weights(tmp_path):
    from accel_train.model.create import (
        cifar_stem_fits,
        init_stem,
        load_init_weights,
        plain_state_dict,
    )

    # --stem auto: the cifar stem only where it applies (a ResNet's single conv1 + maxpool), else
    # timm's own
    assert cifar_stem_fits("resnet18") and not cifar_stem_fits("efficientnet_b0")
    assert not cifar_stem_fits("resnet18d") and not cifar_stem_fits("vit_tiny_patch16_224")
    cfg = TrainConfig(model="efficientnet_b0")
    values, _ = cfg.resolve(info(size=32), "device", cifar_fits=cifar_stem_fits(cfg.model))
    assert values["stem"] == "imagenet"
    # a checkpoint's model.safetensors is the prepared model's (DDP `module.`, compile
    # `_orig_mod.`): it loads, and --init_from takes the folder, whose model_config.json says the
    # stem the weights were trained with
    model = create_model("resnet18", "cifar", num_classes=3)
    prefixed = {f"_orig_mod.module.{k}": v for k, v in model.state_dict().items()}
    assert plain_state_dict(prefixed).keys() == model.state_dict().keys()
    folder = tmp_path / "step_00000004"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in prefixed.items()}, folder / "model.safetensors")
    (folder / "model_config.json").write_text(
        json.dumps({"stem": "cifar", "mean": [0.5] * 3, "std": [0.25] * 3})
    )
    assert init_stem(folder) == "cifar" and init_normalisation(folder, "resnet18")[:2] == (
        (0.5,) * 3,
        (0.25,) * 3,
    )
    fresh = create_model("resnet18", "cifar", num_classes=3)
    assert "loaded" in load_init_weights(fresh, folder)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


def test_resolved_mean_std_round_trip_exactly():
    cfg = TrainConfig(data="imagefolder", data_dir="x")
    clip = DataInfo(
        "imagefolder",
        ("a", "b"),
        (0.48145466, 0.4578275, 0.40821073),
        (0.26862954, 0.26130258, 0.27577711),
        32,
    )
    cfg = with_values(cfg, cfg.resolve(clip, "device")[0])
    # config.yaml -> resume compares equal values
    assert cfg.normalisation() == (
        clip.mean,
        clip.std,
    )


def test_predict_json_keeps_class_names_as_written_and_evaluate_aligns_wide_names(tmp_path, capsys):
    """Chinese class names: predict's JSON printed "\\u72d7" for 狗, and evaluate's per-class table
    was shifted by one column per wide character."""
    from accel_train.commands.evaluate import columns, main_evaluate

    classes = {"狗": 60, "猫咪": 120, "apple": 180}
    data = write_image_folder(tmp_path / "d", train=1, val=2, classes=classes)
    out = tmp_path / "out"
    out.mkdir()
    export_model(
        create_model("resnet18", "cifar", num_classes=3),
        out,
        {
            **facts(),
            **DataInfo(
                "imagefolder", tuple(sorted(classes)), (0.5,) * 3, (0.25,) * 3, 16
            ).model_config(),
        },
    )
    assert main_predict(["--checkpoint", str(out), "--format", "json", str(data / "val")]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(printed) == 6 and {t["class"] for p in printed for t in p["top"]} <= set(classes)
    assert (
        main_predict(["--checkpoint", str(out), "--format", "json", str(data / "val" / "狗")]) == 0
    )
    assert "狗" in capsys.readouterr().out  # (as written: not escaped)
    assert main_evaluate(["--checkpoint", str(out), "--data_dir", str(data)]) == 0
    table = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.split()[0] in (*classes, "class")
    ]
    # (right-aligned numbers)
    assert len(table) == 4 and len({columns(line) for line in table}) == 1, table
    assert columns("狗 a") == 4
