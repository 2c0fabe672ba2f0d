"""Preemption with real signals: SIGTERM to launch.sh (what the platform sends), mid-epoch and during the evaluation,
in one run (SIGUSR1 to one rank only: test_faults.py)."""

import json
import os
import re
import signal
import subprocess
import time
import uuid

import pytest
from safetensors.torch import load_file

from conftest import ROOT, SLOW_STEPS, clean_env, steps_logged, wait_for

pytestmark = pytest.mark.slow
# conftest.SLOW_STEPS (resnet18, 32 steps of ~0.3 s an epoch, 2 epochs); no step checkpoints (--checkpoint_every 0,
# the default)
RUN = [*SLOW_STEPS, "--log_every", "1"]


def launch_sh(out, tag, log, *extra):
    env = clean_env(NPROC_PER_NODE="2", ACCEL_TEST_TAG=tag)
    return subprocess.Popen(["bash", ROOT / "launch.sh", *RUN, "--output_dir", out, *extra], stdout=log,
                            stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)


def finish(proc, timeout):
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def sigterm_when(proc, ready, sleep=0.0, interval=0.05):
    """SIGTERM to launch.sh (as Kubernetes / ModelArts / SLURM send it) once ready(); its exit status and how long
    the job took to stop."""
    try:
        wait_for(ready, timeout=240, interval=interval)
    except AssertionError:
        finish(proc, 1)
        raise
    time.sleep(sleep)
    sent = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    code = finish(proc, 60)
    return code, time.monotonic() - sent


def test_sigterm_mid_epoch_then_in_the_epoch_end_evaluation_each_resumed_ends_with_the_uninterrupted_weights(
        tmp_path, slow_steps_reference):
    # One run stopped twice by SIGTERM to launch.sh and resumed each time with --resume auto: mid epoch 1 (the
    # reached step is checkpointed), then during epoch 1's evaluation (the epoch's checkpoint is written, its
    # metrics row is not); the last launch redoes only that evaluation, trains epoch 2 and ends with the weights
    # of the uninterrupted run. 1000 test samples: an evaluation of ~6 s alone (~10 s in the suite), long enough
    # for the signal to land in it (the test set does not change what is trained).
    ref, out = slow_steps_reference, tmp_path / "out"
    run = ["--test_samples", "1000"]

    with open(tmp_path / "run.log", "w") as log:
        code, elapsed = sigterm_when(launch_sh(out, uuid.uuid4().hex, log, *run, "--max_restarts", "1"),
                                     lambda: steps_logged(out) >= 5)  # mid epoch 1
    text = (tmp_path / "run.log").read_text()
    assert code == 4 and elapsed < 30, (elapsed, text[-3000:])
    stops = re.findall(r"accel-train: preempted: stopped by \S+ at step (\d+)", text)
    assert len(stops) == 1, text[-3000:]  # said once (the main process); the checkpoint is every rank's step
    step = int(stops[0])
    assert 5 <= step < 32
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (0, step, step)
    assert sorted(p.name for p in ckpt.glob("random_states_*")) == ["random_states_0.pkl", "random_states_1.pkl"]
    assert "preempted (exit status 4)" in text and "relaunching" not in text
    assert not (out / "model.safetensors").exists()  # no export of an unfinished run

    with open(tmp_path / "resume.log", "w") as log:
        code, elapsed = sigterm_when(launch_sh(out, uuid.uuid4().hex, log, *run, "--resume", "auto"),
                                     lambda: steps_logged(out) >= 32, sleep=1, interval=0.01)  # into the evaluation
    text = (tmp_path / "resume.log").read_text()
    assert code == 4 and elapsed < 30, (elapsed, text[-3000:])
    assert f"step {step}, {step} batches into the epoch" in text
    assert "while evaluating epoch 1" in text
    state = json.loads((out / "checkpoints" / "step_00000032" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (0, 32, 32)
    assert not (out / "metrics.jsonl").read_text().strip()  # the epoch's row comes with its evaluation

    with open(tmp_path / "end.log", "w") as log:
        code = finish(launch_sh(out, uuid.uuid4().hex, log, *run, "--resume", "auto"), 300)
    text = (tmp_path / "end.log").read_text()
    assert code == 0, text[-3000:]
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"], r["test_samples"]) for r in rows] == [(1, 32, 1000), (2, 64, 1000)]
    assert [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()] == list(range(1, 65))
    a, b = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-6


# SIGUSR1 to one rank only (stops every rank at one step, --restart_on_preempt relaunches): test_faults.py's
# test_signalled_then_killed_rank_..., in the same run as a killed rank
