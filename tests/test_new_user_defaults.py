"""A second new-user trial: defaults that do not waste a small data set,
fixed-size timm models at another size, --stem auto that says why, a schedule that reaches its peak
(and curves that show the lr each step used), and predict's machine-readable formats.

Pure functions are tested in process; one-step runs go through run_cli (in this process)."""

import json

import pytest
import torch
import yaml
from conftest import run_cli
from test_imagefolder import write_image_folder

from accel_train.checkpoint.resume import reconcile
from accel_train.commands.evaluate import load_exported
from accel_train.config.defaults import dropped_note
from accel_train.config.resolved import with_values
from accel_train.config.train_config import TrainConfig
from accel_train.data import DataInfo
from accel_train.errors import ConfigError
from accel_train.model.create import create_model
from accel_train.training.exports import lr_curve, lr_of_step
from accel_train.training.startup import schedule

# ---------------------------------------------------------------------------------------------
# Item 8: the peak lr is reached; the lr panel shows the lr each step used
# ---------------------------------------------------------------------------------------------


def sgd(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_the_schedule_reaches_the_peak_after_the_warmup():
    # the run: 7 steps per epoch, 2 epochs, 1 warmup epoch, peak 0.025 (main: 0.0215 at step
    # 7, then 0.0125)
    cfg = TrainConfig(epochs=2, warmup_epochs=1, lr=0.025)
    scheduler = schedule(cfg, sgd(0.025), 1, 7)
    lrs = [lr_of_step(scheduler, step) for step in range(1, 15)]
    assert lrs[0] == 0.025 / 100 and lrs[:8] == sorted(lrs[:8])  # the warmup: steps 1..7
    assert lrs[7] == 0.025 and max(lrs) == 0.025  # step 8 trains at the peak the start line names
    # then the cosine, towards 0
    assert lrs[7:] == sorted(lrs[7:], reverse=True) and lrs[-1] < 0.002


def test_the_schedule_with_the_warmup_as_long_as_the_run():
    cfg = TrainConfig(epochs=1, warmup_epochs=1, lr=0.1)
    lrs = [lr_of_step(schedule(cfg, sgd(0.1), 1, 4), step) for step in range(1, 5)]
    assert lrs == sorted(lrs) and lrs[-1] < 0.1


def test_the_lr_panel_keeps_the_logged_lr_before_a_resume():
    # a run of 1 epoch (8 steps) extended to 2 on resume: steps 1..8 trained on the 1-epoch schedule
    # (steps.jsonl says so), the rest on the rebuilt one; the curve must show the jump, not the
    # rebuilt schedule from step 1
    logged = [{"step": 4, "loss": 1.0, "lr": 0.02}, {"step": 8, "loss": 1.0, "lr": 0.0001}]
    scheduler = schedule(TrainConfig(epochs=2, warmup_epochs=1, lr=0.025), sgd(0.025), 1, 8)
    curve = lr_curve(scheduler, 16, logged=logged, since=8)
    assert curve[:2] == [{"step": 4, "lr": 0.02}, {"step": 8, "lr": 0.0001}]
    assert [p["step"] for p in curve[2:]] == list(range(9, 17)) and curve[2]["lr"] == 0.025


# ---------------------------------------------------------------------------------------------
# Item 6: a timm model built for a fixed size trains at another
# ---------------------------------------------------------------------------------------------


def test_a_fixed_size_timm_model_is_built_for_the_runs_size(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(
        [
            "--model",
            "vit_tiny_patch16_224",
            "--image_size",
            "32",
            "--train_samples",
            "16",
            "--test_samples",
            "8",
            "--batch_size",
            "8",
            "--epochs",
            "1",
            "--max_steps",
            "1",
            "--mixed_precision",
            "no",
            "--output_dir",
            out,
        ]
    )
    # main: timm's AssertionError from the patch embedding, exit 1
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "vit_tiny_patch16_224 is built for 224 px: img_size=32 passed to timm.create_model"
        in proc.stderr
    )
    model, meta = load_exported(out)  # evaluate and predict build it at the size it was trained at
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_a_fixed_size_model_without_img_size_is_refused_in_one_line(monkeypatch):
    import timm

    real = timm.create_model

    def no_img_size(name, **kwargs):
        if "img_size" in kwargs:
            raise TypeError("__init__() got an unexpected keyword argument 'img_size'")
        return real(name, **kwargs)

    monkeypatch.setattr(timm, "create_model", no_img_size)
    with pytest.raises(
        ConfigError,
        match=r"test_vit is built for 160 px and takes no img_size; train it with "
        r"--image_size 160, or pick a model without a fixed input size",
    ):
        create_model("test_vit", "imagenet", image_size=32)


# ---------------------------------------------------------------------------------------------
# Item 7: --stem auto says why it keeps timm's stem at a small size
# ---------------------------------------------------------------------------------------------


def info(size=32):
    return DataInfo("imagefolder", ("a", "b", "c"), (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), size)


def test_auto_stem_says_why_a_model_keeps_timms_stem_at_32_px():
    _, line = TrainConfig(model="efficientnet_b0").resolve(info(32), "device", cifar_fits=False)
    assert (
        "--stem imagenet (efficientnet_b0 has no ResNet conv1 + maxpool for the cifar stem to"
        " replace: timm's stem unchanged; --stem cifar fits resnet18-style models)" in line
    )
    # a ResNet: nothing to explain
    assert "--stem cifar," in TrainConfig().resolve(info(32), "device")[1]
    # above 64 px: the documented rule
    assert "--stem imagenet," in TrainConfig().resolve(info(96), "device")[1]


# ---------------------------------------------------------------------------------------------
# Item 5: the default batch follows the data's size; a given one that drops much is said
# ---------------------------------------------------------------------------------------------


def test_the_default_batch_fits_a_small_data_set():
    cfg = TrainConfig(data="imagefolder")
    assert cfg.batch_size is None  # automatic until the data is known
    values, line = cfg.resolve(info(32), "device", train_size=240, num_processes=1)
    # main: 128, one step an epoch and 112 of 240 images dropped; the asked config is only read
    assert values["batch_size"] == 16 and cfg.batch_size is None
    assert (
        "--batch_size 16 (240 training samples: 15 steps an epoch, none dropped; 128 would give 1"
        " step and drop 112)" in line
    )
    for samples, processes, grad_accum in (
        (240, 1, 1),
        (240, 2, 1),
        (1000, 1, 2),
        (50, 4, 1),
        (1300, 1, 1),
        (7, 1, 1),
    ):
        asked = TrainConfig(grad_accum=grad_accum)
        cfg = with_values(
            asked, asked.resolve(info(32), "device", train_size=samples, num_processes=processes)[0]
        )
        step = cfg.batch_size * processes * grad_accum
        # at most a tenth dropped where the data has 10 steps of the smallest batch (2: BatchNorm's
        # least)
        assert samples % step <= 0.1 * samples or samples // step < 10 and cfg.batch_size == 2, (
            samples,
            step,
        )
    values, line = TrainConfig().resolve(info(32), "device", train_size=50000, num_processes=2)
    assert "--batch_size 128" in line
    assert values["batch_size"] == 128  # a large data set keeps the recipe's batch
    values, line = TrainConfig(batch_size=128).resolve(info(32), "device", train_size=240)
    assert "batch_size" not in line and "batch_size" not in values


