"""An attempt's processes (accel_train/launcher/attempt.py), in process with small real children:
the stop signals passed on to the job's group but its leader, the group waited for, stopped
processes killed, a frozen rank killed after its limit only where no rank of the machine runs, the
ranks that outlive their launcher waited for."""

import ctypes
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
    assert heard.read_text() == "TERM" and status == 4
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


def test_a_process_in_tracing_stop_is_killed_as_a_stopped_one(capsys):
    """A process stopped under a tracer (state t: a debugger's breakpoint, ptrace) cannot answer
    the job's stop either."""
    PTRACE_ATTACH, PTRACE_DETACH = 16, 17  # sys/ptrace.h
    libc = ctypes.CDLL(None, use_errno=True)
    proc = child("import time; time.sleep(60)")
    try:
        assert libc.ptrace(PTRACE_ATTACH, proc.pid, None, None) == 0, ctypes.get_errno()
        os.waitpid(proc.pid, 0)  # (the tracee's attach stop, reported to its tracer)
        assert attempt.state(psutil.Process(proc.pid)) == psutil.STATUS_TRACING_STOP
        attempt.kill_stopped([psutil.Process(proc.pid)])
        deadline = time.monotonic() + 10
        while attempt.state(psutil.Process(proc.pid)) != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the traced process was left stopped"
            time.sleep(0.05)
        _, status = os.waitpid(proc.pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        proc.returncode = -9  # (reaped here)
        assert f"process(es) {proc.pid} of this attempt are stopped" in capsys.readouterr().err
    finally:
        if proc.returncode is None:
            libc.ptrace(PTRACE_DETACH, proc.pid, None, None)
            proc.kill()
            proc.wait()


def test_a_frozen_rank_is_killed_after_its_limit_only_where_no_rank_of_the_machine_runs(
    tmp_path, capsys
):
    env = {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path)}
    ranks = [
        child("import time; time.sleep(60)", {**env, "ROLE_RANK": str(i), "RANK": str(i)})
        for i in range(2)
    ]
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


def ended_launcher(status_dir, signalled: str) -> attempt.Supervisor:
    """A supervisor whose launcher has ended (`signalled`: the signal it was told to stop by), once
    the attempt's processes in `status_dir` can be found."""
    sup = attempt.Supervisor.__new__(attempt.Supervisor)
    sup.child, sup.signalled = None, signalled
    for _ in range(100):
        if attempt.attempt_processes(str(status_dir)):
            break
        time.sleep(0.05)
    return sup


def test_ranks_that_outlive_their_launcher_are_waited_for_then_killed(tmp_path, capsys):
    rank = child("import time; time.sleep(60)", {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path)})
    quick = child("import time; time.sleep(1)", {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path) + "-2"})
    try:
        sup = ended_launcher(tmp_path, signalled="")
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


def tree(tmp_path, launcher_env: dict) -> dict[str, int]:
    """launcher -> agent (inherits the launcher's variables) -> rank (torchrun's worker variables)
    -> DataLoader worker (inherits the rank's): the pids, once the worker runs."""
    pids = tmp_path / "pids"
    worker = "import time; time.sleep(60)"
    rank = (
        "import os, subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}])\n"
        f"open({str(pids)!r}, 'a').write(f'rank {{os.getpid()}}\\nworker {{w.pid}}\\n')\n"
        "time.sleep(60)"
    )
    agent = (
        "import os, subprocess, sys, time\n"
        "env = {**os.environ, 'ROLE_RANK': '1', 'LOCAL_RANK': '0', 'RANK': '1',"
        " 'TORCHELASTIC_RUN_ID': 'job',"
        " 'TORCHELASTIC_RESTART_COUNT': '0'}\n"
        f"subprocess.Popen([sys.executable, '-c', {rank!r}], env=env)\n"
        f"open({str(pids)!r}, 'a').write(f'agent {{os.getpid()}}\\n')\n"
        "time.sleep(60)"
    )
    launcher = (
        f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {agent!r}])\n"
    )
    proc = child(launcher + "time.sleep(60)", launcher_env, start_new_session=True)
    for _ in range(200):
        if pids.exists() and pids.read_text().count("\n") == 3:
            break
        time.sleep(0.05)
    found = dict(line.split() for line in pids.read_text().splitlines())
    return {"launcher": proc.pid, **{k: int(v) for k, v in found.items()}}


@pytest.mark.parametrize(
    "launcher_env",
    [{}, {"RANK": "1"}, {"RANK": "1", "LOCAL_RANK": "0"}],
    ids=["plain", "scheduler_rank", "scheduler_rank_and_local_rank"],
)
def test_a_rank_is_told_from_its_agent_and_its_dataloader_workers(tmp_path, launcher_env):
    """Kubeflow sets RANK to the pod's rank and sbatch scripts export it: with one process a
    machine the rank's RANK is the agent's too."""
    pids = tree(tmp_path, launcher_env)
    try:
        # (the launcher is none of its attempt's processes: never asked)
        seen = {
            name: attempt.is_rank(psutil.Process(pids[name]))
            for name in ("agent", "rank", "worker")
        }
        assert seen == {"agent": False, "rank": True, "worker": False}
    finally:
        os.killpg(pids["launcher"], signal.SIGKILL)


