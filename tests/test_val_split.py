"""A folder with train/ only: --val_split holds out a seeded, per-class part of it as the evaluation
split, the same files on every rank and resume, which evaluate and predict --held_out read; and a
resume that names no data flag continues on the run's own data (its config.yaml), where a named flag
that conflicts is refused naming both.
"""

import json
import re
import shutil

import numpy as np
import pytest
from conftest import TINY, clean_env, launch, run_cli
from PIL import Image

from accel_train.data.folders import held_out, scan_split

# unbalanced: 0.25 holds out 3 (2.5 rounded half up), 2 and 2
COUNTS = {
    "dark": 10,
    "mid": 6,
    "light": 8,
}
LEVELS = {"dark": 30, "mid": 128, "light": 225}


def train_only(root, counts=COUNTS):
    rng = np.random.default_rng(0)
    for name, n in counts.items():
        d = root / "train" / name
        d.mkdir(parents=True)
        for i in range(n):
            pixels = np.clip(LEVELS[name] + rng.integers(-20, 21, (20, 24, 3)), 0, 255).astype(
                np.uint8
            )
            # (a space in the name, as a phone's export has)
            Image.fromarray(pixels).save(d / f"photo {i}.png")
    return root


def rows(out):
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


def errors(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]


def test_the_hold_out_is_per_class_seeded_and_independent_of_where_the_folder_lies(tmp_path):
    a, b = train_only(tmp_path / "a"), tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    picks = {}
    for root, seed in ((a, 42), (b, 42), (a, 7)):
        classes, files, labels = scan_split(root / "train")
        (train, _), (test, test_labels) = held_out(
            root / "train", classes, files, labels, 0.25, seed
        )
        assert np.bincount(test_labels).tolist() == [3, 2, 2] and len(train) + len(test) == 24
        assert not set(train) & set(test)
        picks[root, seed] = [f.relative_to(root).as_posix() for f in test]
    assert picks[a, 42] == picks[b, 42] != picks[a, 7]


@pytest.mark.parametrize(
    "case", ["a class gets none", "val/ exists too", "not an image folder", "out of range"]
)
def test_a_hold_out_that_cannot_be_is_one_line(tmp_path, case):
    data = train_only(
        tmp_path / "d", {"dark": 10, "mid": 3} if case == "a class gets none" else COUNTS
    )
    if case == "val/ exists too":
        shutil.copytree(data / "train", data / "val")
    args = {
        "a class gets none": ["--val_split", "0.1"],
        "val/ exists too": ["--val_split", "0.2"],
        "not an image folder": ["--val_split", "0.2", "--data", "random"],
        "out of range": ["--val_split", "1"],
    }[case]
    proc = run_cli(
        [*TINY, "--data_dir", data, *args, "--epochs", "1", "--output_dir", tmp_path / "out"]
    )
    said = {
        "a class gets none": (
            f"--val_split 0.1 leaves class mid (3 images in {data / 'train' / 'mid'}) none held "
            "out; raise --val_split to at least 0.17, or add a val/<class>/ folder"
        ),
        "val/ exists too": (
            f"--val_split 0.2 holds out part of {data / 'train'}, but {data / 'val'} is an "
            "evaluation split already; drop --val_split"
        ),
        "not an image folder": (
            "--val_split holds out part of an image folder's train/; random data has a test "
            "split of its own"
        ),
        "out of range": "--val_split is the fraction of each class held out, in (0, 1); got 1",
    }[case]
    assert proc.returncode == 2 and len(errors(proc)) == 1 and said in errors(proc)[0], proc.stderr[
        -2000:
    ]
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.launches
def test_two_ranks_train_on_the_hold_out_and_a_bare_resume_continues_the_run(tmp_path):
    data, out, home = train_only(tmp_path / "d"), tmp_path / "out", tmp_path / "home"
    small = [*TINY, "--image_size", "16", "--batch_size", "4", "--log_every", "1"]
    env = clean_env(XDG_CACHE_HOME=str(home))
    # the decoded cache: the two parts of train/ are two caches, neither taken for a stale one of
    # the other
    launch(
        "2proc_cpu.yaml",
        [
            *small,
            "--data_dir",
            data,
            "--val_split",
            "0.25",
            "--epochs",
            "1",
            "--pipeline",
            "cache",
            "--output_dir",
            out,
        ],
        env=env,
    )
    (row,) = rows(out)
    # 17 to train on: 2 steps of 2 x 4
    assert (row["test_samples"], row["train_samples"]) == (
        7,
        16,
    ), row
    caches = sorted(p.name for p in (home / "accel_train" / "decoded").glob("*.npy"))
    assert len(caches) == 2 and {re.search(r"_(fit|val)0\.25s42-", c).group(1) for c in caches} == {
        "fit",
        "val",
    }
    # continuing the finished run from its folder: no data flag on the command line (the model
    # named: the run's)
    proc = launch(
        "2proc_cpu.yaml", [*TINY, "--output_dir", out, "--resume", "auto", "--epochs", "2"], env=env
    )
    said = [
        line
        for line in proc.stderr.splitlines()
        if f"resume: the run's own settings from {out / 'config.yaml'}, where this" in line
    ]
    assert len(said) == 1, proc.stderr[-3000:]  # (said once, by the main process)
    assert all(
        f in said[0] for f in ("--data imagefolder ", f"--data_dir {data} ", "--val_split 0.25 ")
    ), said
    assert "--epochs" not in said[0], said  # (named here)
    assert [(r["epoch"], r["test_samples"], r["train_samples"]) for r in rows(out)] == [
        (1, 7, 16),
        (2, 7, 16),
    ]
    # a data flag named that conflicts with the run: refused, naming both
    proc = run_cli(
        [*TINY, "--output_dir", out, "--resume", "auto", "--epochs", "3", "--data", "random"]
    )
    assert (
        proc.returncode == 2
        and "--data 'random' differs from the checkpoint's 'imagefolder'" in errors(proc)[0]
    ), proc.stderr[-2000:]
    # evaluate reads the held-out files (the run's split, by its seed): the last row's accuracy on
    # its 7 samples
    proc = run_cli(["evaluate", "--checkpoint", out])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"test accuracy {rows(out)[-1]['test_acc']:.2%} on 7 samples" in proc.stdout, proc.stdout
    classes, files, labels = scan_split(data / "train")
    expected = held_out(data / "train", classes, files, labels, 0.25, 42)[1][0]
    proc = run_cli(["predict", "--checkpoint", out, "--held_out", "--format", "json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [json.loads(r)["file"] for r in proc.stdout.splitlines()] == [str(f) for f in expected]