def test_a_given_batch_that_drops_much_of_the_data_is_said_in_one_line():
    note = dropped_note(128, 1, 240, 1)
    assert (
        note
        == "--batch_size 128 leaves 112 of the 240 training samples (47%) out of every epoch (an"
        " epoch is whole global batches of 128); --batch_size 16 (the default for this data)"
        " drops none"
    )
    assert dropped_note(16, 1, 240, 1) is None
    assert dropped_note(64, 1, 1000, 1) is None  # 40 of 1000: under 10%


def test_a_small_image_folder_trains_at_the_default_batch_it_resolves(tmp_path):
    root = write_image_folder(tmp_path / "d", train=30, val=4)  # 90 training images
    proc = run_cli(
        [
            "--data",
            "imagefolder",
            "--data_dir",
            root,
            "--model",
            "test_resnet",
            "--epochs",
            "1",
            "--max_steps",
            "1",
            "--mixed_precision",
            "no",
            "--output_dir",
            tmp_path / "out",
        ]
    )
    # main: 90 samples cannot fill one batch of 128
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "--batch_size 8 (90 training samples: 11 steps an epoch, 2 dropped; 128 would not fill one"
        " batch)" in proc.stderr
    )
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["batch_size"] == 8
    given = run_cli(
        [
            "--data",
            "imagefolder",
            "--data_dir",
            root,
            "--model",
            "test_resnet",
            "--epochs",
            "1",
            "--max_steps",
            "1",
            "--mixed_precision",
            "no",
            "--batch_size",
            "64",
            "--output_dir",
            tmp_path / "o2",
        ]
    )
    assert given.returncode == 0, given.stderr[-3000:]  # kept, and said (main: nothing said)
    assert (
        "--batch_size 64 leaves 26 of the 90 training samples (29%) out of every epoch"
        in given.stderr
    )


