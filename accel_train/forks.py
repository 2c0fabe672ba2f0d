"""DataLoader workers forked as multiprocessing forks them, then seen to reach Python code.

A trainer forks its loader workers while other threads run: gloo's (c10d's run loop takes the GIL
from C++, creating a Python thread state each time), the heartbeat's, the stop watch's. CPython
before 3.11.10 (and 3.10.15; fixed in 3.12) takes its thread-state lock in the child before it
resets it (gh-112275: PyOS_AfterFork_Child -> _PyEval_ReInitThreads -> HEAD_LOCK): a fork while
another thread holds that lock leaves a child that never runs a line of Python and never dies. The
DataLoader's liveness check passes (the child is alive), its batches never come, and every rank
waits in its next collective until --timeout_s. tests/test_forks.py reproduces it with native
threads that enter Python (docs/failures.md).

So each worker writes one byte once it runs Python; a child that has not within FORK_START_S (then
twice that, ...) is killed (it holds nothing yet: it never ran) and forked again. Nothing else
changes: the same fork, the same worker, no pickling of the Dataset (forkserver's cost and its rules
for a script's own Datasets). On every Python: any child stuck before its first line is caught.
"""

from __future__ import annotations

import multiprocessing.connection
import multiprocessing.context
import multiprocessing.popen_fork
import os
import signal
import sys
from pathlib import Path

from .errors import WorkerDidNotStart

# A child past fork runs Python in milliseconds, even on a loaded machine; each further attempt
# waits twice as long (a child slow for a reason it inherits is slow again: it gets the time).
FORK_START_S = 5.0
FORK_ATTEMPTS = 4  # the lock is held for microseconds: a second fork all but always gets through
AFFECTED = (3, 11) <= sys.version_info < (3, 11, 10) or (3, 10) <= sys.version_info < (3, 10, 15)


def worker_context():
    """The DataLoader's multiprocessing_context: FORK where workers would be forked (Linux's default
    up to Python 3.13, unless a script set another start method), else None: spawn and forkserver
    (macOS, Windows, Python 3.14) start from a fresh interpreter and hold no thread's lock."""
    method = multiprocessing.get_start_method(allow_none=True)
    return FORK if (method or multiprocessing.get_all_start_methods()[0]) == "fork" else None


def process_state(pid: int) -> str | None:
    """A process's state letter (proc(5): R running, S sleeping, D disk ...); None: unreadable."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def not_started_why(state: str | None, affected: bool) -> str:
    """Why a forked worker did not reach Python, as far as its state tells: one that still runs (or
    waits on the disk) was only slow (a busy machine); one that sleeps, on a Python with the bug,
    is the one CPython gh-112275 leaves stuck for ever."""
    if state in ("R", "D"):
        return "still running: slow, on a busy machine"
    if affected:
        return (
            "asleep: Python before 3.11.10 and 3.10.15 can leave a child forked beside other "
            "threads stuck for ever (CPython gh-112275)"
        )
    return "stuck or slow"


class _SeenToStart(multiprocessing.popen_fork.Popen):
    state_at_end: str | None = None

    def _launch(self, process_obj):
        for attempt in range(1, FORK_ATTEMPTS + 1):
            wait_s = FORK_START_S * 2 ** (attempt - 1)
            if self._started_in(process_obj, wait_s):
                return
            if attempt < FORK_ATTEMPTS:
                why = not_started_why(self.state_at_end, AFFECTED)
                sys.stderr.write(
                    f"accel-train: warning: DataLoader worker {self.pid} did not "
                    f"reach Python in {wait_s:g} s ({why}); forked it again "
                    f"(attempt {attempt + 1} of {FORK_ATTEMPTS})\n"
                )
        fixed = "; Python 3.11.10+ or 3.12 has the fix (CPython gh-112275)" if AFFECTED else ""
        raise WorkerDidNotStart(
            f"a DataLoader worker did not reach Python in {FORK_ATTEMPTS} "
            f"forks (the last waited {wait_s:g} s); --num_workers 0 loads in "
            f"the trainer{fixed}"
        )

    def _started_in(self, process_obj, wait_s: float) -> bool:
        """Fork once (multiprocessing's own launch): True once the child runs Python; False (the
        child killed, reaped and its pipes closed) if it has not in `wait_s`, nor ended by itself
        (then the DataLoader reports it)."""
        ready, started = process_obj._started = os.pipe()
        try:
            super()._launch(process_obj)
        except BaseException:
            os.close(ready)
            raise
        finally:
            os.close(started)
        try:  # (the child ended before its pipe closes: a late child's write cannot fail)
            if multiprocessing.connection.wait([ready], wait_s):  # (poll: any fd number)
                return True
            self._end()
            return False
        except BaseException:  # (Ctrl-C, a SIGCHLD handler's error): no child left behind
            self._end()
            raise
        finally:
            os.close(ready)

    def _end(self) -> None:
        """The child that never ran: it holds nothing. Its state first (why it did not start)."""
        self.state_at_end = process_state(self.pid)
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        self.finalizer()  # (its sentinel pipes)


if hasattr(os, "fork"):

    class _SeenToStartProcess(multiprocessing.context.ForkProcess):
        @staticmethod
        def _Popen(process_obj):
            return _SeenToStart(process_obj)

        def run(self):
            ready, started = self._started
            os.close(ready)
            os.write(started, b"1")  # this child runs Python: it is past the lock
            os.close(started)
            super().run()

    class SeenToStart(multiprocessing.context.ForkContext):
        """Fork, as multiprocessing does, each child seen to start (_SeenToStart)."""

        Process = _SeenToStartProcess

    FORK = SeenToStart()
