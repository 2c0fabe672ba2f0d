"""An attempt's processes: started in a session of their own, told of the launcher's stop signals,
watched for stopped (frozen) ones, and waited for until every one has ended. Processes are found and
read with psutil; an attempt's own processes are the ones whose environment names its status folder
(never a reused pid).

Preemption: SIGTERM / SIGUSR1 to the launcher go to the job as SIGTERM (the trainer checkpoints and
exits 4). The job starts with SIGUSR1 ignored: torchrun's agent has no handler for it and would die
(the trainer installs its own). Ctrl-C: the job runs in a session of its own (torchrun puts each
rank in one too), so the terminal's SIGINT reaches the launcher only, which passes each one on as
SIGINT: torchrun's agent sends the first to the ranks (they checkpoint and exit 4) and a second as
SIGTERM (they stop at once, exit 130). A signal goes to the job's process group but its leader: with
one process, accelerate's simple launcher does not pass signals on to the trainer, and answers one
by SIGTERMing the trainer and SIGKILLing it 5 s later (accelerate 1.15 commands/launch.py
_terminate_process_tree: a Ctrl-C then read as a second one, the step lost), so the trainer (and its
workers) alone hear it. torchrun's ranks run in sessions of their own: its group is the agent alone,
which gets the signal and passes it on to its ranks. SIGHUP (the terminal closed: the job, in its
own session, would not hear of it) is a SIGTERM. The launcher killed outright (kill -9 runs no
handler): the kernel sends the job's first process SIGTERM (job_process_setup), as a stop signal."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from functools import partial

import psutil

from ..rank_files import STATUS_DIR
from . import PREFIX

FORWARDED = {
    signal.SIGTERM: "TERM",
    signal.SIGUSR1: "USR1",
    signal.SIGINT: "INT",
    signal.SIGHUP: "TERM",
}
LOOK_S = 0.5  # how often a running attempt is looked at
PR_SET_PDEATHSIG = 1  # prctl(2)'s option: the signal a process gets when its parent thread ends
GROUP_WAIT_S = (
    60  # how long a trainer its launcher left (a signal) may go on writing its checkpoint
)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _libc():
    """The C library, loaded before any fork (a child between fork and exec loads nothing); None
    where prctl is not Linux's."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


LIBC = _libc()


def job_process_setup(launcher: int) -> None:
    """The job's first process, between fork and exec: SIGUSR1 ignored (the module's text), and
    SIGTERM when the launcher ends, even by SIGKILL (prctl PR_SET_PDEATHSIG, kept across exec): the
    job then stops as on a stop signal (the ranks checkpoint and exit 4) instead of training on with
    no one to pass it a signal or relaunch it. A launcher gone before the prctl: SIGTERM at once."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    if LIBC is not None and LIBC.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0:
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGTERM)


def group_but_leader(pgid: int) -> list[int]:
    """The members of process group `pgid` other than its leader (psutil has no process group:
    os.getpgid)."""
    out = []
    for pid in psutil.pids():
        try:
            if pid != pgid and os.getpgid(pid) == pgid:
                out.append(pid)
        except OSError:
            continue
    return out


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans(keep: int | None = None) -> None:
    """Orphans reparented to the launcher (it is PID 1 in a container whose command is launch.sh,
    or a subreaper) are reaped: a zombie would keep the job's group alive. `keep`: the child whose
    status subprocess reads."""
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return
    for proc in children:
        if proc.pid == keep:
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.Error, ChildProcessError, OSError):
            continue


def attempt_processes(status_dir: str) -> list[psutil.Process]:
    """Every process of the attempt whose status folder is `status_dir`, whatever it has reached: a
    rank still importing, blocked in the rendezvous, or training."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(STATUS_DIR) == status_dir:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def state(proc: psutil.Process) -> str:
    try:
        return proc.status()
    except psutil.Error:
        return ""


# What torchrun's agent sets in each worker it starts (LocalElasticAgent._start_workers); ROLE_RANK
# is its own, set by no scheduler.
WORKER_KEYS = ("ROLE_RANK", "RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


def is_rank(proc: psutil.Process) -> bool:
    """A rank torchrun started: ROLE_RANK set in its environment and the worker variables not all
    its parent's. A DataLoader worker inherits its rank's; the agent inherits the launcher's, where
    a scheduler may have set RANK (Kubeflow's pod rank, SLURM_PROCID exported), which with one
    process a machine is its rank's RANK too."""
    try:
        env = proc.environ()
        if "ROLE_RANK" not in env:
            return False
        parent = proc.parent()
        if parent is None:
            return True
        parent_env = parent.environ()
        return any(env.get(key) != parent_env.get(key) for key in WORKER_KEYS)
    except psutil.Error:
        return False


def kill(procs: list[psutil.Process], sig=signal.SIGKILL) -> None:
    for proc in procs:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass


def pids(procs) -> str:
    return " ".join(str(p.pid) for p in procs)


def kill_stopped(procs: list[psutil.Process]) -> None:
    """A process that cannot answer (stopped, state T: SIGSTOP, a frozen rank) once the job stops is
    SIGKILLed at once: torchrun's agent SIGTERMs the other ranks when one has ended and SIGKILLs
    them only after its 30-s grace (pytorch#119856), and a stopped process never acts on a SIGTERM.
    """
    stopped = [p for p in procs if state(p) in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)]
    if stopped:
        say(
            f"{PREFIX}: process(es) {pids(stopped)} of this attempt are stopped (state T) and"
            " cannot answer the job's stop: killed at once (SIGKILL)"
        )
        kill(stopped)