def test_a_resume_keeps_the_checkpoints_global_batch():
    old = dict(
        global_batch=16,
        batch_size=16,
        num_processes=1,
        num_machines=1,
        grad_accum=1,
        epochs=2,
        seed=42,
    )
    for processes, per in ((1, 16), (2, 8)):
        # the default batch: not re-derived from the data, the checkpoint's global batch kept
        assert reconcile({"step": 4, "run": old}, TrainConfig(), processes, print) == {
            "batch_size": per
        }


# ---------------------------------------------------------------------------------------------
# Item 10: predict --format json|csv, unambiguous for any file name
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def exported(tmp_path):
    from accel_train.training.exports import export_model

    out = tmp_path / "out"
    out.mkdir()
    export_model(
        create_model("test_resnet", "imagenet", num_classes=3),
        out,
        {
            "architecture": "test_resnet",
            "stem": "imagenet",
            **info(16).model_config(),
            "model_kwargs": {},
        },
    )
    images = write_image_folder(tmp_path / "d", train=1, val=1) / "val"
    # a comma, a space and quotes: ambiguous in the text format
    odd = images / "apple" / 'a, "b".png'
    next((images / "apple").glob("*.png")).rename(odd)
    (images / "apple" / "broken.png").write_bytes(b"not a png")
    return out, images, odd


def test_predict_json_is_one_object_per_image(exported, capsys):
    from accel_train.commands.predict import main_predict

    out, images, odd = exported
    code = main_predict(["--checkpoint", str(out), "--top", "2", "--format", "json", str(images)])
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 2 and len(records) == 4  # every file, the unreadable one too (exit 2 as in text)
    by_file = {r["file"]: r for r in records}
    assert "not a readable image" in by_file[str(images / "apple" / "broken.png")]["error"]
    top = by_file[str(odd)]["top"]
    assert [set(t) for t in top] == [{"class", "probability"}] * 2 and top[0]["class"] in (
        "a",
        "b",
        "c",
    )
    assert (
        top[0]["probability"] >= top[1]["probability"]
        and sum(t["probability"] for t in top) <= 1 + 1e-6
    )


def test_predict_csv_quotes_what_needs_it(exported, capsys):
    import csv
    import io

    from accel_train.commands.predict import main_predict

    out, images, odd = exported
    code = main_predict(["--checkpoint", str(out), "--format", "csv", str(images)])
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert code == 2 and len(rows) == 4
    # --top 5 of 3 classes: 3
    assert list(rows[0]) == [
        "file",
        "class_1",
        "probability_1",
        "class_2",
        "probability_2",
        "class_3",
        "probability_3",
        "error",
    ]
    row = next(r for r in rows if r["file"] == str(odd))  # the name survives its comma and quotes
    assert row["error"] == "" and {row[f"class_{n}"] for n in (1, 2, 3)} == {"a", "b", "c"}
    assert sum(float(row[f"probability_{n}"]) for n in (1, 2, 3)) == pytest.approx(1, abs=1e-5)
    assert (
        "not a readable image" in next(r for r in rows if r["file"].endswith("broken.png"))["error"]
    )


def test_the_default_batch_is_at_least_2_and_an_automatic_one_is_not_warned_about(tmp_path):
    """Tiny data gets a batch of at least 2 (batch 1: BatchNorm's traceback on a 1x1 map, exit 1),
    and the dropped-data warning says nothing of the automatic batch itself (not '--batch_size 1
    ... the default for this data drops 4')."""
    from accel_train.config.defaults import auto_batch

    assert (
        auto_batch(12, 8) == 2
        and auto_batch(3, 1) == 2
        and auto_batch(40, 2) == 2
        and auto_batch(4000, 1) == 128
    )
    run = [
        "--model",
        "test_resnet",
        "--mixed_precision",
        "no",
        "--data",
        "random",
        "--test_samples",
        "8",
        "--epochs",
        "1",
        "--plot",
        "false",
    ]
    fine = run_cli(
        [*run, "--train_samples", "45", "--grad_accum", "2", "--output_dir", tmp_path / "a"]
    )
    assert (
        fine.returncode == 0
        and "--batch_size 2 (45 training samples: 11 steps an epoch, 1 dropped" in fine.stderr
    )
    assert "leaves" not in fine.stderr, fine.stderr[-2000:]
    tiny = run_cli(
        [*run, "--train_samples", "12", "--grad_accum", "8", "--output_dir", tmp_path / "b"]
    )
    errors = [ln for ln in tiny.stderr.splitlines() if ln.startswith("accel-train: error:")]
    assert tiny.returncode == 2 and len(errors) == 1 and "Traceback" not in tiny.stderr, (
        tiny.stderr[-2000:]
    )
