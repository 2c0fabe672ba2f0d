"""What a finished run leaves: tracker logs, curves, config.yaml, and a model that evaluate, predict
and timm's own API can use."""

import json
import re

import numpy as np
import pytest
import timm
import torch
import torch.nn as nn
from conftest import ROOT, launch, run_cli, write_cifar
from PIL import Image
from safetensors.torch import load_file

from accel_train.cli import parse_train_args
from accel_train.commands.evaluate import load_exported
from accel_train.data import CIFAR10


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("finished")
    data = write_cifar(root / "in", rows=(20, 20, 20, 20, 16), test_rows=53, learnable=True, seed=5)
    out = root / "out"
    launch(
        "cpu.yaml",
        [
            "--data",
            "cifar10",
            "--data_dir",
            data,
            "--output_dir",
            out,
            "--epochs",
            "2",
            "--batch_size",
            "16",
            "--log_with",
            "tensorboard",
            "--log_every",
            "2",
            "--ema",
            "--tracker_project",
            "flowers",
            "--run_name",
            "first",
        ],
    )
    return data, out


def test_tensorboard_events_hold_the_scalars(finished):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out = finished
    tags = {}
    for events in out.rglob("events.out.tfevents.*"):
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags[tag] = [e.value for e in acc.Scalars(tag)]
    for tag in (
        "epoch/train_loss",
        "epoch/train_acc",
        "epoch/test_acc",
        "epoch/test_loss",
        "epoch/test_top5",
        "epoch/lr",
        "epoch/images_per_sec",
        "step/train_loss",
        "step/lr",
    ):
        assert tag in tags, sorted(tags)
    assert len(tags["epoch/test_acc"]) == 2 and len(tags["step/train_loss"]) == 96 // 16 * 2 // 2
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert tags["epoch/test_acc"] == pytest.approx([r["test_acc"] for r in rows])
    assert tags["epoch/test_loss"] == pytest.approx([r["test_loss"] for r in rows])
    assert tags["epoch/test_top5"] == pytest.approx([r["test_top5"] for r in rows])
    assert all(r["test_acc"] <= r["test_top5"] <= 1 and r["test_loss"] > 0 for r in rows), rows
    # --tracker_project names the project (not always "accel_train"), --run_name is wandb's run
    # name
    assert {p.parent.relative_to(out).parts[0] for p in out.rglob("events.out.tfevents.*")} == {
        "flowers"
    }
    from accel_train.training.metrics import tracker_init_kwargs

    assert tracker_init_kwargs(["wandb"], 0, "first") == {"wandb": {"name": "first"}}


def test_curves_png_is_a_real_image(finished):
    _, out = finished
    with Image.open(out / "training_curves.png") as img:
        img.verify()
    with Image.open(out / "training_curves.png") as img:
        assert img.format == "PNG" and img.width >= 800 and img.height >= 300
        pixels = np.asarray(img.convert("L"))
    assert pixels.std() > 10, "not a blank canvas"


def test_config_yaml_reproduces_the_run(finished):
    _, out = finished
    cfg = parse_train_args(["--config", str(out / "config.yaml")])
    assert cfg.epochs == 2 and cfg.batch_size == 16 and cfg.ema and cfg.log_with == "tensorboard"
    assert cfg.data == "cifar10" and cfg.output_dir == str(out)


def test_evaluate_prints_the_class_table_and_the_runs_accuracy(finished):
    # 1 and 2 ranks reproducing a run's numbers, EMA and TTA included: tests/test_matrix.py
    data, out = finished
    one = run_cli(["evaluate", "--checkpoint", out, "--data_dir", data, "--batch_size", "8"])
    assert one.returncode == 0, one.stderr[-2000:]
    acc = re.search(r"test accuracy ([\d.]+)% on (\d+) samples \((\d) process", one.stdout).groups()
    assert acc[1:] == ("53", "1")
    table = one.stdout.splitlines()[2:]
    assert [line.split()[0] for line in table] == list(CIFAR10.classes)
    assert sum(int(line.split()[1]) for line in table) == 53
    final = json.loads((out / "model_config.json").read_text())["metrics"]["final_test_acc"]
    assert float(acc[0]) == pytest.approx(100 * final, abs=0.01)
    ema = run_cli(["evaluate", "--checkpoint", out, "--data_dir", data, "--ema", "--tta"])
    assert ema.returncode == 0 and "[EMA] [flip TTA]" in ema.stdout


