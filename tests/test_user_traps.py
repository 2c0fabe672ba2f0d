"""What a new user trips over: typos, once-per-job lines, the
process count of a named config, a full disk, and start-up refusals that leave nothing behind and
name everything at once.
"""

import json
import os
import re
import subprocess
import time
import types

import pytest
from conftest import TINY, launch, run_cli
from test_imagefolder import write_image_folder
from test_launch import (
    dry_run,
    hw,  # noqa: F401 (a fixture)
    parse,
)

from accel_train import cli, exits, status
from accel_train.cli import IGNORE_ARGS, load_yaml, parse_train_args, train_parser
from accel_train.data import DataError, check_images, decode_all
from accel_train.errors import ConfigError, Preempted
from accel_train.model.create import create_model


def one_error_line(stderr: str) -> str:
    lines = [
        line[line.index("accel-train: error:") :]
        for line in stderr.splitlines()
        if "accel-train: error:" in line
    ]
    assert len(lines) == 1, stderr[-3000:]  # (a progress bar may precede it on its line)
    return lines[0]


# ---- 1. an unknown flag is bad input, with the nearest known flag --------------------------------


@pytest.mark.parametrize(
    "argv,nearest",
    [
        (["--batchsize", "8"], "--batch_size"),
        (["--epocs", "1"], "--epochs"),
        (["--batch-size=8"], "--batch_size"),
        (["--ouput_dir", "x"], "--output_dir"),
    ],
)
def test_unknown_flag_names_the_nearest_known_one(argv, nearest):
    with pytest.raises(
        ConfigError,
        match=f"unknown argument {argv[0].split('=')[0]} \\(did you mean {nearest}\\?\\)",
    ):
        parse_train_args(argv, env={})


def test_every_unknown_argument_is_named_and_a_stray_word_too():
    with pytest.raises(ConfigError) as e:
        parse_train_args(["stray", "--frobnicate", "3", "--epochs", "2"], env={})
    assert "unknown arguments 'stray' (not a flag), --frobnicate;" in str(
        e.value
    ) and IGNORE_ARGS in str(e.value)


def test_platform_arguments_still_accepted_and_others_only_when_named(tmp_path):
    # a ModelArts data_url without --custom_data: the data it holds
    (tmp_path / "cifar-10-batches-py").mkdir()
    cfg = parse_train_args(
        [
            f"--data_url={tmp_path}",
            "--train_url",
            "/out",
            "--init_method",
            "tcp://h:1",
            "--rank",
            "0",
            "--world_size",
            "1",
        ],
        env={},
    )
    assert (cfg.data_dir, cfg.output_dir, cfg.rank, cfg.data) == (
        str(tmp_path),
        "/out",
        0,
        "cifar10",
    )
    env = {IGNORE_ARGS: "--num_gpus, --job_name"}
    cfg = parse_train_args(["--num_gpus=8", "--job_name", "x", "--epochs", "2"], env=env)
    assert cfg.epochs == 2
    with pytest.raises(ConfigError, match="--epocs \\(did you mean --epochs"):
        # a typo is still one
        parse_train_args(["--num_gpus=8", "--epocs", "2"], env=env)
    assert (
        parse_train_args(["--whatever", "1", "--epochs", "3"], env={IGNORE_ARGS: "*"}).epochs == 3
    )
    assert IGNORE_ARGS in " ".join(train_parser().format_help().split())


def test_unknown_flag_exits_2_with_one_line(capsys):
    # (--epochs 0: no training on older code)
    assert cli.main(["--batchsize", "8", "--epochs", "0"]) == 2
    err = capsys.readouterr().err
    assert (
        one_error_line(err).startswith(
            "accel-train: error: unknown argument --batchsize (did you mean --batch_size?)"
        )
        and "Traceback" not in err
    )


# ---- 3. once per job under accelerate launch -----------------------------------------------------


def test_preempted_line_comes_from_the_main_process_only(monkeypatch, capsys):
    def preempted(argv):
        raise Preempted("stopped by SIGTERM at step 3")

    monkeypatch.setitem(cli.COMMANDS, "train", preempted)
    for main_process, printed in (
        (False, ""),
        (True, "accel-train: preempted: stopped by SIGTERM at step 3\n"),
    ):
        monkeypatch.setattr(
            status,
            "process_group",
            lambda main_process=main_process: types.SimpleNamespace(is_main_process=main_process),
        )
        assert cli.main([]) == 4
        assert capsys.readouterr().err == printed


