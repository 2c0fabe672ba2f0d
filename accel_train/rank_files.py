"""The files a rank leaves its launcher in ACCEL_TRAIN_STATUS_DIR (one folder per attempt, set by
launch.sh): written by the rank (errors.report_status, exits.note_aborts), read by the launcher's
relaunch policy (launcher/policy.py). `accelerate launch` itself returns 1 for any failed worker, so
these files are how the launcher knows what each rank met.

- `<host>-<pid>`: the rank's exit status;
- `faults/<host>-<pid>`: its note: what Python's faulthandler writes at a fatal signal (SIGABRT:
  NCCL's watchdog at the collective timeout), `backend: <name>` once the process group exists, and
  `exit: python` when Python runs its exit. A note with neither a fatal error nor Python's exit, and
  no status, is a rank killed outright (SIGKILL);
- `faults/<host>-<pid>.SIGTERM`: the stack of a SIGTERM that ended the rank before the run's own
  stop handler replaced the note's (torchrun stopping the ranks beside a failed one).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

STATUS_DIR = "ACCEL_TRAIN_STATUS_DIR"  # the environment variable that names the folder
FAULTS = "faults"  # the notes' folder in it
BACKEND = "backend: "  # a note's line naming the process group's backend
PYTHON_EXIT = "exit: python"  # a note's line: Python ran its exit
FATAL = "Fatal Python error"  # how faulthandler starts what it writes at a fatal signal
ABORTED = FATAL + ": Aborted"  # ... at SIGABRT
TERM_NOTE = ".SIGTERM"  # the suffix of a note's SIGTERM file


def rank_name() -> str:
    """This process's name in the folder: host-pid (the pid alone repeats across machines)."""
    return f"{socket.gethostname()}-{os.getpid()}"


def folder() -> Path | None:
    """This attempt's folder, None where no launch.sh started the process."""
    named = os.environ.get(STATUS_DIR)
    return Path(named) if named else None


def write_status(code: int) -> None:
    """The rank's exit status, for its launcher (nothing outside launch.sh)."""
    where = folder()
    if where is not None:
        try:
            (where / rank_name()).write_text(f"{code}\n")
        except OSError:
            pass


def open_notes():
    """(the note, its SIGTERM file), opened for writing; None outside launch.sh or where the folder
    cannot be written."""
    where = folder()
    if where is None:
        return None
    note = where / FAULTS / rank_name()
    try:
        note.parent.mkdir(exist_ok=True)
        return open(note, "w"), open(note.with_name(note.name + TERM_NOTE), "w")
    except OSError:
        return None


@dataclass
class Report:
    """What an attempt's ranks left in the folder."""

    # a rank's host-pid -> the status it wrote
    statuses: dict[str, str] = field(default_factory=dict)
    # a rank's host-pid -> its note
    notes: dict[str, str] = field(default_factory=dict)
    # the host-pid of each rank a SIGTERM ended during start-up (its note's TERM_NOTE file)
    terminated: set[str] = field(default_factory=set)
    anything: bool = False  # the folder holds anything at all (a rank started far enough to write)


def read_report(where) -> Report:
    """The folder `where`, read (the only reader of these files)."""
    where = Path(where)
    report = Report()
    for path in where.iterdir() if where.is_dir() else ():
        report.anything = True
        if path.is_file():
            report.statuses[path.name] = path.read_text(errors="replace")
    faults = where / FAULTS
    for path in faults.iterdir() if faults.is_dir() else ():
        if not path.is_file():
            continue
        if path.name.endswith(TERM_NOTE):
            if path.stat().st_size:  # (written only when the signal came)
                report.terminated.add(path.name.removesuffix(TERM_NOTE))
        else:
            report.notes[path.name] = path.read_text(errors="replace")
    return report


def lines_starting(note: str, start: str) -> list[str]:
    return [line for line in note.splitlines() if line.startswith(start)]


def noted_backends(note: str) -> list[str]:
    """The backends a note names (none before the process group)."""
    return [b for b in (line[len(BACKEND) :] for line in lines_starting(note, BACKEND)) if b]


def killed_outright(note: str) -> bool:
    """A note with neither a fatal error nor Python's exit (with no status: SIGKILL)."""
    return not lines_starting(note, FATAL) and not lines_starting(note, PYTHON_EXIT)