def test_the_job_hears_a_sigterm_when_its_launcher_is_killed_outright(tmp_path):
    """kill -9 of the launcher runs no handler of its own: its job's first process gets SIGTERM
    from the kernel (PR_SET_PDEATHSIG), as from a stop signal, instead of running on alone."""
    heard, ready = tmp_path / "heard", tmp_path / "ready"
    job = (
        "import os, signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(heard)!r}, 'w')"
        ".write(str(os.getppid())), sys.exit(4)))\n"
        f"open({str(ready)!r}, 'w').close()\ntime.sleep(60)"
    )
    launcher = (
        "import os, sys\nfrom accel_train.launcher import attempt\n"
        f"sys.exit(attempt.Supervisor().run([sys.executable, '-c', {job!r}], dict(os.environ)))"
    )
    proc = child(launcher, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not heard.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        # heard, and reparented: the launcher was gone when it was told
        assert heard.exists() and int(heard.read_text()) != proc.pid
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
    # a child whose launcher is gone before its death signal was set is told at once
    sentinel = tmp_path / "early"
    code = (
        "import os, signal, sys\nfrom accel_train.launcher import attempt\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(sentinel)!r}, 'w').close(),"
        " sys.exit(4)))\n"
        "attempt.job_process_setup(launcher=-1)\nimport time; time.sleep(5)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=30).returncode == 4
    assert sentinel.exists()


def restore_signals():
    for sig in attempt.FORWARDED:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)


def test_a_launcher_that_fails_stops_its_job_first(tmp_path, capsys):
    """An error of the launcher's own (here its watch: the status folder removed by a cleaner used
    to raise there) must not leave the job running with no one to pass a signal or relaunch."""
    heard = tmp_path / "heard"
    trainer = (
        f"import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: (open({str(heard)!r},"
        " 'w').write('TERM'), sys.exit(4)))\nprint('ready', flush=True)\ntime.sleep(60)"
    )
    sup = attempt.Supervisor()
    out = open(tmp_path / "out", "w")

    def watch():
        if (tmp_path / "out").read_text():
            raise RuntimeError("the watch failed")

    try:
        with pytest.raises(RuntimeError, match="the watch failed"):
            sup.run([sys.executable, "-c", trainer], dict(os.environ), watch=watch, stdout=out)
    finally:
        restore_signals()
    assert heard.read_text() == "TERM"
    assert (
        "the launcher stops on an error of its own: the job is stopped" in capsys.readouterr().err
    )
    # a status folder removed under the job is nothing written, not an error
    gone = attempt.FrozenWatch(str(tmp_path / "removed"), limit_s=0)
    gone()


def test_sighup_is_a_stop_passed_on_as_sigterm():
    """The terminal closed: the job, in a session of its own, would not hear of it."""
    sup = attempt.Supervisor()
    try:
        assert signal.getsignal(signal.SIGHUP) == sup.forward
        sup.forward(signal.SIGHUP)
    finally:
        restore_signals()
    assert sup.signalled == "TERM"


def test_ranks_left_by_a_signalled_launcher_are_told_to_stop(tmp_path):
    """The launcher was told to stop and its launcher ended: the ranks still running get SIGTERM
    (they checkpoint and exit) instead of waiting for the stop limit."""
    heard = tmp_path / "heard"
    code = (
        f"import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: (open({str(heard)!r},"
        " 'w').write('TERM'), sys.exit(4)))\ntime.sleep(60)"
    )
    rank = child(code, {"ACCEL_TRAIN_STATUS_DIR": str(tmp_path)})
    try:
        sup = ended_launcher(tmp_path, signalled="INT")
        time.sleep(1)  # its handler installed
        start = time.monotonic()
        attempt.ranks_ended(str(tmp_path), sup, stop_s=30)
        assert time.monotonic() - start < 10
        # (its status is read by the wait for it: here, the launcher's child, it is reaped there)
        rank.wait(10)
        assert heard.read_text() == "TERM"
    finally:
        rank.kill()
        rank.wait()


def test_a_launcher_that_is_pid_1_reaps_the_orphans_of_its_job(tmp_path):
    """In a container whose command is launch.sh the launcher is PID 1 (bash execs Python): a
    process the job left is reparented to it, and its zombie kept the job's group alive for
    GROUP_WAIT_S. A subreaper is the same case without a container."""
    orphan = "import time; time.sleep(1)"
    leader = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {orphan!r}])"
    code = (
        "import ctypes, os, sys, time\n"
        "assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER\n"
        "from accel_train.launcher import attempt\n"
        "start = time.monotonic()\n"
        f"status = attempt.Supervisor().run([sys.executable, '-c', {leader!r}], dict(os.environ))\n"
        "print(status, round(time.monotonic() - start))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-2000:]
    status, seconds = proc.stdout.split()
    assert status == "0" and int(seconds) < 10, proc.stdout
