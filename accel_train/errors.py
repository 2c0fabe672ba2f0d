"""What ends a run other than success, the exit status each gives (docs/failures.md: Exit statuses), and how it is
reported: one line, by the process that should say it.

Every rank writes its status to ACCEL_TRAIN_STATUS_DIR (`report_status`), because `accelerate launch`
returns 1 for any failed worker. The launcher reads those files and acts on the most telling one, in the
order of STATUS_PRIORITY (launcher/policy.py). A lost peer is told
from a bug by the exception's type and origin (`is_lost_peer`), never by its words alone, and a rank's SIGABRT by
its process group's backend (`note_backend`).
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import os
import re
import socket
import sys
import time
from pathlib import Path


class ConfigError(ValueError):
    """Bad user input: printed as one line naming the fix, exit status 2, nothing touched.

    `quiet`: every rank raised the same error; only the main process prints it."""

    quiet = False


class Preempted(Exception):
    """SIGTERM/SIGUSR1 reached a rank: every rank stopped at one step and checkpointed it (exit 4)."""


class Diverged(Exception):
    """The loss became non-finite: every rank stopped, nothing non-finite exported (exit 5)."""


class LostPeer(RuntimeError):
    """A collective's result shows a peer is gone though the backend raised nothing (yet): on NCCL an all-gather that
    the watchdog aborted returns whatever its output held (docs/failures.md). A lost peer (exit 3)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its text, except where it has none to show (None: the text says
    what happens then, and "(default: None)" after it only contradicts it)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (ConfigError) instead of usage + exit; every command's
    parser (cli, evaluate, predict, preflight) is one of these, its help shown by HelpFormatter."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise ConfigError(f"{message} (see {self.prog} --help)")


EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_LOST_PEER, EXIT_PREEMPTED, EXIT_DIVERGED = 0, 1, 2, 3, 4, 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process a Ctrl-C ended
# 128 + SIGKILL: launch.sh's status for a rank killed outright (kill -9, the OOM killer), which reports nothing itself:
# its abort note (note_aborts) has no fault and no exit of Python's, and there is no status file of its own
EXIT_KILLED = 137

# The job's status when ranks ended differently, most telling first: a cause that a relaunch cannot fix (bad input,
# divergence, a rank of a gloo group ended by SIGABRT: a bug, counted as an error), then a rank aborted by the NCCL
# watchdog (no status file; counted as a lost peer), then an error, a second Ctrl-C, a preemption, a lost peer (its
# survivors saved the last step), and last a rank killed outright with no other rank saying more.
# The launcher's policy walks this list (launcher/policy.py). (A rank's abort note names its backend: note_backend.)
CRASHED, ABORTED = "crash", "abort"
STATUS_PRIORITY = (EXIT_BAD_INPUT, EXIT_DIVERGED, CRASHED, ABORTED, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_PREEMPTED,
                   EXIT_LOST_PEER, EXIT_KILLED)


def report_status(code: int) -> None:
    """Tell launch.sh this process's exit status (`accelerate launch` itself returns 1 for any failure)."""
    folder = os.environ.get("ACCEL_TRAIN_STATUS_DIR")
    if folder:
        try:
            Path(folder, f"{socket.gethostname()}-{os.getpid()}").write_text(f"{code}\n")
        except OSError:
            pass


def of_step(rows: list, step: int, what: str) -> list:
    """The rows an all-gather returned, each ending with the step every rank called it at: as they are, or LostPeer
    when a row is of no such step (what an all-gather that NCCL's watchdog aborted leaves: docs/failures.md)."""
    if any(r[-1] != step for r in rows):
        raise LostPeer(f"{what} at step {step} read rows of no rank (steps {sorted({r[-1] for r in rows})}): its "
                       "all-gather was aborted, a peer is gone (docs/failures.md)")
    return rows


