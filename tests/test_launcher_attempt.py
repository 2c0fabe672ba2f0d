"""An attempt's processes (accel_train/launcher/attempt.py), in process with small real children:
the stop signals passed on to the job's group but its leader, the group waited for, stopped
processes killed, a frozen rank killed after its limit only where no rank of the machine runs, the
ranks that outlive their launcher waited for."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from accel_train.launcher import attempt

pytestmark = pytest.mark.timeout(120)


def child(code: str, env=None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, **(env or {})}, **kw)


def test_a_signal_reaches_the_group_but_its_leader_and_the_status_is_a_shells(tmp_path):
    """The leader (accelerate's one-process launcher) is spared: it would SIGKILL its trainer 5 s
    after a signal; the trainer below it gets the signal itself. USR1 arrives as TERM, and the job
    starts with USR1 ignored."""
    heard = tmp_path / "heard"
    trainer = (
        f"import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: (open({str(heard)!r},"
        " 'w').write('TERM'), sys.exit(4)))\nprint(signal.getsignal(signal.SIGUSR1) =="
        " signal.SIG_IGN, flush=True)\ntime.sleep(60)"
    )
    leader = (
        "import subprocess, sys, signal\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(99))\n"
        f"sys.exit(subprocess.call([sys.executable, '-c', {trainer!r}]))"
    )
    sup = attempt.Supervisor()
    try:

        def watch():  # once the trainer has its handler (it says so), the launcher is told to stop
            if not watch.told and (tmp_path / "out").read_text():
                sup.forward(signal.SIGUSR1)
                watch.told = True

        watch.told = False
        out = open(tmp_path / "out", "w")
        status = sup.run([sys.executable, "-c", leader], dict(os.environ), watch=watch, stdout=out)
    finally:
        for sig in attempt.FORWARDED:
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )
    # the trainer's status through its spared leader
    assert (heard.read_text() == "TERM" and status == 4)
    assert (tmp_path / "out").read_text().strip() == "True"
    assert sup.signalled == "USR1"
    assert (
        attempt.Supervisor.run(
            sup, [sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"], dict(os.environ)
        )
        == 137
    )
    for sig in attempt.FORWARDED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def test_the_group_a_launcher_leaves_is_waited_for(tmp_path):
    """A trainer its launcher left behind (a signal) may still be writing its checkpoint: run()
    returns after it."""
    done = tmp_path / "done"
    late = f"import time; time.sleep(1.5); open({str(done)!r}, 'w')"
    code = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {late!r}])"
    sup = attempt.Supervisor()
    try:
        assert sup.run([sys.executable, "-c", code], dict(os.environ)) == 0
    finally:
        for sig in attempt.FORWARDED:
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )
    assert done.exists()


def stopped(proc) -> bool:
    for _ in range(100):
        if psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED:
            return True
        time.sleep(0.05)
    return False


def test_attempt_processes_are_found_by_their_status_folder_and_stopped_ones_killed(
    tmp_path, capsys
):
    mine = child("import time; time.sleep(60)", {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path)})
    other = child("import time; time.sleep(60)", {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path) + "x"})
    try:
        for _ in range(100):
            found = attempt.attempt_processes(str(tmp_path))
            if found:
                break
            time.sleep(0.05)
        assert [p.pid for p in found] == [mine.pid]
        attempt.kill_stopped(found)  # running: left alone
        assert mine.poll() is None
        os.kill(mine.pid, signal.SIGSTOP)
        assert stopped(mine)
        attempt.kill_stopped(found)
        assert mine.wait(10) == -9
        assert (
            f"process(es) {mine.pid} of this attempt are stopped (state T)"
            in capsys.readouterr().err
        )
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


def test_a_frozen_rank_is_killed_after_its_limit_only_where_no_rank_of_the_machine_runs(
    tmp_path, capsys
):
    env = {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path)}
    ranks = [child("import time; time.sleep(60)", {**env, "RANK": str(i)}) for i in range(2)]
    try:
        watch = attempt.FrozenWatch(str(tmp_path), limit_s=1)
        (tmp_path / "faults").mkdir()  # the ranks' fault notes: no status, so no stop of the job
        os.kill(ranks[0].pid, signal.SIGSTOP)
        assert stopped(ranks[0])
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # its peer runs and speaks for the machine
            watch()
            time.sleep(0.2)
        assert ranks[0].poll() is None
        (tmp_path / "faults" / "host-1").write_text("backend: gloo\n")
        watch()
        assert ranks[0].poll() is None
        os.kill(ranks[1].pid, signal.SIGSTOP)
        assert stopped(ranks[1])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and None in (ranks[0].poll(), ranks[1].poll()):
            watch()
            time.sleep(0.2)
        assert ranks[0].poll() == -9 and ranks[1].poll() == -9
        assert (
            "has been stopped (state T) for 1 s, longer than its peers wait"
            in capsys.readouterr().err
        )
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_ranks_that_outlive_their_launcher_are_waited_for_then_killed(tmp_path, capsys):
    rank = child("import time; time.sleep(60)", {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path)})
    quick = child("import time; time.sleep(1)", {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path) + "-2"})
    try:
        sup = attempt.Supervisor.__new__(attempt.Supervisor)
        sup.child, sup.signalled = None, ""
        for _ in range(100):
            if attempt.attempt_processes(str(tmp_path)):
                break
            time.sleep(0.05)
        start = time.monotonic()
        attempt.ranks_ended(str(tmp_path), sup, stop_s=1.5)
        assert (
            not psutil.pid_exists(rank.pid)
            or psutil.Process(rank.pid).status() == psutil.STATUS_ZOMBIE
        )
        assert time.monotonic() - start < 10
        err = capsys.readouterr().err
        assert f"process(es) {rank.pid} of this attempt still run: waiting" in err
        assert f"process(es) {rank.pid} did not stop within 1.5 s: killed" in err
        attempt.ranks_ended(str(tmp_path) + "-2", sup, stop_s=30)  # one that ends by itself
        assert quick.poll() == 0
    finally:
        for p in (rank, quick):
            p.kill()
            p.wait()