def test_evaluate_takes_the_best_epoch_and_the_runs_data_folder(finished):
    # evaluate takes model_best.safetensors and the data folder config.yaml records (not
    # ./input_dir)
    data, out = finished
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    best = max(r["test_acc"] for r in rows)
    for how in (["--checkpoint", out, "--best"], ["--checkpoint", out / "model_best.safetensors"]):
        proc = run_cli(["evaluate", *how])  # (no --data_dir: the run's)
        assert proc.returncode == 0, proc.stderr[-2000:]
        # the line names what it evaluated: the file given, or the run's best epoch
        said = proc.stdout.splitlines()[0]
        assert f"from {how[1]}" in said and ("[best epoch]" in said) == ("--best" in how), said
        # (the batch is the run's own, which fit in memory with gradients, not 256 whatever
        # the image size)
        assert (
            "evaluated 53 samples, 16 per process and batch (the run's training batch)"
            in proc.stderr
        )
        acc = float(re.search(r"test accuracy ([\d.]+)% on 53 samples", proc.stdout)[1])
        assert acc == pytest.approx(100 * best, abs=0.01), (proc.stdout, rows)
    image = out.parent / "best.png"
    Image.new("RGB", (40, 40), (30, 90, 200)).save(image)
    one, other = (
        run_cli(["predict", "--checkpoint", *how, "--format", "json", image])
        for how in ([out, "--best"], [out / "model_best.safetensors"])
    )
    assert one.returncode == 0 and one.stdout == other.stdout, one.stderr[-2000:]


def test_predict_prints_top5_for_each_image(finished, tmp_path):
    _, out = finished
    paths = []
    for i, colour in enumerate([(200, 30, 30), (20, 180, 90)]):
        img = Image.new("RGB", (48, 40), colour)
        paths.append(tmp_path / f"img{i}.png")
        img.save(paths[-1])
    proc = run_cli(["predict", "--checkpoint", out, *paths])
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2
    for path, line in zip(paths, lines):
        assert line.startswith(f"{path}: ")
        pairs = re.findall(r"(\w+) ([\d.]+)%", line.split(": ", 1)[1])
        assert len(pairs) == 5 and all(name in CIFAR10.classes for name, _ in pairs)
        probs = [float(p) for _, p in pairs]
        assert probs == sorted(probs, reverse=True) and sum(probs) <= 100.5
    bad = run_cli(["predict", "--checkpoint", out, tmp_path / "missing.png"])
    assert bad.returncode == 2 and "cannot read image" in bad.stderr


