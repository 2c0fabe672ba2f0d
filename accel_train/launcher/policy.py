"""What the attempt's ranks reported, and what follows: relaunch, or exit with which status and
line.

Every rank writes its own exit status to a file in ACCEL_TRAIN_STATUS_DIR (accelerate launch returns
1 for any failed worker); the most telling one decides (errors.STATUS_PRIORITY). A rank that ended
by SIGABRT wrote none: NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3, the user's own)
aborts a rank at the process-group timeout without a Python exception. Each rank's faulthandler
notes the abort in ACCEL_TRAIN_STATUS_DIR/faults/; such a rank counts as a lost peer (3), and the
SIGTERM that torchrun then sends the other ranks does not make their exit a preemption. Not in a
gloo group (the note's "backend: gloo" line): gloo raises a lost peer in the rank's own thread and
aborts only when a collective breaks its rules (a collective mismatch), a bug: an error (1),
whatever the "lost contact" of the other ranks (exits.note_backend). A rank killed outright
(SIGKILL: kill -9, the OOM killer) writes nothing: its note says neither a fault nor Python's exit
("exit: python") and no status file bears its name. It is 137 (128 + SIGKILL), relaunched, unless
another rank says more (a survivor's lost peer, 3). Pure: a Report (the folder's contents,
rank_files.read_report, the files' one reader) in, a Decision out."""

from __future__ import annotations

from dataclasses import dataclass

from .. import errors
from ..rank_files import (
    ABORTED,
    Report,
    killed_outright,
    lines_starting,
    noted_backends,
    read_report,
)
from . import PREFIX

__all__ = ["Decision", "Report", "decide", "read_report", "trainer_status"]


@dataclass
class Decision:
    lines: list[str]  # what the launcher says, in order
    exit_status: int | None  # None: relaunch


def abort_backends(report: Report) -> list[str]:
    """One entry per rank that ended by SIGABRT: its process group's backend (none: before the
    group)."""
    out = []
    for note in report.notes.values():
        if lines_starting(note, ABORTED):
            out += noted_backends(note) or ["none"]
    return out


def aborted(report: Report) -> bool:
    return any(b != "gloo" for b in abort_backends(report))


def crashed(report: Report) -> bool:
    return "gloo" in abort_backends(report)


def killed_ranks(report: Report) -> list[str]:
    """The host-pid of each rank that ended without a fault, without Python's exit, without a
    status and without a SIGTERM in start-up (torchrun stopping the ranks a killed one left)."""
    return sorted(
        name
        for name, note in report.notes.items()
        if name not in report.statuses and name not in report.terminated and killed_outright(note)
    )


def trainer_status(report: Report) -> int | None:
    """The most telling status the ranks reported (errors.STATUS_PRIORITY), None where none did."""
    codes = " ".join(report.statuses.values()).split()
    for c in errors.STATUS_PRIORITY:
        if c == errors.CRASHED:
            if crashed(report):
                return errors.EXIT_ERROR
        elif c == errors.ABORTED:
            if aborted(report):
                return errors.EXIT_LOST_PEER
        elif c == errors.EXIT_KILLED:
            if killed_ranks(report):
                return errors.EXIT_KILLED
        elif str(c) in codes:
            return c
    return None


def finished(report: Report, nproc: int) -> bool:
    """Every rank of this machine wrote status 0: the run ended, whatever its launcher says."""
    return len(report.statuses) == nproc and all(
        s.rstrip("\n") == "0" for s in report.statuses.values()
    )


def not_rejoined(wait_s: int) -> str:
    return (
        f"{PREFIX}: the other machine(s) did not rejoin within {wait_s} s (--rejoin_wait): a lost"
        " peer (exit status 3); the newest checkpoint is kept: start launch.sh on every machine"
        " again, with --resume auto"
    )


