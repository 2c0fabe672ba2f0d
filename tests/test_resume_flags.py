"""A resume and each flag: every TrainConfig field is refused, applied (and logged), or free."""

import dataclasses
import json
import shutil

import pytest
import torch
import yaml
from conftest import TINY, run_cli
from timm.scheduler import create_scheduler_v2

from accel_train.config.train_config import TrainConfig

# a changed value of each field on resume; a new TrainConfig field without a row here fails the test
# below
REFUSED = {  # the run's math: one line naming the flag, exit 2
    "data": "cifar10",
    "custom_data": "false",
    "image_size": "16",
    "augment": "false",
    "hflip": "false",
    "mean": "0.5,0.5,0.5",
    "std": "0.5,0.5,0.5",
    "model": "resnet10t",
    "stem": "cifar",
    "model_kwargs": '{"drop_rate": 0.1}',
    "seed": "7",
    "batch_size": "16",
    "grad_accum": "2",
    "train_samples": "224",
    # the optimizer's state is its optimizer's; layer decay on (or off) and --freeze change its
    # parameter groups
    "optimizer": "adamw",
    "layer_decay": "0.5",
    "freeze": "layer1",
    "val_split": "0.2",  # (random data: refused; an image folder's: its training files)
    "train_crop": "random_resized",
    "scale": "0.2,1",
    "ratio": "1/2,2",
    "train_interpolation": "bicubic",
    "color_jitter": "0.4",
    "aa": "rand-m9-mstd0.5",
    "reprob": "0.25",
}
APPLIED = {  # take effect from the resumed step, logged (--epochs: test_resume's schedule test)
    "epochs": "3",
    "lr": "0.05",
    "lr_base": "0.4",
    "min_lr": "0.001",
    "warmup_epochs": "0.5",
    "momentum": "0.5",
    "weight_decay": "0.01",
    "label_smoothing": "0.2",
    "clip_grad": "5",
    "ema": "true",
    "ema_decay": "0.99",
    "mixed_precision": None,  # (whichever the checkpoint did not use)
    "sched": "tanh",
    "sched_kwargs": '{"cycle_decay": 0.5}',
    "drop_path": "0.1",
    "drop_rate": "0.1",
    "mixup": "0.2",
    "cutmix": "0.5",
}
# leave the weights' math alone: paths, logging, checkpointing, performance, evaluation only;
# init_from: the checkpoint's weights win; max_steps: where this run stops
FREE = {
    "data_dir",
    "test_samples",
    "pipeline",
    "device_data_mb",
    "num_workers",
    "channels_last",
    "init_from",
    "compile",
    "compile_mode",
    "max_steps",
    "patience",
    "tta",
    "output_dir",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "overwrite",
    "timeout_s",
    "heartbeat_s",
    "heartbeat_timeout_s",
    "hang_report_s",
    "stop_on_hang",
    "threads",
    "log_with",
    "tracker_project",
    "run_name",
    "log_every",
    "log_all_ranks",
    "plot",
    "ddp_bucket_cap_mb",
    "ddp_grad_as_bucket_view",
    "force_precision",
    "enable_gpu",
    "init_method",
    "rank",
    "world_size",
    "checkpoint_minutes",
    "trust_model_code",
    "pretrained",
    "pretrained_path",  # (as init_from)
    "crop_pct",  # (an image folder's evaluation only)
}


def small(out, *extra):
    # 256 random samples, global batch 32: 8 optimizer steps per epoch
    return [
        *TINY,
        "--train_samples",
        "256",
        "--test_samples",
        "32",
        "--epochs",
        "2",
        "--batch_size",
        "32",
        "--log_every",
        "1",
        "--output_dir",
        out,
        *extra,
    ]


