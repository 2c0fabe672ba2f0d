"""A resumed run leaves what the uninterrupted run leaves: its rows, its best model, its newest checkpoint."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from accel_train.outputs import exported_best

from conftest import TINY, run_cli

pytestmark = pytest.mark.slow


def small(out, *extra):
    # 256 random samples, global batch 32: 8 optimizer steps per epoch, 2 epochs
    return [*TINY, "--train_samples", "256", "--test_samples", "64", "--epochs", "2", "--batch_size", "32",
            "--output_dir", out, *extra]


def ok(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def stopped_mid_epoch(tmp_path_factory):
    """The same run uninterrupted ("full") and stopped by --max_steps 12 (4 steps into epoch 2), then resumed
    ("part"); --lr 1.0 --seed 16: the partial epoch 2 evaluates better than epoch 1, the whole epoch 2 does not."""
    root = tmp_path_factory.mktemp("stopped")
    args = ["--lr", "1.0", "--seed", "16", "--log_every", "5"]
    full = ok(run_cli(small(root / "full", *args)))
    ok(run_cli(small(root / "part", *args, "--max_steps", "12")))
    stopped = rows(root / "part" / "metrics.jsonl"), rows(root / "part" / "steps.jsonl")
    resumed = ok(run_cli(small(root / "part", *args, "--resume", "auto")))
    return root / "full", root / "part", stopped, resumed


def test_a_max_steps_stop_mid_epoch_then_resume_keeps_the_best_model(stopped_mid_epoch):
    full, part, (stop_rows, _), resumed = stopped_mid_epoch
    e1, e2 = (r["test_acc"] for r in rows(full / "metrics.jsonl"))
    assert stop_rows[1]["step"] == 12 and stop_rows[1]["test_acc"] > e1 >= e2, (stop_rows, e1, e2)  # the scenario
    assert exported_best(full)["epoch"] == 1  # the uninterrupted run's best: epoch 1
    # the stop evaluated the partial epoch 2 (a row of its own, better than epoch 1's) but did not replace the best
    # model with its weights: the resume drops that row and has epoch 1's file still
    assert exported_best(part) == exported_best(full), exported_best(part)
    assert "is not on this disk" not in resumed.stderr, resumed.stderr[-2000:]
    b1, b2 = load_file(full / "model_best.safetensors"), load_file(part / "model_best.safetensors")
    assert all(torch.equal(b1[k], b2[k]) for k in b1)