def decide(
    status: int,
    report: Report,
    *,
    nproc: int,
    signalled: str = "",
    restart_on_preempt: bool = False,
    attempt: int = 0,
    max_restarts: int = 0,
    machines: int = 1,
    waited_s: float = 0.0,
    rejoin_wait_s: int = 0,
) -> Decision:
    """After an attempt whose launcher ended with `status` after `waited_s` seconds (attempt counts
    from 0): relaunch, or exit."""
    lines: list[str] = []
    reported = trainer_status(report)
    # A relaunch of several machines whose rendezvous waited --rejoin_wait for the others in vain:
    # no rank started, so none reported. Another relaunch would wait again for machines that are
    # not coming (their launcher stopped, or gave up itself); whoever restarts the job restarts
    # them all.
    if (
        attempt
        and machines > 1
        and status
        and not signalled
        and not report.anything
        and waited_s >= rejoin_wait_s
    ):
        return Decision([not_rejoined(rejoin_wait_s)], errors.EXIT_LOST_PEER)
    # A stop signal while the job started: the ranks died of it before their handlers were installed
    # (no status, no note of any rank); as a signal before the job started, nothing to save
    if status and signalled and reported is None and not report.anything:
        return Decision(
            [f"{PREFIX}: stopped by SIG{signalled} while the job started (nothing to save)"], 4
        )
    # A stop signal as the run ended: the ranks finished (status 0) but their launcher died of the
    # signal passed on to its group (accelerate's simple launcher: 143; torchrun's agent: 1)
    if status and reported is None and finished(report, nproc):
        lines.append(
            f"{PREFIX}: the launcher ended with status {status}, but every rank here had finished"
            " the run: exit status 0"
        )
        status = 0
    if reported == errors.EXIT_LOST_PEER and aborted(report):
        lines.append(
            f"{PREFIX}: a rank ended by SIGABRT (NCCL's watchdog does this at the --timeout_s"
            " collective timeout when a peer is gone): a lost peer (exit status 3)"
        )
    elif reported == errors.EXIT_KILLED:
        lines.append(
            f"{PREFIX}: a rank was killed by a signal it cannot handle (SIGKILL: kill -9, the OOM"
            f" killer; host-pid {' '.join(killed_ranks(report))}) and reported nothing: exit"
            " status 137"
        )
    elif reported == errors.EXIT_ERROR and crashed(report):
        lines.append(
            f"{PREFIX}: a rank of a gloo process group ended by SIGABRT: gloo aborts only when a"
            " collective breaks its rules, e.g. ranks passing tensors of different sizes"
            " ('collective mismatch' above), a bug; the other ranks' 'lost contact' is that"
            " rank's end"
        )
    if status == 0:
        return Decision(lines, 0)
    stopped = sorted(report.terminated - set(report.statuses))
    if stopped and not signalled:
        lines.append(
            f"{PREFIX}: rank(s) host-pid {' '.join(stopped)} ended by SIGTERM while the job started"
            " (torchrun stops the ranks beside one that failed; a rank whose launcher is gone stops"
            " itself)"
        )
    # The launcher's 1 before any rank wrote anything: on one machine (no rendezvous to fail) an
    # error of accelerate's or of the trainer's start (traceback above), never relaunched; across
    # machines the rendezvous failing, a machine missing, which a relaunch is for
    if status == errors.EXIT_ERROR and reported is None and not report.anything and machines == 1:
        return Decision(
            lines
            + [
                f"{PREFIX}: the job failed (exit status 1) before any rank started: an error (the"
                " cause is above); not relaunched"
            ],
            errors.EXIT_ERROR,
        )
    final = {
        errors.EXIT_BAD_INPUT: "bad input (exit status 2, the cause is above); not relaunched",
        errors.EXIT_DIVERGED: "the training diverged (exit status 5); not relaunched",
        errors.EXIT_ERROR: (
            "the trainer failed with an error (exit status 1, traceback above); not relaunched"
        ),
        errors.EXIT_INTERRUPTED: (
            "stopped at once by a second Ctrl-C (exit status 130): no checkpoint of this step"
        ),
    }
    if reported in final:
        return Decision(lines + [f"{PREFIX}: {final[reported]}"], reported)
    if reported == errors.EXIT_PREEMPTED and (signalled or not restart_on_preempt):
        return Decision(
            lines
            + [
                f"{PREFIX}: preempted (exit status 4): a checkpoint of the reached step was "
                "written; continue with --resume auto"
            ],
            reported,
        )
    # a lost peer (3), a rank killed outright (137; or nothing reported), or a preemption
    # --restart_on_preempt relaunches
    status = reported if reported is not None else status
    if signalled:
        return Decision(
            lines + [f"{PREFIX}: stopped by SIG{signalled} (exit status {status})"], status
        )
    if attempt >= max_restarts:
        return Decision(
            lines
            + [
                f"{PREFIX}: the job failed with exit status {status} after {attempt + 1} attempt(s)"
            ],
            status,
        )
    return Decision(
        lines
        + [
            f"{PREFIX}: the job failed (exit status {status}); relaunching to resume from the "
            "newest checkpoint"
        ],
        None,
    )
