"""Exit statuses: one list in accel_train/errors.py (the launcher's policy walks it:
tests/test_launcher_policy.py)."""

import os
import signal
import subprocess
import sys

import pytest
from conftest import ROOT

from accel_train import errors, exits


def test_every_failure_status_has_its_place_in_the_priority():
    assert len(set(errors.STATUS_PRIORITY)) == len(errors.STATUS_PRIORITY)
    codes = {v for k, v in vars(errors).items() if k.startswith("EXIT_") and k != "EXIT_OK"}
    # every failure status has its place
    assert codes == set(errors.STATUS_PRIORITY) - {
        errors.ABORTED,
        errors.CRASHED,
    }


def test_the_priority_order_is_the_documented_one():
    """The order itself, literally (test_launcher_policy.py checks the policy walks whatever the
    list says, so a swapped pair would pass there)."""
    assert errors.STATUS_PRIORITY == (
        2,  # bad input: a relaunch runs into the same error
        5,  # diverged: a relaunch from the last checkpoint diverges again
        "crash",  # SIGABRT in a gloo group: a bug, reported as an error
        "abort",  # the NCCL watchdog's abort: a peer was lost
        1,  # an error
        130,  # a second Ctrl-C: the user stops it
        4,  # preempted: the survivors saved
        3,  # a lost peer: the survivors saved the last step
        137,  # killed outright, no other rank saying more
    )


