"""cores.py: the cores a process may use and the intra-op threads that follow (a one-process CPU
run on a busy 2-core machine runs 7x slower with torch's default threads than with one).
"""

import torch
from conftest import clean_env, run_cli

from accel_train.platform import cores


def test_threads_follow_the_flag_the_environment_the_cores_and_the_load(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: (8, "in this process's CPU affinity", 2))
    assert cores.intra_op_threads(3, {}, load=0.0)[0] == 3
    n, why = cores.intra_op_threads(None, {"OMP_NUM_THREADS": "2"}, load=0.0)
    # (torchrun's, the user's: kept)
    assert n is None and "intra-op threads 2 per process (OMP_NUM_THREADS)" == why
    n, why = cores.intra_op_threads(None, {}, load=0.5)
    assert n == 4 and "8 cores in this process's CPU affinity / 2 process(es)" in why
    n, why = cores.intra_op_threads(None, {}, load=9.3)
    assert n == 1 and "the machine was busy as the run started (load 9.3 on 8 cores" in why


def test_a_run_on_a_busy_machine_takes_one_thread_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr("os.getloadavg", lambda: (7.5, 7.0, 6.0))
    monkeypatch.setattr(cores, "usable_cores", lambda: (2, "in this process's CPU affinity", 1))
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(n))
    env = {k: v for k, v in clean_env().items() if k != "OMP_NUM_THREADS"}
    proc = run_cli(
        [
            "--data",
            "random",
            "--train_samples",
            "16",
            "--test_samples",
            "8",
            "--batch_size",
            "8",
            "--image_size",
            "16",
            "--max_steps",
            "1",
            "--output_dir",
            tmp_path / "out",
        ],
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "intra-op threads 1 per process: the machine was busy as the run started (load 7.5 on 2"
        " cores" in proc.stderr
    ), proc.stderr[-3000:]
    # (the setting took effect: torch was told; in_process restores its own afterwards)
    assert 1 in seen