def documented_snippet(marker: str) -> str:
    """The README's (or a docs page's) python block that holds `marker`."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    blocks = [
        b
        for page in pages
        for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        if marker in b
    ]
    assert len(blocks) == 1, f"{len(blocks)} python blocks hold {marker!r}"
    return blocks[0]


def test_export_loads_with_timms_own_api_and_scores_as_predict(tmp_path):
    # the documented snippet, run as written, scores an image as predict does (with timm ImageNet's
    # mean/std, bicubic and crop_pct 0.95 instead: 0.781 through timm, 0.971 through predict)
    out = tmp_path / "imagenet_stem"
    launch(
        "cpu.yaml",
        [
            "--stem",
            "imagenet",
            "--train_samples",
            "64",
            "--test_samples",
            "8",
            "--batch_size",
            "32",
            "--epochs",
            "1",
            "--output_dir",
            out,
        ],
    )
    image = tmp_path / "photo.png"  # 96x64: resized to 48x32, then centre-cropped
    Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(
        image
    )
    code = documented_snippet("pretrained_cfg_overlay")
    namespace = {}
    with torch.no_grad():
        exec(code.replace("output_dir/", f"{out}/").replace("cat.png", str(image)), namespace)
    ours, _ = load_exported(out)
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(namespace["model"](x), ours(x), atol=1e-5)
    proc = run_cli(["predict", "--checkpoint", out, "--format", "json", "--top", "10", image])
    predicted = {t["class"]: t["probability"] for t in json.loads(proc.stdout)["top"]}
    timms = namespace["probabilities"][0].tolist()
    assert [predicted[name] for name in CIFAR10.classes] == pytest.approx(timms, abs=1e-4), (
        predicted,
        timms,
    )


def test_cifar_stem_export_loads_with_timm_plus_the_documented_stem_change(finished):
    _, out = finished
    ours, _ = load_exported(out)
    # docs/outputs_and_resume.md: timm.create_model, then this one-line stem change, then load the
    # safetensors
    model = timm.create_model("resnet18", num_classes=10)
    model.conv1, model.maxpool = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.Identity()
    model.load_state_dict(load_file(out / "model.safetensors"))
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model.eval()(x), ours(x), atol=1e-5)


def test_only_the_global_main_process_writes_the_runs_outputs(tmp_path):
    """README: the model is written by the main process only. On two machines each machine's local
    main process is not the main process: machine 1's must not write (checked here in process, not
    only by the root-only two-host test)."""
    from types import SimpleNamespace

    from accel_train.training.exports import main_process_writes

    wrote = []
    for rank, main, local_main in [(0, True, True), (2, False, True), (1, False, False)]:
        acc = SimpleNamespace(
            process_index=rank,
            num_processes=4,
            is_main_process=main,
            is_local_main_process=local_main,
        )
        result = main_process_writes(
            acc, lambda rank=rank: wrote.append(rank) or f"written by {rank}", tmp_path
        )
        assert result == (f"written by {rank}" if main else None)
    assert wrote == [0], wrote


def captured_figures(monkeypatch) -> list:
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", lambda f=None: figures.append(f))
    # (matplotlib's backend switch also calls plt.close('all'): the figures are the non-strings)
    return figures


def test_the_curves_say_only_what_was_logged_and_a_partial_epoch_starts_at_0(tmp_path, monkeypatch):
    # with --log_every >= the steps of an epoch the step-loss line holds more than epoch-end points;
    # a --max_steps run's part of an epoch gets axis ticks from 0, not 0.945-1.05
    from accel_train.training.exports import plot_curves

    figures = captured_figures(monkeypatch)
    rows = [
        {
            "epoch": e,
            "step": 4 * e,
            "train_loss": 1.0 / e,
            "train_acc": 0.5,
            "test_acc": 0.5,
            "lr": 0.1,
        }
        for e in (1, 2, 3)
    ]
    at_ends = [{"step": 4 * e, "loss": 1.0, "lr": 0.1} for e in (1, 2, 3)]
    within = [{"step": k, "loss": 1.0, "lr": 0.1} for k in range(1, 13)]
    for steps, lines in ((at_ends, 1), (within, 2)):
        assert plot_curves(rows, tmp_path / "c.png", steps, 4)
        assert len([f for f in figures if not isinstance(f, str)][-1].axes[0].lines) == lines
    assert plot_curves(
        [{**rows[0], "epoch": 1, "step": 3}],
        tmp_path / "p.png",
        [{"step": k, "loss": 1.0, "lr": 0.1} for k in (1, 2, 3)],
        10,
    )
    for ax in [f for f in figures if not isinstance(f, str)][-1].axes:
        low, high = ax.get_xlim()
        assert low == 0 and 1 <= high < 1.1, (low, high)
        assert [t for t in ax.get_xticks() if low <= t <= high] == [0, 1]


def test_the_lr_panel_of_a_resumed_run_keeps_its_warmup(tmp_path, monkeypatch):
    # after a resume the lr panel draws the schedule from step 1, not only from the resumed step
    # (the steps before from steps.jsonl's few logged points would lose the warmup). Unchanged, the
    # schedule is drawn from step 1; a resume that changes the schedule (--epochs) draws the logged
    # lr before its step
    figures = captured_figures(monkeypatch)
    out = tmp_path / "out"
    args = [
        "--data",
        "random",
        "--train_samples",
        "64",
        "--test_samples",
        "16",
        "--batch_size",
        "8",
        "--image_size",
        "16",
        "--epochs",
        "2",
        "--output_dir",
        out,
    ]
    assert launch("cpu.yaml", [*args, "--max_steps", "5"]).returncode == 0
    rows = {name: (out / name).read_text() for name in ("metrics.jsonl", "steps.jsonl")}
    # the same command again with --resume auto: nothing to train; its rows kept (they were emptied,
    # and model_config.json's metrics were null)
    assert launch("cpu.yaml", [*args, "--max_steps", "5", "--resume", "auto"]).returncode == 0
    assert {name: (out / name).read_text() for name in rows} == rows and rows["metrics.jsonl"]
    assert json.loads((out / "model_config.json").read_text())["metrics"]["step"] == 5
    resumed = launch("cpu.yaml", [*args, "--resume", "auto"])
    assert "resumed from" in resumed.stderr and "step 5" in resumed.stderr, resumed.stderr[-2000:]
    lr = [f for f in figures if not isinstance(f, str)][-1].axes[2].lines[0]
    x, y = list(lr.get_xdata()), list(lr.get_ydata())
    # the warmup
    assert x[0] == 1 / 8 and len(x) == 16 and y[:8] == sorted(y[:8]) and y[0] < y[7] / 10, (
        x,
        y,
    )
    state = json.loads(next((out / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["schedule_since"] == 0
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["test_acc"] is not None
    longer = launch(
        "cpu.yaml", [*args[:-4], "--epochs", "3", "--output_dir", out, "--resume", "auto"]
    )
    assert "resumed from" in longer.stderr, longer.stderr[-2000:]
    state = json.loads(
        sorted((out / "checkpoints").glob("step_*/trainer_state.json"))[-1].read_text()
    )
    assert state["schedule_since"] == 16
