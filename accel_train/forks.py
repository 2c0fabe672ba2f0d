"""DataLoader workers forked as multiprocessing forks them, then seen to reach Python code.

A trainer forks its loader workers while other threads run: gloo's (c10d's run loop takes the GIL
from C++, creating a Python thread state each time), the heartbeat's, the stop watch's. CPython
before 3.11.10 (and 3.10.15; fixed in 3.12) takes its thread-state lock in the child before it
resets it (gh-112275: PyOS_AfterFork_Child -> _PyEval_ReInitThreads -> HEAD_LOCK): a fork while
another thread holds that lock leaves a child that never runs a line of Python and never dies. The
DataLoader's liveness check passes (the child is alive), its batches never come, and every rank
waits in its next collective until --timeout_s. tests/test_forks.py reproduces it with native
threads that enter Python (docs/failures.md).

So each worker writes one byte once it runs Python; a child that has not within FORK_START_S is
killed (it holds nothing yet: it never ran) and forked again. Nothing else changes: the same fork,
the same worker, no pickling of the Dataset (forkserver's cost and its rules for a script's own
Datasets), on every Python.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.popen_fork
import os
import select
import signal
import sys

FORK_START_S = 5.0  # a child past fork runs Python in milliseconds, even on a loaded machine
FORK_ATTEMPTS = 4   # the lock is held for microseconds: a second fork all but always gets through


class WorkerDidNotStart(RuntimeError):
    pass


def worker_context():
    """The DataLoader's multiprocessing_context: FORK where workers would be forked (Linux's default
    up to Python 3.13, unless a script set another start method), else None: spawn and forkserver
    (macOS, Windows, Python 3.14) start from a fresh interpreter and hold no thread's lock."""
    method = multiprocessing.get_start_method(allow_none=True)
    return FORK if (method or multiprocessing.get_all_start_methods()[0]) == "fork" else None


class _SeenToStart(multiprocessing.popen_fork.Popen):
    def _launch(self, process_obj):
        for attempt in range(1, FORK_ATTEMPTS + 1):
            process_obj._started = os.pipe()
            try:
                super()._launch(process_obj)
            finally:
                os.close(process_obj._started[1])
            ready = process_obj._started[0]
            try:  # (a child that ended by itself closes the pipe: the DataLoader reports it)
                if select.select([ready], [], [], FORK_START_S)[0]:
                    return
            finally:
                os.close(ready)
            os.kill(self.pid, signal.SIGKILL)  # it never ran: it holds nothing
            os.waitpid(self.pid, 0)
            self.finalizer()  # (its sentinel pipes)
            if attempt == FORK_ATTEMPTS:
                break
            sys.stderr.write(f"accel-train: warning: a DataLoader worker forked while another "
                             f"thread held Python's thread-state lock did not start in "
                             f"{FORK_START_S:g} s (CPython gh-112275, fixed in Python 3.11.10 and "
                             f"3.12); forked it again (attempt {attempt + 1} of {FORK_ATTEMPTS})\n")
        raise WorkerDidNotStart(f"a DataLoader worker did not start in {FORK_ATTEMPTS} forks of "
                                f"{FORK_START_S:g} s each; --num_workers 0 loads in the trainer")


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