LOST_PEER_TYPES = ("DistNetworkError", "DistStoreError", "LostPeer")
# NCCL's texts, at the next collective once the watchdog saw a timeout or (TORCH_NCCL_ASYNC_ERROR_HANDLING=2) aborted
# the communicator on an NCCL error. nccl2, the default "nccl" from torch 2.15: nccl2/WorkNCCL.cpp setTerminalStatus
# ("Watchdog caught ...: NCCL operation timed out"), nccl2/ProcessGroupNCCLUtils.cpp checkAndAbortIfTimedOutOrError
# ("NCCL operation timed out"; "... aborted after a previous error": the watchdog's communicator error, which a
# fault of this rank's own device can also be). The stock backend's "NCCL communicator was aborted on rank N. Original
# reason ..." (NCCLUtils.cpp getNcclComm) counts only by the reason it quotes, matched by the other patterns.
# gloo's own timeout (tcp/unbound_buffer.cc waitRecv): the rank whose recv timed out signals every pair of its context
# with the bare "Application timeout caused pair closure" (no file location), and another pending operation of that
# rank (DDP's all-reduce in the backward) can raise that text first: a peer silent for --timeout_s, a lost peer.
LOST_PEER_ORIGINS = re.compile(r"gloo/transport/|^Application timeout caused pair closure$|"
                               r"ncclRemoteError|ncclSystemError|remote process exited|"
                               r"Watchdog caught collective operation timeout|NCCL operation timed out|"
                               r"NCCL communicator was aborted after a previous error|HCCL.*(timeout|heartbeat)",
                               re.I | re.M)


def is_lost_peer(error: BaseException) -> bool:
    names = {c.__name__ for c in type(error).__mro__}
    if names & set(LOST_PEER_TYPES):
        return True
    return isinstance(error, RuntimeError) and bool(LOST_PEER_ORIGINS.search(str(error)))


def note_aborts() -> None:
    """Under launch.sh: a rank ended by SIGABRT (NCCL's watchdog at the collective timeout, no Python exception)
    leaves a note in ACCEL_TRAIN_STATUS_DIR/faults/ (Python's faulthandler), which launch.sh reads as a lost peer."""
    folder = os.environ.get("ACCEL_TRAIN_STATUS_DIR")
    if not folder:
        return
    try:
        Path(folder, "faults").mkdir(exist_ok=True)
        note = open(Path(folder, "faults", f"{socket.gethostname()}-{os.getpid()}"), "w")
    except OSError:
        return
    faulthandler.enable(file=note)  # (it keeps the file open as long as it is enabled)
    if not _fault_notes:
        atexit.register(_note_exit)
    _fault_notes.append(note)


def _note_exit() -> None:
    """Python runs its exit (any status; os._exit paths report theirs first): the note says so, and launch.sh tells
    this rank from one killed outright (SIGKILL: no fault, no exit, no status; EXIT_KILLED)."""
    for note in _fault_notes:
        try:
            note.write("exit: python\n")
            note.flush()
        except (OSError, ValueError):
            pass


_fault_notes: list = []


def note_backend(backend) -> None:
    """Once the process group exists, its backend heads this rank's abort note (`backend: gloo`). launch.sh counts a
    SIGABRT as a lost peer only where the backend aborts for one (NCCL's watchdog, at the collective timeout). gloo
    never does: a closed or reset connection and its timeouts are raised in the calling thread (tcp/pair.cc
    signalException: "Connection closed by peer", "Read error ...: Connection reset by peer", "Read timeout"); it
    aborts only when a check of its own fails in its I/O thread, e.g. a collective mismatch ("op.preamble.length <=
    op.nbytes ... Received data size doesn't match expected size. Is there a distributed collective mismatch in your
    code?"): a bug, exit status 1, never relaunched."""
    for note in _fault_notes:
        try:
            note.write(f"backend: {backend}\n")
            note.flush()  # (before anything faulthandler writes at the file's offset)
        except (OSError, ValueError):
            pass


