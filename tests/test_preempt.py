"""Preemption with real signals: SIGTERM to launch.sh (what the platform sends), mid-epoch and during the evaluation
(SIGUSR1 to one rank only: test_faults.py)."""

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


def test_sigterm_mid_epoch_checkpoints_the_reached_step_and_resume_is_exact(tmp_path, slow_steps_reference):
    ref, out = slow_steps_reference, tmp_path / "out"

    with open(tmp_path / "run.log", "w") as log:
        proc = launch_sh(out, uuid.uuid4().hex, log, "--max_restarts", "1")
        try:
            wait_for(lambda: steps_logged(out) >= 5, timeout=240)  # mid epoch 1
        except AssertionError:
            finish(proc, 1)
            raise
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # to launch.sh, as Kubernetes / ModelArts / SLURM do
        code = finish(proc, 60)
        elapsed = time.monotonic() - sent
    text = (tmp_path / "run.log").read_text()
    assert code == 4, text[-3000:]
    assert elapsed < 30, elapsed
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
        code = finish(launch_sh(out, uuid.uuid4().hex, log, "--resume", "auto"), 300)
    text = (tmp_path / "resume.log").read_text()
    assert code == 0, text[-3000:]
    assert f"step {step}, {step} batches into the epoch" in text
    a, b = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-6
    assert [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()] == list(range(1, 65))


# SIGUSR1 to one rank only (stops every rank at one step, --restart_on_preempt relaunches): test_faults.py's
# test_signalled_then_killed_rank_..., in the same run as a killed rank


def test_sigterm_during_the_epoch_end_evaluation_saves_the_epoch(tmp_path):
    # 1600 test samples: an evaluation of ~15 s, long enough for the signal to land in it
    out = tmp_path / "out"
    run = ["--test_samples", "1600", "--epochs", "1"]
    with open(tmp_path / "run.log", "w") as log:
        proc = launch_sh(out, uuid.uuid4().hex, log, *run)
        try:
            wait_for(lambda: steps_logged(out) >= 32, timeout=240, interval=0.01)  # the epoch's last step
        except AssertionError:
            finish(proc, 1)
            raise
        time.sleep(1)  # into the evaluation
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        code = finish(proc, 60)
        elapsed = time.monotonic() - sent
    text = (tmp_path / "run.log").read_text()
    assert code == 4 and elapsed < 30, (elapsed, text[-3000:])
    assert "while evaluating epoch 1" in text
    state = json.loads((out / "checkpoints" / "step_00000032" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (0, 32, 32)
    assert not (out / "metrics.jsonl").read_text().strip()  # the epoch's row comes with its evaluation
    # the resumed run redoes only the evaluation, then finishes
    with open(tmp_path / "resume.log", "w") as log:
        code = finish(launch_sh(out, uuid.uuid4().hex, log, *run, "--resume", "auto"), 300)
    text = (tmp_path / "resume.log").read_text()
    assert code == 0, text[-3000:]
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"], r["test_samples"]) for r in rows] == [(1, 32, 1600)]
    assert [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()] == list(range(1, 33))