def test_report_status_writes_one_file_per_process(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_TRAIN_STATUS_DIR", str(tmp_path))
    errors.report_status(errors.EXIT_PREEMPTED)
    (written,) = tmp_path.iterdir()
    assert written.read_text() == "4\n"
    monkeypatch.setenv("ACCEL_TRAIN_STATUS_DIR", str(tmp_path / "gone"))
    errors.report_status(errors.EXIT_ERROR)  # a status folder that is gone is no reason to fail


@pytest.mark.parametrize(
    "raised, code",
    [
        (errors.ConfigError("bad"), errors.EXIT_BAD_INPUT),  # every rank's agreed one-line error
        (errors.Preempted("step 3"), errors.EXIT_PREEMPTED),
        (None, errors.EXIT_OK),
        (RuntimeError("a bug"), errors.EXIT_ERROR),
        (KeyboardInterrupt(), errors.EXIT_INTERRUPTED),
    ],
)
@pytest.mark.parametrize("in_group", [True, False])
def test_a_rank_of_a_group_exits_with_its_status_without_finalization(
    monkeypatch, capsys, raised, code, in_group
):
    # Left to interpreter finalization, gloo's threads could be torn down mid-flight: SIGABRT
    # instead of the exit status (CI saw test_full_disk's rank end so). main() reports the status,
    # runs the atexit handlers and _exits; one process (no group) returns the status as before.
    from accel_train import cli, status

    class Group:
        is_main_process = True

    calls = []
    group = Group() if in_group else None
    monkeypatch.setattr(exits, "process_group", lambda: group)
    monkeypatch.setattr(status, "process_group", lambda: group)
    monkeypatch.setattr(status, "report_status", lambda c: calls.append(("status", c)))
    monkeypatch.setattr(exits.os, "_exit", lambda c: calls.append(("_exit", c)))
    monkeypatch.setattr(exits.atexit, "_run_exitfuncs", lambda: calls.append(("atexit", None)))

    def command(argv):
        if raised is not None:
            raise raised
        return errors.EXIT_OK

    monkeypatch.setitem(cli.COMMANDS, "smoke", command)
    assert cli.main(["smoke"]) == code
    assert calls == (
        [("status", code), ("atexit", None), ("_exit", code)] if in_group else [("status", code)]
    )


def test_a_run_whose_dataloader_workers_outlive_it_still_exits(tmp_path):
    # DataLoader workers leave a first SIGTERM to the trainer; multiprocessing's exit handler sends
    # exactly one and joins without a timeout. Before exits.end_workers: a 2-rank run of your own
    # Datasets (persistent workers) hung at exit (test_the_examples_train_on_two_ranks hit the
    # suite's 600 s timeout). torch's SIGCHLD handler (set by the loader's iterator) must not turn
    # the kill into "DataLoader worker ... is killed by signal".
    script = tmp_path / "outlive.py"
    script.write_text(
        "import sys\nfrom torch.utils.data import DataLoader\nfrom accel_train.data.workers import"
        " _leave_signals_to_the_trainer\nfrom accel_train.exits import exit_rank\nif __name__ =="
        " '__main__':\n    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1,"
        " persistent_workers=True,\n                       "
        " worker_init_fn=_leave_signals_to_the_trainer)\n    batches = iter(loader)\n   "
        " next(batches)\n    exit_rank(7)\n    sys.exit(7)\n"
    )
    proc = run_script(script)
    assert proc.returncode == 7 and "killed" not in proc.stderr, proc.stderr


def test_a_script_that_raises_while_the_workers_run_still_exits(tmp_path):
    # Its traceback keeps the loader's iterator alive into multiprocessing's exit handler, which
    # sends each worker the one SIGTERM that workers leave to the trainer and joins without a
    # timeout: before data/load.py's atexit end_workers this script hung there (found by a probe of
    # the cache's speed).
    script = tmp_path / "raises.py"
    script.write_text(
        "from accel_train.config.train_config import TrainConfig\n"
        "from accel_train.data import build_data\n"
        "data = build_data(TrainConfig(pipeline='cpu', train_samples=64, test_samples=8,"
        " batch_size=4, "
        "num_workers=1), 'cpu')\n"
        "batches = iter(data.train_loader)\n"
        "next(batches)\n"
        # the script's own daemonic process: multiprocessing's SIGTERM
        "import multiprocessing, signal, sys, time\n"
        "def own(marker):\n"  # at exit, as without accel_train, not a kill
        "    signal.signal(signal.SIGTERM, lambda *a: (open(marker, 'w').close(), sys.exit(0)))\n"
        "    time.sleep(60)\n"
        f"multiprocessing.Process(target=own, args=({str(tmp_path / 'flushed')!r},),"
        " daemon=True).start()\n"
        "time.sleep(1)\n"
        "raise ValueError('a bug in the script')\n"
    )
    proc = run_script(script)
    assert proc.returncode == 1 and "ValueError: a bug in the script" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert (tmp_path / "flushed").exists()  # (end_workers must not kill every daemonic child)


def test_a_script_that_raises_while_its_workers_start_still_exits(tmp_path):
    # A worker forked but not yet past worker_init_fn when end_workers looks does not ignore
    # SIGINT/SIGUSR1 yet: it was left to multiprocessing's one SIGTERM, which the trainer's handler
    # it inherited only records (or which it leaves to the trainer once started), and the exit hung
    # in multiprocessing's join (also without the at-fork delay below, which stands for a busy
    # machine).
    script = tmp_path / "starting.py"
    script.write_text(
        "import os, time\nfrom torch.utils.data import DataLoader\nfrom"
        " accel_train.config.train_config import TrainConfig\nfrom accel_train.data.workers import"
        " loader_kwargs\nfrom accel_train.resilience.preempt import StopRequest\nif __name__ =="
        " '__main__':\n    os.register_at_fork(after_in_child=lambda: time.sleep(1))\n   "
        " StopRequest().install()\n    loader = DataLoader(list(range(8)), batch_size=2,"
        " **loader_kwargs(None, 'cpu', workers=2))\n    batches = iter(loader)\n    raise"
        " ValueError('a bug in the script')\n"
    )
    proc = run_script(script, timeout=30)
    assert proc.returncode == 1 and "ValueError: a bug in the script" in proc.stderr, proc.stderr[
        -2000:
    ]
    assert "killed by signal" not in proc.stderr, proc.stderr[-2000:]


def run_script(script, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_a_sigterm_in_start_up_ends_the_rank_at_once_and_leaves_its_stack_in_a_note(tmp_path):
    """Before the run's stop handler exists (torchrun stopping the ranks beside a failed one), a
    SIGTERM still ends the rank at once, and its note's TERM_NOTE file says so (the launcher then
    names only the rank that was killed); the run's own handler replaces it."""
    import socket

    from accel_train.rank_files import TERM_NOTE

    def rank(handler: str):
        code = (
            "import signal, sys, time\nfrom accel_train.exits import note_aborts\nnote_aborts()\n"
            f"{handler}\nprint('ready', flush=True)\ntime.sleep(30)"
        )
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, "ACCEL_TRAIN_STATUS_DIR": str(tmp_path)},
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=10)
        note = tmp_path / "faults" / f"{socket.gethostname()}-{proc.pid}{TERM_NOTE}"
        return status, note.read_text()

    status, note = rank("")
    assert status == -signal.SIGTERM and "most recent call first" in note, (status, note)
    status, note = rank("signal.signal(signal.SIGTERM, lambda *a: sys.exit(4))")
    assert status == 4 and note == ""
