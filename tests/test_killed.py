"""A rank killed outright under launch.sh: kill -9 (the OOM killer's signal)
leaves no status of the trainer's own, and accelerate launch says 1 (an error, never relaunched).
launch.sh reports it as 137 (128 + SIGKILL), its own documented status, and relaunches it under
--max_restarts."""

import pytest
from conftest import ROOT, Job

pytestmark = pytest.mark.faults


def test_the_only_rank_killed_by_sigkill_is_status_137_and_relaunched(tmp_path):
    env = dict(TESTS_PKG_DELAY="0.05", PYTHONPATH=str(ROOT / "tests"))
    args = [
        "--model",
        "tests_pkg.mod:build",
        "--train_samples",
        "320",
        "--test_samples",
        "8",
        "--batch_size",
        "8",
        "--epochs",
        "1",
        "--log_every",
        "1",
        "--checkpoint_every",
        "2",
        "--max_restarts",
        "1",
    ]
    with Job(args, tmp_path / "out", tmp_path / "run.log", ranks=1, env=env) as job:
        job.steps(5)
        pid = job.kill(0)
        code = job.end(240)
    out, text = job.out, job.text
    assert code == 0, text[-4000:]
    assert (
        "a rank was killed by a signal it cannot handle (SIGKILL: kill -9, the OOM killer;"
        " host-pid " in text
    )
    assert f"-{pid}) and reported nothing: exit status 137" in text, text[-4000:]
    assert (
        "the job failed (exit status 137); relaunching to resume from the newest checkpoint" in text
    )
    assert "exit status 1)" not in text and "(attempt 2 of 2)" in text and "resumed from" in text
    assert (out / "model.safetensors").is_file()
