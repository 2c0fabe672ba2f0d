"""config/resolved.py: what start-up decided beside what was asked, and config.yaml's formats (the
one before the format had a number still reads)."""

import dataclasses

import pytest
import yaml

from accel_train.cli import load_yaml, parse_train_args
from accel_train.config.resolved import RESOLVED, Resolved, with_values
from accel_train.config.train_config import TrainConfig
from accel_train.errors import ConfigError

# A config.yaml as the release before format 2 wrote it (its whole text, from a run of
# `--data random --train_samples 64 --test_samples 32 --epochs 1 --batch_size 16`)
FORMAT_1 = """\
# accel_train resolved configuration: `accel-train --config config.yaml` reproduces it
data: random
data_dir: input_dir
image_size: 32
train_samples: 64
test_samples: 32
val_split: null
pipeline: device
device_data_mb: null
augment: true
hflip: true
train_crop: pad
scale: 0.08,1
ratio: 3/4,4/3
train_interpolation: bilinear
crop_pct: null
color_jitter: 0.0
aa: null
reprob: 0.0
mean: 0.4914,0.4822,0.4465
std: 0.247,0.2435,0.2616
num_workers: 0
model: resnet18
stem: cifar
model_kwargs: null
channels_last: true
init_from: null
pretrained: false
pretrained_path: null
freeze: null
drop_path: 0.0
drop_rate: 0.0
compile: false
compile_mode: default
epochs: 1
max_steps: null
patience: null
batch_size: 16
lr: null
lr_base: null
optimizer: sgd
layer_decay: null
sched: cosine
sched_kwargs: null
min_lr: 0.0
momentum: 0.9
weight_decay: null
label_smoothing: 0.1
mixup: 0.0
cutmix: 0.0
warmup_epochs: 1.0
grad_accum: 1
clip_grad: null
seed: 42
ema: false
ema_decay: 0.999
tta: false
output_dir: OUT
checkpoint_every: 0
checkpoint_minutes: null
keep_checkpoints: 2
resume: null
overwrite: false
timeout_s: 300
heartbeat_s: 2.0
heartbeat_timeout_s: 15.0
hang_report_s: 30.0
stop_on_hang: false
log_with: null
tracker_project: accel_train
run_name: null
log_every: 50
log_all_ranks: false
plot: false
threads: null
ddp_bucket_cap_mb: 25
ddp_grad_as_bucket_view: true
mixed_precision: bf16
force_precision: false
custom_data: null
enable_gpu: null
init_method: null
rank: null
world_size: null
"""


def run_settings(**changed):
    """A run's settings as start-up leaves them: what was asked, with the automatic ones
    resolved."""
    asked = TrainConfig(data="random", epochs=3, **changed)
    return asked, with_values(
        asked,
        dict(
            image_size=32,
            stem="cifar",
            mean="0.5,0.4,0.3",
            std="0.2,0.25,0.3",
            pipeline="device",
            train_crop="pad",
            batch_size=16,
            num_workers=0,
            mixed_precision="bf16",
            channels_last=True,
        ),
    )


def test_the_record_of_what_start_up_decided_and_what_was_asked(tmp_path):
    asked, settings = run_settings(lr=0.05)
    before = dataclasses.asdict(asked)
    record = Resolved.of(settings, asked, ["a note"])
    assert dataclasses.asdict(asked) == before  # a new config; the asked one is only read
    assert (record.image_size, record.batch_size, record.mixed_precision) == (32, 16, "bf16")
    assert record.asked == {
        "image_size": None,
        "stem": "auto",
        "mean": None,
        "std": None,
        "pipeline": "auto",
        "train_crop": "auto",
        "batch_size": None,
        "num_workers": None,
        "mixed_precision": "auto",
        "channels_last": None,
    }
    assert record.notes == ("a note",) and set(RESOLVED) <= {
        f.name for f in dataclasses.fields(record)
    }
    # config.yaml: the run's settings at the top (what --config replays), what was asked beside
    settings.save_yaml(tmp_path / "config.yaml", record.asked)
    text = (tmp_path / "config.yaml").read_text()
    assert text.startswith("# accel_train configuration, format 2")
    raw = yaml.safe_load(text)
    assert raw["format"] == 2 and raw["batch_size"] == 16 and raw["lr"] == 0.05
    assert raw["asked"] == record.asked
    replayed = parse_train_args(["--config", str(tmp_path / "config.yaml")])
    assert replayed == settings  # every setting as the run trained
    assert "asked" not in load_yaml(tmp_path / "config.yaml")
    # a value the run keeps as asked is not repeated under asked:
    settings.save_yaml(tmp_path / "again.yaml", record.asked, mixed_precision="auto")
    assert "mixed_precision" not in yaml.safe_load((tmp_path / "again.yaml").read_text())["asked"]


def test_a_config_yaml_written_before_the_format_had_a_number_still_loads_and_resumes(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text(FORMAT_1.replace("OUT", str(out)))
    cfg = parse_train_args(["--config", str(out / "config.yaml")])
    assert (cfg.batch_size, cfg.stem, cfg.mean, cfg.mixed_precision, cfg.train_samples) == (
        16,
        "cifar",
        "0.4914,0.4822,0.4465",
        "bf16",
        64,
    )
    # a resume of that run takes its settings from it, as it did
    cfg = parse_train_args(["--output_dir", str(out), "--resume", "auto", "--epochs", "2"])
    assert (cfg.epochs, cfg.batch_size, cfg.train_samples) == (2, 16, 64)
    assert cfg.taken.settings["train_samples"] == 64 and "--train_samples 64" in cfg.taken.said


def test_a_config_yaml_of_a_newer_format_is_refused_in_one_line(tmp_path):
    _, settings = run_settings()
    settings.save_yaml(tmp_path / "config.yaml")
    raw = yaml.safe_load((tmp_path / "config.yaml").read_text())
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "format": 3}))
    with pytest.raises(ConfigError, match="format 3 is written by a newer accel_train") as e:
        parse_train_args(["--config", str(tmp_path / "config.yaml")])
    assert "\n" not in str(e.value)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({**raw, "asked": [1]}))
    with pytest.raises(ConfigError, match="asked must be a mapping"):
        parse_train_args(["--config", str(tmp_path / "config.yaml")])
