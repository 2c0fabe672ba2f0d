import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, run_cli

from accel_train.cli import load_yaml, parse_train_args, train_parser
from accel_train.config.train_config import TrainConfig
from accel_train.errors import ConfigError


def test_defaults_live_in_trainconfig():
    cfg = parse_train_args([])
    assert cfg == TrainConfig()
    assert cfg.model == "resnet18" and cfg.stem == "auto" and cfg.data == "random"
    assert cfg.data_dir == "input_dir" and cfg.output_dir == "output_dir"


def test_modelarts_flags_both_forms_and_aliases():
    cfg = parse_train_args(
        [
            "--data_url=/in",
            "--train_url",
            "/out",
            "--custom_data",
            "false",
            "--init_method",
            "tcp://10.0.0.1:6666",
            "--rank=1",
            "--world_size",
            "2",
            "--enable_gpu=true",
            "--epochs=3",
            "--lr",
            "0.05",
        ]
    )
    assert cfg.data_dir == "/in" and cfg.output_dir == "/out" and cfg.data == "cifar10"
    assert cfg.init_method == "tcp://10.0.0.1:6666" and cfg.rank == 1 and cfg.world_size == 2
    assert cfg.enable_gpu is True and cfg.epochs == 3 and cfg.lr == 0.05
    assert parse_train_args(["--custom_data=true"]).data == "random"
    # (they agree)
    assert parse_train_args(["--custom_data", "True", "--data", "random"]).data == "random"


def test_bool_flags_and_optional_values():
    assert parse_train_args(["--channels_last"]).channels_last is True
    assert parse_train_args(["--augment", "false"]).augment is False
    assert parse_train_args(["--augment=no", "--ema"]).ema is True
    cfg = parse_train_args(["--max_steps", "5", "--clip_grad=1.5", "--train_samples", "64"])
    assert (cfg.max_steps, cfg.clip_grad, cfg.train_samples) == (5, 1.5, 64)


def test_unknown_platform_arguments_named_in_the_environment_warn_once(caplog):
    cfg = parse_train_args(
        ["--epochs", "2", "--ma_something=1", "--other_flag", "x"],
        env={"ACCEL_TRAIN_IGNORE_ARGS": "--ma_something,--other_flag"},
    )
    assert cfg.epochs == 2
    warnings = [r for r in caplog.records if "ignoring arguments named in" in r.getMessage()]
    assert len(warnings) == 1 and "--ma_something=1" in warnings[0].getMessage()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
        (["--epochs", "-1"], "--epochs must be >= 1"),
        (["--data", "imagenet"], "invalid choice"),
        (["--augment", "maybe"], "expected true or false"),
        (["--batch_size", "0"], "--batch_size must be >= 1"),
    ],
)
def test_bad_values_are_one_line_errors(argv, match):
    with pytest.raises(ConfigError, match=match):
        parse_train_args(argv)


def test_bad_input_from_the_command_line_exits_2_with_one_line(tmp_path):
    # a real process: its whole stderr (refused before torch is imported: 0.3 s)
    proc = run_cli(["--lr", "abc", "--output_dir", tmp_path / "out"], fresh=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "accel-train: error: argument --lr: invalid float value: 'abc' (see accel-train --help)"
    ]
    assert not (tmp_path / "out").exists()


def test_config_yaml_round_trip(tmp_path):
    cfg = parse_train_args(["--epochs", "7", "--model", "resnet34", "--ema", "--lr", "0.3"])
    cfg.save_yaml(tmp_path / "config.yaml")
    again = parse_train_args(["--config", str(tmp_path / "config.yaml")])
    assert again == cfg
    override = parse_train_args(["--config", str(tmp_path / "config.yaml"), "--epochs", "2"])
    assert override.epochs == 2 and override.model == "resnet34"


def test_config_yaml_unknown_key(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"epochs": 2, "lr_typo": 1}))
    with pytest.raises(ConfigError, match="unknown key.*lr_typo"):
        load_yaml(tmp_path / "c.yaml")