class Supervisor:
    """Runs the launcher's children one at a time and passes the stop signals it receives on to
    them."""

    def __init__(self):
        self.child: subprocess.Popen | None = None
        self.signalled = ""
        for sig in FORWARDED:
            signal.signal(sig, self.forward)

    def forward(self, signum, _frame=None) -> None:
        self.signalled = self.signalled or FORWARDED[signum]
        if self.child is None:
            return
        sig = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
        others = group_but_leader(self.child.pid)
        try:
            if others:
                for pid in others:
                    try:
                        os.kill(pid, sig)
                    except OSError:
                        pass
            else:
                os.killpg(self.child.pid, sig)
        except OSError:
            pass

    def stop_job(self) -> None:
        """The job's group is SIGTERMed (the trainer checkpoints and stops), then SIGKILLed if it
        has not ended within GROUP_WAIT_S."""
        if self.child is None or self.child.poll() is not None:
            return
        pgid = self.child.pid
        say(f"{PREFIX}: the launcher stops on an error of its own: the job is stopped (SIGTERM)")
        try:
            os.killpg(pgid, signal.SIGTERM)
            self.child.wait(timeout=GROUP_WAIT_S)
        except (OSError, subprocess.TimeoutExpired):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass

    def run(self, cmd: list[str], env: dict[str, str], watch=None, stdout=None) -> int:
        """Runs cmd to its end through any signal (and `watch()` every LOOK_S while it runs); its
        status, as a shell gives it (128 + N for a signal N). Waits for the process group the child
        leaves, for its last writes."""
        self.child = subprocess.Popen(
            cmd,
            env=env,
            start_new_session=True,
            stdout=stdout,
            # (the death signal is sent when the thread that forks ends: this one, the main thread)
            preexec_fn=partial(job_process_setup, os.getpid()),
        )
        try:
            while True:
                try:
                    status = self.child.wait(timeout=LOOK_S)
                    break
                except subprocess.TimeoutExpired:
                    reap_orphans(self.child.pid)
                    if watch is not None:
                        watch()
            deadline = time.monotonic() + GROUP_WAIT_S
            while group_alive(self.child.pid) and time.monotonic() < deadline:
                reap_orphans()
                time.sleep(0.1)
        except BaseException:
            # The launcher itself fails (or is interrupted): the job must not run on unsupervised,
            # with no one to pass a signal on or relaunch it.
            self.stop_job()
            raise
        finally:
            self.child = None
        return 128 - status if status < 0 else status


class FrozenWatch:
    """While an attempt runs: stopped processes are killed from the first status a rank wrote (a
    survivor's 3), and a rank stopped for longer than `limit_s` (its peers' heartbeat wait: they
    have given it up and saved) is killed where no rank of this machine is left running to write a
    status: its launcher then ends and this machine joins the job's next attempt. Ranks only: a
    stopped agent or DataLoader worker is left to the ranks' own watches (their launcher's end,
    --timeout_s); a debugger's stop (state t) is left alone."""

    def __init__(self, status_dir: str, limit_s: float):
        self.status_dir, self.limit_s = status_dir, limit_s
        self.since: dict[int, float] = {}
        self.last_look = 0.0

    def __call__(self) -> None:
        try:
            written = any(entry.is_file() for entry in os.scandir(self.status_dir))
        except OSError:  # the folder removed under the job (a cleaner of /tmp): nothing written
            written = False
        if written:  # (faults/ is no status)
            kill_stopped(attempt_processes(self.status_dir))
        now = time.monotonic()
        if not self.limit_s or now - self.last_look < 1:
            return
        self.last_look = now
        ranks = [p for p in attempt_processes(self.status_dir) if is_rank(p)]
        frozen = [p for p in ranks if state(p) == psutil.STATUS_STOPPED]
        # (a rank of this machine still running speaks for it)
        if not frozen or len(frozen) < len(ranks):
            self.since.clear()
            return
        for proc in frozen:
            since = self.since.setdefault(proc.pid, now)
            if now - since >= self.limit_s:
                say(
                    f"{PREFIX}: rank process {proc.pid} of this attempt has been stopped (state T)"
                    f" for {int(now - since)} s, longer than its peers wait for it"
                    " (--heartbeat_timeout_s): killed (SIGKILL), so that this machine joins the"
                    " job's next attempt"
                )
                kill([proc])
                del self.since[proc.pid]


def ranks_ended(status_dir: str, supervisor: Supervisor, stop_s: float) -> None:
    """Ranks of this attempt that outlive its launcher (torchrun starts each in a session of its
    own: a SIGKILLed agent leaves them running) stop by themselves with a checkpoint (exit 3,
    resilience/preempt.py watch_launcher); nothing is relaunched, and no status read, before every
    process of the attempt on this machine has ended. Past `stop_s` they are SIGKILLed."""
    said = termed = False
    deadline = time.monotonic() + stop_s
    while True:
        left = attempt_processes(status_dir)
        if not left:
            return
        kill_stopped(left)
        if not said:
            say(
                f"{PREFIX}: the launcher ended but process(es) {pids(left)} of this attempt still"
                " run: waiting for them to stop (the ranks checkpoint the step they reached)"
            )
            said = True
        if supervisor.signalled and not termed:  # the launcher was told to stop: so are they
            kill(left, signal.SIGTERM)
            termed = True
        if time.monotonic() >= deadline:
            say(f"{PREFIX}: process(es) {pids(left)} did not stop within {stop_s:g} s: killed")
            kill(left)
            psutil.wait_procs(left, timeout=1)
            return
        # (then looked for again: a zombie a dead agent left is no process of the attempt)
        psutil.wait_procs(left, timeout=min(0.5, deadline - time.monotonic()))
