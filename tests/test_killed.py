"""A rank killed outright under launch.sh (issue 33 item 4): kill -9 (the OOM killer's signal) leaves no status of the
trainer's own, and accelerate launch says 1 (an error, never relaunched). launch.sh reports it as 137 (128 +
SIGKILL), its own documented status, and relaunches it under --max_restarts."""

import os
import signal
import subprocess
import uuid

import pytest

from conftest import ROOT, clean_env, steps_logged, trainer_pids, wait_for

pytestmark = pytest.mark.slow


def test_the_only_rank_killed_by_sigkill_is_status_137_and_relaunched(tmp_path):
    out, log, tag = tmp_path / "out", tmp_path / "run.log", uuid.uuid4().hex
    env = clean_env(NPROC_PER_NODE="1", ACCEL_RESTART_DELAY="1", ACCEL_TEST_TAG=tag, TESTS_PKG_DELAY="0.05",
                    PYTHONPATH=str(ROOT / "tests"))
    args = ["--model", "tests_pkg.mod:build", "--train_samples", "320", "--test_samples", "8", "--batch_size", "8",
            "--epochs", "1", "--log_every", "1", "--checkpoint_every", "2", "--output_dir", out, "--max_restarts", "1"]
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", ROOT / "launch.sh", *map(str, args)], stdout=f, stderr=subprocess.STDOUT,
                                env=env, cwd=ROOT, start_new_session=True)
    try:
        wait_for(lambda: steps_logged(out) >= 5, timeout=240, interval=0.02)
        (pid,) = wait_for(lambda: trainer_pids(tag), timeout=30).values()
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "a rank was killed by a signal it cannot handle (SIGKILL: kill -9, the OOM killer; host-pid " in text
    assert f"-{pid}) and reported nothing: exit status 137" in text, text[-4000:]
    assert "the job failed (exit status 137); relaunching to resume from the newest checkpoint" in text
    assert "exit status 1)" not in text and "(attempt 2 of 2)" in text and "resumed from" in text
    assert (out / "model.safetensors").is_file()