def test_help_is_grouped_with_defaults_and_version():
    text = train_parser().format_help()
    for group in ("data:", "model:", "optimisation:", "checkpointing:", "logging:"):
        assert group in text
    assert "(default: resnet18)" in text and "--data_url" in text and "--train_url" in text
    out = subprocess.run(
        [sys.executable, "-m", "accel_train", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.startswith("accel_train ")


def test_help_says_each_default_once_and_starts_the_way_the_readme_does(capsys):
    """--help was 347 lines: 29 options ended in "(default: None)" after their text gave the real
    default, --augment described only the CIFAR pad crop, the description started with `accelerate
    launch` while the README starts with `python -m accel_train`, and --data_dir's input_dir read as
    a placeholder."""
    from accel_train.commands.evaluate import main_evaluate
    from accel_train.commands.predict import main_predict
    from accel_train.commands.preflight import main_preflight

    text = train_parser().format_help()
    # (a real default is still shown)
    assert "(default: None)" not in text and "(default: 30)" in text
    assert len(text.splitlines()) < 320
    description = text.split("options:")[0]
    readme = (ROOT / "README.md").read_text()
    assert "python -m accel_train" in readme.split("## Quick start")[1].split("```")[1]
    assert description.index("python -m accel_train") < description.index("accelerate launch")
    joined = " ".join(text.split())

    def help_of(flag, following):
        return joined[joined.index(flag) : joined.index(following)]

    augment = help_of("--augment [BOOL]", "--hflip [BOOL]")
    assert "RandomResizedCrop" in augment and "--aa" in augment and "padded" in augment
    data_dir = help_of("--data_dir DATA_DIR", "--image_size IMAGE_SIZE")
    assert "./input_dir" in data_dir and "random data" in data_dir
    for command in (main_evaluate, main_predict, main_preflight):
        with pytest.raises(SystemExit):
            command(["--help"])
        assert "(default: None)" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "text,match",
    [
        ("pipeline: gpu\n", r"--pipeline 'gpu': invalid choice; pick one of auto, device, cpu"),
        ("stem: cifar10\n", r"--stem 'cifar10': invalid choice; pick one of auto, cifar, imagenet"),
        ("data: imagenet\n", r"--data 'imagenet': invalid choice"),
        ("compile_mode: fastest\n", r"--compile_mode 'fastest': invalid choice"),
        ("epochs: [3]\n", r"--epochs must be a int, got \[3\]"),
        ("lr: .inf\n", "--lr must be a finite number, got inf"),
        ("clip_grad: .nan\n", "--clip_grad must be a finite number, got nan"),
        ("ema: maybe\n", r"c.yaml: key ema: 'maybe' is not a valid true/false"),
    ],
)
def test_config_yaml_values_get_the_checks_flags_get(tmp_path, text, match):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match):
        parse_train_args(["--config", str(tmp_path / "c.yaml")])


def test_every_check_lives_in_trainconfig():
    with pytest.raises(ConfigError, match="--pipeline 'gpu': invalid choice"):
        TrainConfig(pipeline="gpu")
    with pytest.raises(ConfigError, match="--stem 'cifar10': invalid choice"):
        TrainConfig(stem="cifar10")
    with pytest.raises(ConfigError, match="--num_workers 2 needs --pipeline cpu"):
        TrainConfig(pipeline="device", num_workers=2)
    # ints where floats go
    assert TrainConfig(pipeline="cpu", num_workers=2, lr=1, clip_grad=2).lr == 1


@pytest.mark.parametrize(
    "flag",
    [
        "--lr",
        "--clip_grad",
        "--warmup_epochs",
        "--lr_base",
        "--min_lr",
        "--momentum",
        "--weight_decay",
        "--label_smoothing",
        "--ema_decay",
    ],
)
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_flag_values_are_refused(flag, value):
    with pytest.raises(ConfigError, match=f"{flag} must be"):
        parse_train_args([f"{flag}={value}"])