def test_start_up_error_before_the_group_is_said_by_the_first_local_process(monkeypatch, capsys):
    monkeypatch.setattr(exits, "QUIET_EXIT_DELAY_S", 0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    for local_rank, lines in (("1", 0), ("0", 1)):  # torchrun's environment, read by accelerate
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert cli.main(["--epocs", "1", "--epochs", "0"]) == 2
        assert (
            capsys.readouterr().err.count("accel-train: error: unknown argument --epocs") == lines
        )


def test_two_ranks_say_a_bad_flag_once(tmp_path):
    proc = launch(
        "2proc_cpu.yaml",
        ["--epocs", "1", "--epochs", "0", "--output_dir", tmp_path / "out"],
        check=False,
        timeout=180,
    )
    # accelerate launch (torchrun) returns 1 for any failed rank; launch.sh gives 2
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert "unknown argument --epocs (did you mean --epochs?)" in line
    assert "KeyError" not in proc.stderr and "exitcode  : 2" in proc.stderr
    assert not (tmp_path / "out").exists()


# ---- 5. a named config's process count -----------------------------------------------------------


def test_named_one_machine_config_gets_its_process_count():
    _, opts, _ = parse(dry_run({}, ["--accel_config", "2proc_cpu"]))
    assert opts["config"] == "2proc_cpu.yaml" and opts["--num_processes"] == "2"
    _, opts, _ = parse(dry_run({"ACCEL_CONFIG": "2proc_cpu"}))
    assert opts["--num_processes"] == "2"
    _, opts, _ = parse(dry_run({"NPROC_PER_NODE": "3"}, ["--accel_config", "2proc_cpu"]))
    assert opts["--num_processes"] == "3"  # the explicit count wins
    _, opts, _ = parse(dry_run({}, ["--accel_config", "cpu"]))
    assert opts["--num_processes"] == "1"


def test_named_gpu_config_is_capped_by_the_visible_gpus(hw):
    _, opts, _ = parse(dry_run({}, ["--accel_config", "1node_gpu"], bindir=hw(gpus=4)))
    assert opts["config"] == "1node_gpu.yaml" and opts["--num_processes"] == "4"


# ---- 9. a full disk ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real file system with room for about one checkpoint of timm's test_resnet (a tmpfs, root
    only)."""
    import timm

    model_bytes = sum(
        t.numel() * t.element_size() for t in timm.create_model("test_resnet").state_dict().values()
    )
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    # a checkpoint is the weights + the momentum (~2x) and small files
    size_kb = int(model_bytes * 2.6 / 1024)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if proc.returncode != 0:
        pytest.skip(f"mount refused here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def test_full_disk_stops_every_rank_with_one_line_and_keeps_the_newest_checkpoint(small_disk):
    out = small_disk / "out"
    proc = launch(
        "2proc_cpu.yaml",
        [
            "--model",
            "test_resnet",
            "--stem",
            "imagenet",
            "--train_samples",
            "64",
            "--test_samples",
            "8",
            "--batch_size",
            "4",
            "--epochs",
            "1",
            "--max_steps",
            "4",
            "--checkpoint_every",
            "1",
            "--plot",
            "false",
            "--timeout_s",
            "120",
            "--output_dir",
            out,
        ],
        check=False,
        timeout=240,
    )
    line = one_error_line(proc.stderr)
    assert "cannot write checkpoint step_00000002" in line and "No space left on device" in line, (
        line
    )
    assert (
        f"newest complete checkpoint is {out}/checkpoints/step_00000001" in line
        and "--resume auto" in line
    )
    # no trainer traceback: the one left is torchrun's own ChildFailedError summary (exit 1, README)
    assert (
        "exitcode  : 2" in proc.stderr
        and proc.stderr.count("Traceback (most recent call last)") == 1
    )
    assert "SafetensorError" not in proc.stderr
    # no .tmp-step_2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]


def test_an_export_that_cannot_be_written_is_one_line_and_resume_auto_writes_it(tmp_path):
    # the main process's exports (the run's model here) get the same treatment as a checkpoint
    # write: one line, exit 2, and the line's advice works (no step is trained again)
    out = tmp_path / "out"
    # os.replace onto it fails: an OSError
    (out / "model.safetensors" / "in_the_way").mkdir(parents=True)
    run = [
        *TINY,
        "--train_samples",
        "64",
        "--test_samples",
        "8",
        "--batch_size",
        "16",
        "--epochs",
        "2",
        "--output_dir",
        out,
    ]
    proc = run_cli(run)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = one_error_line(proc.stderr)
    assert (
        f"cannot write the run's outputs in {out} (Is a directory)" in line
        and "--resume auto" in line
    ), line
    (out / "model.safetensors" / "in_the_way").rmdir()
    (out / "model.safetensors").rmdir()
    assert not list(out.glob(".tmp-*")), list(out.iterdir())  # (no half-written export left)
    # an earlier run's note to its peers (exits.note_bad_input)
    note = out / ".bad_input.elsewhere.1"
    note.write_text("bad input of an earlier run")
    os.utime(note, (time.time() - 60, time.time() - 60))
    proc = run_cli([*run, "--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not note.exists()  # removed by the next run that writes the directory
    # nothing trained again
    assert (out / "model.safetensors").is_file() and "train loss" not in proc.stderr


# ---- 10. start-up refusals -----------------------------------------------------------------------


def test_refused_start_removes_the_output_dir_it_created_and_names_every_bad_image(tmp_path):
    data = write_image_folder(tmp_path / "images")
    bad = sorted((data / "train").rglob("*.png"))[:3]
    for path in bad:
        path.write_bytes(b"not an image")
    existing = tmp_path / "existing"
    existing.mkdir()
    out = existing / "new" / "run"
    proc = run_cli(
        [
            "--data",
            "imagefolder",
            "--data_dir",
            data,
            "--image_size",
            "16",
            "--batch_size",
            "4",
            "--output_dir",
            out,
        ]
    )
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "3 files are not readable images" in line and all(str(p) in line for p in bad), line
    assert existing.is_dir() and not (existing / "new").exists()


def test_bad_images_are_listed_up_to_a_limit(tmp_path):
    files = []
    for i in range(13):
        files.append(tmp_path / f"bad_{i:02d}.png")
        files[-1].write_bytes(b"nope")
    for check in (check_images, lambda f: decode_all(f, 16)):
        with pytest.raises(DataError) as e:
            check(files)
        text = str(e.value)
        assert (
            text.startswith("13 files are not readable images: ")
            and len(re.findall(r"bad_\d\d\.png", text)) == 10
        )
        assert "and 3 more; replace or remove them" in text


def test_unknown_model_gets_the_nearest_names():
    with pytest.raises(ConfigError, match="unknown timm model 'resnet_18'; did you mean resnet18"):
        create_model("resnet_18")


def test_yaml_error_gives_its_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("epochs: 3\nbatch_size: 4\n  lr: 0.1\n")
    with pytest.raises(
        ConfigError, match="is not valid YAML \\(line 3, column 5: mapping values are not allowed"
    ):
        load_yaml(path)


def test_own_interrupted_run_started_again_suggests_resume_auto(tmp_path):
    out = tmp_path / "out"
    ckpt = out / "checkpoints" / "step_00000006"
    ckpt.mkdir(parents=True)
    meta = {
        "epoch": 1,
        "step": 6,
        "batch_in_epoch": 2,
        "run_id": "abc123",
        "run": {
            "model": "resnet18",
            "stem": "cifar",
            "model_kwargs": {},
            "seed": 42,
            "data": "random",
        },
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(meta))
    args = [
        "--train_samples",
        "32",
        "--test_samples",
        "8",
        "--batch_size",
        "8",
        "--output_dir",
        out,
    ]
    line = one_error_line(run_cli(args).stderr)
    assert (
        "holds an unfinished run with these settings (newest checkpoint: step 6, in epoch 2);"
        " continue it with --resume auto" in line
    ), line
    # another run's: the message as before
    line = one_error_line(run_cli([*args, "--seed", "7"]).stderr)
    assert "already holds checkpoints of another run" in line
    assert sorted(p.name for p in out.rglob("*")) == [
        "checkpoints",
        "step_00000006",
        "trainer_state.json",
    ]
    # the quick start's command run twice is your own finished run, not "another
    # run"
    (out / "model.safetensors").write_bytes(b"w")
    # (an epoch's end)
    (ckpt / "trainer_state.json").write_text(json.dumps({**meta, "batch_in_epoch": 0}))
    line = one_error_line(run_cli(args).stderr)  # (the epoch done, not the next: said "epoch 2")
    assert (
        "holds your finished run with these settings (model.safetensors written, last checkpoint"
        " step 6, the end of epoch 1)"
        in line
        and "--resume auto with a larger --epochs" in line
        and "--overwrite true" in line
    ), line


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--drop-path", "0.1"], "here: --drop_path"),
        (["--layer-decay", "0.75"], "here: --layer_decay"),
        (["--color-jitter", "0.4"], "here: --color_jitter"),
        (["--smoothing", "0.1"], "here: --label_smoothing"),
        (["--model-ema"], "here: --ema"),
        (["-b", "64"], "here: --batch_size"),
    ],
)
def test_timm_train_flags_are_refused_with_what_this_trainer_does_instead(argv, says):
    """timm's --sched, --aa and --opt adamw are named with what this trainer does instead, not
    "did you mean --seed?", "--data?" or the hint to let them through ACCEL_TRAIN_IGNORE_ARGS (which
    would train SGD with one warning: a different run than asked for).
    """
    for env in (
        {},
        {IGNORE_ARGS: argv[0]},
        {IGNORE_ARGS: "*"},
    ):
        # never let through, even when named
        with pytest.raises(ConfigError) as e:
            parse_train_args([*argv, "--epochs", "1"], env=env)
        text = str(e.value)
        assert says in text and "timm train.py" in text, text
        assert "did you mean" not in text and IGNORE_ARGS not in text, text


def test_messages_say_what_is_wrong(tmp_path, capsys):
    from safetensors.torch import save_file

    from accel_train.commands.evaluate import load_exported
    from accel_train.commands.predict import main_predict
    from accel_train.config.defaults import infer_data
    from accel_train.data.cifar import read_cifar10
    from accel_train.data.folders import image_folder_splits

    # a file where a folder is expected
    (tmp_path / "images.zip").write_bytes(b"PK")
    with pytest.raises(ConfigError, match=r"--data_dir \S+images.zip is a file, not a folder"):
        infer_data(str(tmp_path / "images.zip"), False)
    for read in (read_cifar10, image_folder_splits):
        with pytest.raises(DataError, match=r"images.zip is a file, not a folder"):
            read(tmp_path / "images.zip")
    # a damaged weights file is said as damaged, not as a model that does not fit
    run = tmp_path / "run"
    run.mkdir()
    save_file(create_model(TINY[1], "imagenet", 10).state_dict(), run / "model.safetensors")
    (run / "model_config.json").write_text(
        json.dumps(
            {
                "architecture": TINY[1],
                "stem": "imagenet",
                "num_classes": 10,
                "input_size": [3, 32, 32],
            }
        )
    )
    load_exported(run)  # (whole, it loads)
    with open(run / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        ConfigError, match=r"model.safetensors is damaged: not a complete safetensors file"
    ):
        load_exported(run)
    # a YAML value of the wrong type names the file and its key
    (tmp_path / "c.yaml").write_text("epochs: ten\n")
    with pytest.raises(
        ConfigError, match=r"--config \S+c.yaml: key epochs: 'ten' is not a valid int"
    ):
        parse_train_args(["--config", str(tmp_path / "c.yaml")])
    # --help names the other commands in its first lines; predict's --top has its help
    head = train_parser().format_help().splitlines()[:3]
    assert any("evaluate | predict | preflight | smoke" in line for line in head), head
    with pytest.raises(SystemExit):
        main_predict(["--help"])
    assert re.search(r"--top K +the K most likely classes", capsys.readouterr().out)