def test_every_field_is_refused_applied_or_free():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    kinds = [set(REFUSED), set(APPLIED), FREE]
    missing = [n for n in names if sum(n in kind for kind in kinds) != 1]
    assert not missing, (
        f"classify each TrainConfig field once (refused, applied or free) and test it: {missing}"
    )
    assert set().union(*kinds) == set(names)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    out = tmp_path_factory.mktemp("flags") / "out"
    proc = run_cli(small(out, "--max_steps", "3"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_a_resume_refuses_each_change_of_the_runs_math(stopped, tmp_path):
    out = shutil.copytree(stopped, tmp_path / "out")
    for name, value in REFUSED.items():
        proc = run_cli([*small(out, "--resume", "auto"), f"--{name}", value])
        errors = [
            line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")
        ]
        # (the seed's alias is --data cifar10)
        flag = {"custom_data": "data", "optimizer": "opt"}.get(name, name)
        assert proc.returncode == 2 and len(errors) == 1 and f"--{flag}" in errors[0], (
            name,
            proc.stderr[-2000:],
        )
    # weight decay switched off (or on) changes the optimizer's parameter groups: refused, not a
    # corrupt-checkpoint error
    proc = run_cli([*small(out, "--resume", "auto"), "--weight_decay", "0"])
    assert (
        proc.returncode == 2
        and "--weight_decay 0 cannot follow the checkpoint's 0.0005" in proc.stderr
    ), proc.stderr[-2000:]


def test_a_resume_applies_and_logs_each_optimisation_setting(stopped, tmp_path):
    out = shutil.copytree(stopped, tmp_path / "out")
    ckpt = json.loads((out / "checkpoints" / "step_00000003" / "trainer_state.json").read_text())
    used = ckpt["run"]["settings"]["mixed_precision"] if "settings" in ckpt["run"] else "bf16"
    changed = {**APPLIED, "mixed_precision": "no" if used != "no" else "bf16"}
    del changed["epochs"]
    args = [a for name, value in changed.items() for a in (f"--{name}", value)]
    # (the suite's CPU has no bf16)
    forced = ["--force_precision"] if changed["mixed_precision"] == "bf16" else []
    proc = run_cli([*small(out, "--resume", "auto", "--max_steps", "4"), *args, *forced])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "applied from step 4" in line]
    assert len(said) == 1 and all(f"--{name} " in said[0] for name in changed), proc.stderr[-3000:]
    # in effect: the optimizer's settings after the resumed step (its checkpoint) are the flags',
    # not the first run's
    groups = torch.load(out / "checkpoints" / "step_00000004" / "optimizer.bin", weights_only=True)[
        "param_groups"
    ]
    assert {g["momentum"] for g in groups} == {0.5}
    # (norm and bias parameters: no decay)
    assert sorted(g["weight_decay"] for g in groups) == [
        0.0,
        0.01,
    ]
    # the step trained with the lr of the new schedule (--lr, --min_lr, --warmup_epochs, --sched,
    # --sched_kwargs)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.05)
    sched, _ = create_scheduler_v2(
        opt,
        "tanh",
        num_epochs=1.5,
        warmup_epochs=0.5,
        warmup_prefix=True,
        min_lr=0.001,
        warmup_lr=0.05 / 100,
        step_on_epochs=False,
        updates_per_epoch=8,
        cycle_decay=0.5,
    )
    sched.step_update(3)
    step4 = [json.loads(r) for r in (out / "steps.jsonl").read_text().splitlines()][-1]
    assert step4["step"] == 4 and step4["lr"] == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9)
    # the precision it trained in
    assert f", {changed['mixed_precision']}] on 1 machine" in proc.stderr
    assert (out / "model_ema.safetensors").is_file()  # --ema switched on
    # config.yaml says the values the run used
    conf = yaml.safe_load((out / "config.yaml").read_text())
    assert (conf["momentum"], conf["weight_decay"], conf["lr"]) == (0.5, 0.01, 0.05)


