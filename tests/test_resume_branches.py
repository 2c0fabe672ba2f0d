"""A resumed run leaves what the uninterrupted run leaves: its rows, its best model, its newest checkpoint."""

import json

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
    ("part"); --lr 1.0 --seed 11: the partial epoch 2 evaluates better than epoch 1, the whole epoch 2 does not."""
    root = tmp_path_factory.mktemp("stopped")
    args = ["--lr", "1.0", "--seed", "11", "--log_every", "5"]  # (found by trying seeds, fp32 facts)
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


def test_a_resumed_run_writes_the_rows_the_uninterrupted_run_writes(stopped_mid_epoch):
    full, part, (_, stop_steps), _ = stopped_mid_epoch
    assert [r["step"] for r in stop_steps] == [5, 8, 10, 12]  # the stop's own row: short runs have rows too ...
    want, got = rows(full / "steps.jsonl"), rows(part / "steps.jsonl")
    # ... which the resume drops: every --log_every (5) steps and each epoch's last step (8, 16), as uninterrupted
    assert [r["step"] for r in got] == [r["step"] for r in want] == [5, 8, 10, 15, 16]
    # flat lists: pytest 9.2's approx refuses nested sequences (a list of tuples raised TypeError)
    assert [v for r in got for v in (r["loss"], r["lr"])] == pytest.approx(
        [v for r in want for v in (r["loss"], r["lr"])], rel=1e-5
    )
    # an epoch row's lr is the lr its last step trained with (that step's row), not the next step's (0 at the end)
    for out in full, part:
        lr_at = {r["step"]: r["lr"] for r in rows(out / "steps.jsonl")}
        assert [r["lr"] for r in rows(out / "metrics.jsonl")] == [lr_at[8], lr_at[16]]
        assert lr_at[16] > 0


def test_resuming_an_older_checkpoint_abandons_the_newer_ones(tmp_path):
    out = tmp_path / "out"
    ckpts = out / "checkpoints"
    ok(run_cli(small(out, "--checkpoint_every", "2")))
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000014", "step_00000016"]
    uninterrupted = load_file(out / "model.safetensors")
    # back to step 14, one step on: step 16 belongs to the branch this run abandons
    proc = ok(run_cli(small(out, "--checkpoint_every", "2", "--resume", ckpts / "step_00000014", "--max_steps", "15")))
    assert "step_00000016" in proc.stderr and "abandon" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000014", "step_00000015"]
    # --resume auto continues the newest work: this run's step 15, not the abandoned step 16
    proc = ok(run_cli(small(out, "--checkpoint_every", "2", "--resume", "auto")))
    assert "step_00000015: epoch 2, step 15" in proc.stderr, proc.stderr[-3000:]
    final = load_file(out / "model.safetensors")
    assert all(torch.allclose(final[k], uninterrupted[k], atol=1e-6) for k in final)  # and ends where it would have
