"""The epoch's row after a lost peer: a resume that redoes only an epoch's
evaluation (every batch of it trained before the failure) keeps the epoch's training numbers,
reduced over ranks before the failure and saved with the step; a row is the epoch's real numbers or
absent, never zeros as if measured."""

import json

import pytest
from conftest import run_cli
from test_survivor import (
    ONE,
    SAVED,
    every_step,  # noqa: F401 (a fixture)
    lose_peer_at,
)

from accel_train.resilience import survivor

TRAIN = ("train_loss", "train_acc", "train_samples")


def rows(out):
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("where", ["the row's collective", "the training sums' reduce"])
def test_a_peer_lost_at_the_epoch_end_leaves_the_real_row_or_none(
    tmp_path,
    monkeypatch,
    every_step,
    where,
):
    from accel_train.training import exports as outputs
    from accel_train.training import metrics

    out = tmp_path / "out"
    if where == "the row's collective":
        # after the evaluation: the best export's agreement (main_process_writes)
        lose_peer_at(monkeypatch, outputs, "main_process_writes", lambda *a: True)
    else:  # before it: the epoch's training sums were never reduced, so no rank knows them
        lose_peer_at(monkeypatch, metrics.EpochMeter, "result", lambda *a: True)
    monkeypatch.setattr(survivor.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    proc = run_cli([*ONE, "--output_dir", out])
    assert proc.returncode == 3 and SAVED.search(proc.stderr).group(1) == "8", proc.stderr[-3000:]
    saved = json.loads((out / "checkpoints" / "step_00000008" / "trainer_state.json").read_text())
    # every batch trained: only the evaluation is left
    assert (saved["epoch"], saved["batch_in_epoch"]) == (
        0,
        16,
    )
    monkeypatch.undo()
    proc = run_cli([*ONE, "--output_dir", out, "--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ref,) = rows(every_step)
    if where == "the row's collective":  # the evaluation redone, the training numbers kept
        (row,) = rows(out)
        # (its own)
        assert {k: row[k] for k in TRAIN} == {k: ref[k] for k in TRAIN} and row[
            "images_per_sec"
        ] > 0
        assert {k: row[k] for k in ("test_acc", "test_acc_ema", "step")} == {
            k: ref[k] for k in ("test_acc", "test_acc_ema", "step")
        }
    else:  # not known anywhere: no row, said in one line
        assert rows(out) == [], rows(out)
        assert (
            "epoch 1's training numbers are not in the checkpoint (a peer was lost in their reduce,"
            " or an older accel_train wrote it): no row for it" in proc.stderr
        ), proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file()


def test_a_survivor_save_mid_epoch_gives_a_row_that_says_it_is_partial(
    tmp_path, monkeypatch, every_step
):
    # the survivor saves without a collective: its own sums are not the epoch's, so it keeps none,
    # and the resumed epoch's row covers the batches after the save, marked so (a row as if whole
    # understated the epoch in silence)
    from accel_train.training import metrics

    out = tmp_path / "out"
    lose_peer_at(monkeypatch, metrics.MetricsLog, "log_step", lambda self, acc, s, *a: s == 5)
    monkeypatch.setattr(survivor.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    proc = run_cli([*ONE, "--output_dir", out])
    assert proc.returncode == 3 and SAVED.search(proc.stderr).group(1) == "5", proc.stderr[-3000:]
    saved = json.loads((out / "checkpoints" / "step_00000005" / "trainer_state.json").read_text())
    assert (saved["batch_in_epoch"], saved["epoch_sums"]) == (10, None)
    monkeypatch.undo()
    proc = run_cli([*ONE, "--output_dir", out, "--resume", "auto"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "epoch 1's row covers its batches from 11 on only (train_partial): the checkpoint (a"
        " survivor's save after a lost peer) keeps no training sums of the batches before"
        in proc.stderr
    ), proc.stderr[-3000:]
    (row,) = rows(out)
    assert (row["train_samples"], row["train_partial"]) == (6 * 4, True) and rows(every_step)[0][
        "train_samples"
    ] == 64
    assert "train_partial" not in rows(every_step)[0]