def test_a_checkpoint_of_an_earlier_version_says_its_schedule_changes(stopped, tmp_path):
    """Checkpoints written before the warmup_prefix schedule record no settings: a resume of one
    says in a line that the lr now follows the new schedule (+5% at epoch 15 of 30, not silent).
    """
    out = shutil.copytree(stopped, tmp_path / "out")
    state = out / "checkpoints" / "step_00000003" / "trainer_state.json"
    meta = json.loads(state.read_text())
    del meta["run"]["settings"]
    state.write_text(json.dumps(meta))
    proc = run_cli([*small(out, "--resume", "auto", "--max_steps", "4")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [ln for ln in proc.stderr.splitlines() if "a checkpoint of an earlier accel_train" in ln]
    assert len(said) == 1 and "from step 4 on the lr follows this version's schedule" in said[0], (
        proc.stderr[-3000:]
    )


def test_a_resume_takes_every_setting_the_command_line_leaves_out_from_the_runs_record(tmp_path):
    from accel_train.cli import parse_train_args

    out = tmp_path / "run"
    out.mkdir()
    run = TrainConfig(
        model="test_resnet",
        epochs=3,
        lr=0.01,
        label_smoothing=0.2,
        max_steps=4,
        num_workers=1,
        data="random",
        train_samples=128,
        output_dir=str(out),
    )
    run.save_yaml(out / "config.yaml")
    cfg = parse_train_args(["--output_dir", str(out), "--resume", "auto"])
    assert (cfg.model, cfg.epochs, cfg.lr, cfg.label_smoothing, cfg.train_samples) == (
        "test_resnet",
        3,
        0.01,
        0.2,
        128,
    )
    # this invocation's own: where it stops, the machine's workers, what it resumes
    assert (cfg.max_steps, cfg.num_workers, cfg.resume) == (None, TrainConfig().num_workers, "auto")
    assert cfg.taken.said.startswith(f"resume: the run's own settings from {out / 'config.yaml'}")
    assert (
        "--epochs 3" in cfg.taken.said
        and "--lr 0.01" in cfg.taken.said
        and "--model test_resnet" in cfg.taken.said
    )
    assert "max_steps" not in cfg.taken.said and "num_workers" not in cfg.taken.said
    # a flag typed here wins; the others are still the run's
    cfg = parse_train_args(["--output_dir", str(out), "--resume", "auto", "--epochs", "5"])
    assert (cfg.epochs, cfg.lr) == (5, 0.01) and "--epochs" not in cfg.taken.said
    # a --resume PATH reads the record beside its checkpoints
    ckpt = out / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    cfg = parse_train_args(["--output_dir", str(tmp_path / "elsewhere"), "--resume", str(ckpt)])
    assert (cfg.epochs, cfg.lr) == (3, 0.01)
    # another kind of data named: the settings resolved for the run's data are not taken (the data
    # itself is then refused against the checkpoint, naming --data)
    run.crop_pct, run.data, run.pipeline = 0.95, "imagefolder", "cache"
    run.save_yaml(out / "config.yaml")
    cfg = parse_train_args(["--output_dir", str(out), "--resume", "auto", "--data", "random"])
    assert (cfg.data, cfg.crop_pct, cfg.pipeline, cfg.epochs) == ("random", None, "auto", 3)
    run.data, run.pipeline, run.crop_pct = "random", "auto", None
    run.save_yaml(out / "config.yaml")
    # no resume, no record: the defaults
    assert parse_train_args(["--output_dir", str(out)]).epochs == TrainConfig().epochs
    # model code is imported only when named: a script passes it to train(), the command line types
    # --model
    run.model = "my_pkg.nets:small_net"
    run.save_yaml(out / "config.yaml")
    cfg = parse_train_args(["--output_dir", str(out), "--resume", "auto"])
    assert (cfg.model, cfg.epochs) == (TrainConfig().model, 3)
    # launch.sh's relaunch of an --overwrite run types its whole command line again; the record may
    # be the replaced run's: only its data is taken
    cfg = parse_train_args(["--output_dir", str(out), "--resume", "auto", "--overwrite", "true"])
    assert (cfg.epochs, cfg.train_samples) == (TrainConfig().epochs, 128)