def test_non_finite_lr_exits_2_before_anything_is_written(tmp_path):
    # a real process: its whole stderr (refused before torch is imported: 0.3 s)
    proc = run_cli(["--lr", "inf", "--output_dir", tmp_path / "out"], fresh=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "accel-train: error: --lr must be a finite number, got inf"
    ]
    assert not (tmp_path / "out").exists()


def test_custom_data_never_silently_overrides_an_explicit_data(tmp_path):
    # the seed's alias and --data that disagree on the command line: one line, exit 2, nothing
    # trained
    from test_imagefolder import write_image_folder

    # (bf16: test_resnet at 16 px meets the bad bf16 kernel, refused as asked)
    tiny = [
        "--model",
        "test_resnet",
        "--batch_size",
        "4",
        "--epochs",
        "1",
        "--max_steps",
        "1",
        "--test_samples",
        "4",
        "--mixed_precision",
        "no",
    ]
    proc = run_cli(
        [*tiny, "--custom_data", "false", "--data", "imagefolder", "--output_dir", tmp_path / "x"]
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "--custom_data false" in errors[0] and "--data imagefolder" in errors[0], errors[0]
    assert not (tmp_path / "x").exists()
    # a --custom_data run: config.yaml records the data it resolved to, not the seed's alias
    seeded = tmp_path / "seeded"
    proc = run_cli([*tiny, "--train_samples", "8", "--custom_data", "true", "--output_dir", seeded])
    assert proc.returncode == 0, proc.stderr[-2000:]
    conf = yaml.safe_load((seeded / "config.yaml").read_text())
    assert conf["data"] == "random" and conf["custom_data"] is None
    # replayed with another --data (flags override the file), from that file and from one that still
    # carries the alias (written before): the flag's data is what trains
    folder = write_image_folder(tmp_path / "d", train=4, val=2)
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({**conf, "data": "cifar10", "custom_data": False}))
    for i, path in enumerate((seeded / "config.yaml", old)):
        out = tmp_path / f"replay{i}"
        proc = run_cli(
            [
                "--config",
                path,
                "--data",
                "imagefolder",
                "--data_dir",
                folder,
                "--output_dir",
                out,
                "--image_size",
                "16",
                "--mean",
                "0.5,0.5,0.5",
                "--std",
                "0.25,0.25,0.25",
            ]
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert " on imagefolder, " in proc.stderr, proc.stderr[-2000:]
        assert yaml.safe_load((out / "config.yaml").read_text())["data"] == "imagefolder"


def test_the_data_kind_is_what_data_dir_holds_and_a_folder_of_neither_is_refused(tmp_path):
    """`--data_dir /photos` without --data trains on the photos, never on random noise, silently, a
    whole run."""
    (tmp_path / "c" / "cifar-10-batches-py").mkdir(parents=True)
    (tmp_path / "f" / "train" / "cat").mkdir(parents=True)
    (tmp_path / "none" / "photos").mkdir(parents=True)
    assert parse_train_args(["--data_dir", str(tmp_path / "c")]).data == "cifar10"
    assert parse_train_args(["--data_dir", str(tmp_path / "f")]).data == "imagefolder"
    assert parse_train_args([]).data == "random"  # the embedded default: no --data_dir, random data
    # as asked
    assert (
        parse_train_args(["--data_dir", str(tmp_path / "f"), "--data", "random"]).data == "random"
    )
    assert (
        parse_train_args(["--data_url", str(tmp_path / "f"), "--custom_data", "true"]).data
        == "random"
    )
    for folder, says in (
        ("none", "holds neither cifar-10-batches-py/"),
        ("missing", "does not exist"),
    ):
        with pytest.raises(ConfigError, match=says):
            parse_train_args(["--data_dir", str(tmp_path / folder)])


def test_a_data_dir_of_neither_kind_exits_2_with_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["--data_dir", tmp_path, "--output_dir", out, "--epochs", "1"], timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(errors) == 1 and "--data random" in errors[0], proc.stderr
    assert not out.exists()
