"""What ends a run other than success and the exit status each gives (docs/failures.md: Exit
statuses), and how it is reported: one line, by the process that should say it.

Every rank writes its status to ACCEL_TRAIN_STATUS_DIR (`report_status`, rank_files.py), because
`accelerate launch` returns 1 for any failed worker. The launcher reads those files and acts on the
most telling one, in the order of STATUS_PRIORITY (launcher/policy.py). A lost peer is told from a
bug by the exception's type and origin (`is_lost_peer`), never by its words alone.
"""

from __future__ import annotations

import re


class ConfigError(ValueError):
    """Bad user input: printed as one line naming the fix, exit status 2, nothing touched.

    `quiet`: every rank raised the same error; only the main process prints it."""

    quiet = False


class Preempted(Exception):
    """SIGTERM/SIGUSR1 reached a rank: every rank stopped at one step and checkpointed it
    (exit 4)."""


class Diverged(Exception):
    """The loss became non-finite: every rank stopped, nothing non-finite exported (exit 5)."""


class WorkerDidNotStart(RuntimeError):
    """A DataLoader worker did not reach Python in forks.FORK_ATTEMPTS forks: one line, exit 1."""


class LostPeer(RuntimeError):
    """A collective's result shows a peer is gone though the backend raised nothing (yet): on NCCL
    an all-gather that the watchdog aborted returns whatever its output held (docs/failures.md). A
    lost peer (exit 3)."""


EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_PREEMPTED, EXIT_DIVERGED = (
    0,
    1,
    2,
    3,
    4,
    5,
)
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process a Ctrl-C ended
# 128 + SIGKILL: launch.sh's status for a rank killed outright (kill -9, the OOM killer), which
# reports nothing itself: its abort note (exits.note_aborts) has no fault and no exit of Python's,
# and there is no status file of its own
EXIT_KILLED = 137

# The job's status when ranks ended differently, most telling first: a cause that a relaunch
# cannot fix (bad input, divergence, a rank of a gloo group ended by SIGABRT: a bug, counted as an
# error), then a rank aborted by the NCCL watchdog (no status file; counted as a lost peer), then an
# error, a second Ctrl-C, a preemption, a lost peer (its survivors saved the last step), and last a
# rank killed outright with no other rank saying more.
# The launcher's policy walks this list (launcher/policy.py). (A rank's abort note names its
# backend: exits.note_backend.)
CRASHED, ABORTED = "crash", "abort"
STATUS_PRIORITY = (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    CRASHED,
    ABORTED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_LOST_PEER,
    EXIT_KILLED,
)


def report_status(code: int) -> None:
    """Tell launch.sh this process's exit status (`accelerate launch` itself returns 1 for any
    failure): rank_files.py."""
    from .rank_files import write_status

    write_status(code)


def of_step(rows: list, step: int, what: str) -> list:
    """The rows an all-gather returned, each ending with the step every rank called it at: as they
    are, or LostPeer when a row is of no such step (what an all-gather that NCCL's watchdog aborted
    leaves: docs/failures.md)."""
    if any(r[-1] != step for r in rows):
        raise LostPeer(
            f"{what} at step {step} read rows of no rank "
            f"(steps {sorted({r[-1] for r in rows})}): its "
            "all-gather was aborted, a peer is gone (docs/failures.md)"
        )
    return rows


LOST_PEER_TYPES = ("DistNetworkError", "DistStoreError", "LostPeer")
# NCCL's texts, at the next collective once the watchdog saw a timeout or
# (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) aborted the communicator on an NCCL error. nccl2, the default
# "nccl" from torch 2.15: nccl2/WorkNCCL.cpp setTerminalStatus ("Watchdog caught ...: NCCL
# operation timed out"), nccl2/ProcessGroupNCCLUtils.cpp checkAndAbortIfTimedOutOrError ("NCCL
# operation timed out"; "... aborted after a previous error": the watchdog's communicator error,
# which a fault of this rank's own device can also be). The stock backend's "NCCL communicator was
# aborted on rank N. Original reason ..." (NCCLUtils.cpp getNcclComm) counts only by the reason it
# quotes, matched by the other patterns.
# gloo's own timeout (tcp/unbound_buffer.cc waitRecv): the rank whose recv timed out signals every
# pair of its context with the bare "Application timeout caused pair closure" (no file location),
# and another pending operation of that rank (DDP's all-reduce in the backward) can raise that text
# first: a peer silent for --timeout_s, a lost peer.
LOST_PEER_ORIGINS = re.compile(
    r"gloo/transport/|^Application timeout caused pair closure$|"
    r"ncclRemoteError|ncclSystemError|remote process exited|"
    r"Watchdog caught collective operation timeout|"
    r"NCCL operation timed out|"
    r"NCCL communicator was aborted after a previous error|"
    r"HCCL.*(timeout|heartbeat)",
    re.I | re.M,
)


def is_lost_peer(error: BaseException) -> bool:
    names = {c.__name__ for c in type(error).__mro__}
    if names & set(LOST_PEER_TYPES):
        return True
    return isinstance(error, RuntimeError) and bool(LOST_PEER_ORIGINS.search(str(error)))
