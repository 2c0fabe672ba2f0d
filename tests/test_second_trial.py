"""A second new-user trial (issue 26, items 5-8, 10): defaults that do not waste a small data set, fixed-size timm
models at another size, --stem auto that says why, a schedule that reaches its peak (and curves that show the lr
each step used), and predict's machine-readable formats.

Pure functions are tested in process; one-step runs go through run_cli (in this process)."""

import torch

from accel_train.config import TrainConfig
from accel_train.outputs import lr_curve, lr_of_step
from accel_train.setup import schedule


# ---------------------------------------------------------------------------------------------
# Item 8: the peak lr is reached; the lr panel shows the lr each step used
# ---------------------------------------------------------------------------------------------

def sgd(lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_the_schedule_reaches_the_peak_after_the_warmup():
    # the run: 7 steps per epoch, 2 epochs, 1 warmup epoch, peak 0.025 (main: 0.0215 at step 7, then 0.0125)
    cfg = TrainConfig(epochs=2, warmup_epochs=1, lr=0.025)
    scheduler = schedule(cfg, sgd(0.025), 1, 7)
    lrs = [lr_of_step(scheduler, step) for step in range(1, 15)]
    assert lrs[0] == 0.025 / 100 and lrs[:8] == sorted(lrs[:8])  # the warmup: steps 1..7
    assert lrs[7] == 0.025 and max(lrs) == 0.025  # step 8 trains at the peak the start line names
    assert lrs[7:] == sorted(lrs[7:], reverse=True) and lrs[-1] < 0.002  # then the cosine, towards 0


def test_the_schedule_with_the_warmup_as_long_as_the_run():
    cfg = TrainConfig(epochs=1, warmup_epochs=1, lr=0.1)
    lrs = [lr_of_step(schedule(cfg, sgd(0.1), 1, 4), step) for step in range(1, 5)]
    assert lrs == sorted(lrs) and lrs[-1] < 0.1


def test_the_lr_panel_keeps_the_logged_lr_before_a_resume():
    # a run of 1 epoch (8 steps) extended to 2 on resume: steps 1..8 trained on the 1-epoch schedule (steps.jsonl
    # says so), the rest on the rebuilt one; the curve must show the jump, not the rebuilt schedule from step 1
    logged = [{"step": 4, "loss": 1.0, "lr": 0.02}, {"step": 8, "loss": 1.0, "lr": 0.0001}]
    scheduler = schedule(TrainConfig(epochs=2, warmup_epochs=1, lr=0.025), sgd(0.025), 1, 8)
    curve = lr_curve(scheduler, 16, logged=logged, since=8)
    assert curve[:2] == [{"step": 4, "lr": 0.02}, {"step": 8, "lr": 0.0001}]
    assert [p["step"] for p in curve[2:]] == list(range(9, 17)) and curve[2]["lr"] == 0.025