def counted(n: int, noun: str) -> str:
    """'1 step', '3 steps', '1 class', '2 classes': a count in words, for the lines a user reads."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith(('s', 'sh', 'ch', 'x')) else 's'}"


def end_progress_line() -> bool:
    """A final or error line starts on a line of its own: an open progress bar (tqdm redraws its line after a
    carriage return and ends it only when closed) is closed first, which ends its line. True if one was open."""
    bars = list(getattr(getattr(sys.modules.get("tqdm.std"), "tqdm", None), "_instances", ()))
    for bar in bars:
        bar.close()
    return any(not bar.disable for bar in bars)


STARTED = time.time()  # (a peer's bad-input note from before this process started is an earlier run's)


def note_bad_input(output_dir, error: Exception) -> None:
    """Bad input met mid-run by this rank alone (a file a DataLoader worker could not decode): a note in the output
    dir, so that its peers, which only see it gone, say the same line and exit 2 as well (peer_gone, lost_peer)."""
    if isinstance(error, ConfigError) and output_dir:
        try:
            Path(output_dir, f".bad_input.{socket.gethostname()}.{os.getpid()}").write_text(str(error))
        except OSError:
            pass


def clear_notes(output_dir) -> None:
    """The notes of earlier runs (note_bad_input), removed by a writer of the directory once it holds
    it, at start-up: they are read only by the peers of the run that wrote them, at its end, and this
    run's ranks write theirs only once training has started."""
    for note in Path(output_dir).glob(".bad_input.*"):
        note.unlink(missing_ok=True)


def bad_input_of_peer(output_dir, pids=()) -> str | None:
    """A peer's note of this run (note_bad_input): of one of `pids` on this machine, or (none given) any."""
    names = [f".bad_input.{socket.gethostname()}.{pid}" for pid in pids] if pids else None
    if not output_dir:
        return None
    try:
        notes = [p for p in Path(output_dir).glob(".bad_input.*") if names is None or p.name in names]
        return next((p.read_text() for p in notes if p.stat().st_mtime >= STARTED - 1), None)
    except OSError:
        return None


def peer_gone(text: str, said: str, output_dir, pids) -> None:
    """The survivor's signal watch found a local peer gone: `text`, exit 3; or the bad input the peer met, exit 2
    (written without print: the main thread may be in the middle of a write to sys.stderr)."""
    bad = bad_input_of_peer(output_dir, pids)
    line = f"{bad} (met by rank process {pids[0]}); {said}" if bad else text
    try:
        os.write(sys.__stderr__.fileno(), f"\naccel-train: error: {line}\n".encode())
    except Exception:  # (no stderr, a full pipe)
        pass
    report_status(EXIT_BAD_INPUT if bad else EXIT_LOST_PEER)
    os._exit(EXIT_BAD_INPUT if bad else EXIT_LOST_PEER)


def lost_peer(error: Exception, cfg) -> None:
    """A collective failed: a peer died or stopped answering. One line, then exit without teardown
    (destroying a process group whose peer is gone can hang); the bad input a peer met, if it left a note, exit 2."""
    from .files import checkpoint_dirs, resumed_from
    text = " ".join(str(error).split())
    peer = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", text) or re.search(r"(\d+\.\d+\.\d+\.\d+:\d+)", text)
    detail = re.sub(r"\[/?[^\]]*\.(cc|cpp|hpp):\d+\]\s*", "", text)[:160]
    found = checkpoint_dirs(cfg.output_dir) or [p for p in [resumed_from(cfg.output_dir)] if p]  # (or its start)
    where = f"newest complete checkpoint: {found[-1]}" if found else "no complete checkpoint yet"
    if getattr(error, "survivor", None):  # the last completed step, written by this machine's survivor (survivor.py)
        where = error.survivor if found and str(found[-1]) in error.survivor else f"{error.survivor}; {where}"
    end_progress_line()
    if (bad := bad_input_of_peer(cfg.output_dir)) is not None:
        print(f"accel-train: error: {bad} (met by a peer); {where}", file=sys.stderr, flush=True)
        report_status(EXIT_BAD_INPUT)
        os._exit(EXIT_BAD_INPUT)
    print(f"accel-train: error: lost contact with peer {peer.group(1) if peer else '(unknown)'} during a collective "
          f"({detail}); the job stops here, {where}; relaunch with --resume auto (launch.sh --max_restarts N does "
          "it) once every node is back", file=sys.stderr, flush=True)
    report_status(EXIT_LOST_PEER)
    os._exit(EXIT_LOST_PEER)
