"""A second new-user trial (another is in test_readme.py): a --resume auto that finds nothing says
so, stop lines start a line of their own under tqdm's bar, config.yaml records the precision used, a
one-class folder is refused, and the words of the start-up and done lines, of a file as --output_dir
and of an empty image."""

import json
import re
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import ROOT, TEST_CPU, TINY, clean_env, launch, run_cli, steps_logged, wait_for
from test_imagefolder import write_image_folder

from accel_train.config.train_config import TrainConfig
from accel_train.data import DataInfo, build_data, decode_image
from accel_train.data.images import check_images
from accel_train.errors import ConfigError

SMALL = [
    *TINY,
    "--train_samples",
    "16",
    "--test_samples",
    "8",
    "--batch_size",
    "16",
    "--epochs",
    "1",
]


def errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if "error" in line.lower()]


# Item 2: --resume auto after a run killed before its first checkpoint
def test_resume_auto_that_finds_nothing_says_so_and_that_the_logged_steps_are_lost(tmp_path):
    out = tmp_path / "out"
    out.mkdir()  # what `kill -9` of a --checkpoint_every 0 run leaves: logged steps, no checkpoint
    (out / "steps.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 2.3, "lr": 0.1}) + "\n" for s in (1, 2, 3))
    )
    proc = run_cli([*SMALL, "--resume", "auto", "--output_dir", out])
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "--resume auto: nothing to resume" in line]
    assert (
        len(said) == 1
        and "starts at step 1" in said[0]
        and "up to step 3" in said[0]
        and "lost" in said[0]
    ), said
    # a warning, naming the directory: a mistyped --output_dir trains from scratch
    assert " WARNING " in said[0] and str(out / "checkpoints") in said[0], said
    # a first run with --resume auto (launch.sh's relaunches pass it): the line, without lost steps
    proc = run_cli([*SMALL, "--resume", "auto", "--output_dir", tmp_path / "fresh"])
    said = [line for line in proc.stderr.splitlines() if "--resume auto: nothing to resume" in line]
    assert len(said) == 1 and "lost" not in said[0], said


# Item 3: the stop line after Ctrl-C starts a line of its own, though tqdm's bar is open (a real
# process, bar on)
@pytest.mark.faults
def test_ctrl_c_line_is_not_glued_to_the_progress_bar(tmp_path):
    out, log = tmp_path / "out", tmp_path / "run.log"
    env = clean_env()
    env.pop("TQDM_DISABLE")  # the bar a user sees (clean_env turns it off for every other test)
    cmd = [
        sys.executable,
        "-m",
        "accel_train",
        "--train_samples",
        "64",
        "--test_samples",
        "16",
        "--batch_size",
        "16",
        "--epochs",
        "100",
        "--log_every",
        "1",
        "--mixed_precision",
        "no",
        "--output_dir",
        str(out),
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
    try:
        # epoch 1's line was logged under the open bar
        wait_for(lambda: steps_logged(out) >= 6, timeout=240)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 4
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_bytes().decode()  # (read_text would turn each carriage return into a newline)
    assert "\rtrain:" in text  # the bar was drawn, redrawn after carriage returns
    # (not splitlines: a carriage return does not start a line on a terminal)
    lines = text.split("\n")
    stop = [line for line in lines if "accel-train: preempted: stopped by SIGINT" in line]
    assert len(stop) == 1 and stop[0].startswith("accel-train: preempted: "), stop
    # log lines under the open bar are tqdm.write's: the bar's line is cleared (carriage return,
    # blanks, carriage return) and the line written from its start, as a terminal shows it
    shown = [line.rsplit("\r", 1)[-1] for line in lines if " INFO " in line]
    assert any("epoch 1/100" in line for line in shown) and all(
        re.match(r"\d\d:\d\d:\d\d ", line) for line in shown
    ), shown


# Item 9: config.yaml records the precision the run used, not 'auto'
def test_config_yaml_records_the_precision_used(tmp_path):
    out = tmp_path / "out"
    # cpu.yaml states none: the device's fastest
    proc = launch("cpu.yaml", [*SMALL, "--output_dir", out])
    used = "bf16" if TEST_CPU == "bf16" else "no"  # (the pinned CPU's facts: conftest.TEST_CPUS)
    assert f"[DistributedType.NO, {used}]" in proc.stderr, proc.stderr[-3000:]
    assert yaml.safe_load((out / "config.yaml").read_text())["mixed_precision"] == used


# Item 12: the words of the start-up and done lines
def test_start_up_and_done_lines_read_right(tmp_path):
    proc = run_cli([*SMALL, "--output_dir", tmp_path / "out"])
    assert "1 step/epoch" in proc.stderr and "1 steps/epoch" not in proc.stderr
    done = [line for line in proc.stderr.splitlines() if " done in " in line]
    # (the start-up line names the model's wrappers)
    assert len(done) == 1 and "| model " not in done[0], done


def test_describe_says_1_class_not_1_classes():
    images = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    one = DataInfo("imagefolder", ("cat",), (0.5,) * 3, (0.25,) * 3, 8)
    data = build_data(
        TrainConfig(batch_size=2, image_size=8),
        "cpu",
        splits={"test": (images, torch.zeros(4).long())},
        info=one,
        eval_only=True,
    )
    assert "1 class at 8x8" in data.describe()


# Item 11: a one-class folder is refused in one line (exit 2), before anything trains
def test_one_class_folder_is_refused(tmp_path):
    data = write_image_folder(tmp_path / "d", train=4, val=2, classes={"apple": 40})
    proc = run_cli(
        [
            "--data",
            "imagefolder",
            "--data_dir",
            data,
            "--batch_size",
            "4",
            "--output_dir",
            tmp_path / "out",
        ]
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    said = errors(proc.stderr)
    assert len(said) == 1 and "one class" in said[0] and "apple" in said[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


# Item 12: a file as --output_dir; an empty image file
def test_a_file_as_output_dir_says_so(tmp_path):
    (tmp_path / "out").write_text("a file")
    proc = run_cli([*SMALL, "--output_dir", tmp_path / "out"])
    assert proc.returncode == 2
    said = errors(proc.stderr)
    assert len(said) == 1 and "is a file, not a directory" in said[0], proc.stderr[-3000:]


def test_an_empty_image_file_is_named_empty(tmp_path):
    empty = tmp_path / "empty.png"
    empty.write_bytes(b"")
    with pytest.raises(
        ConfigError, match=r"empty\.png is not a readable image \(empty file, 0 bytes\)"
    ):
        decode_image(empty, 8)
    with pytest.raises(ConfigError, match=r"empty file, 0 bytes"):
        check_images([empty])
