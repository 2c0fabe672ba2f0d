"""How a rank's process ends (docs/failures.md): its output flushed and its status out with
`os._exit`, its DataLoader workers ended first, no interpreter teardown that can hang or abort
(gloo's threads, multiprocessing's exit join); and which process of a group speaks for it. Its exit
paths when a peer is lost (`lost_peer`, `peer_gone`: one line and exit 3, or exit 2 with the bad
input a peer noted, `note_bad_input`) and the abort note launch.sh reads of a rank that SIGABRT
ended, headed by its process group's backend (`note_aborts`, `note_backend`)."""

from __future__ import annotations

import atexit
import faulthandler
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from .errors import EXIT_BAD_INPUT, EXIT_LOST_PEER, ConfigError, report_status
from .lines import end_progress_line
from .rank_files import BACKEND, PYTHON_EXIT, open_notes


def process_group():
    """accelerate's PartialState when this process is one of several ranks of a process group, else
    None. Never creates one (that is a rendezvous): only reads the state an Accelerator already set
    up."""
    state = sys.modules.get("accelerate.state")
    if state is None or state.PartialState._shared_state == {}:
        return None
    group = state.PartialState()
    return group if group.num_processes > 1 else None


def exit_rank(code: int) -> None:
    """A rank of a process group ends here with its status, output flushed, without interpreter
    finalization. Left to finalization, the group's threads (gloo's, kept alive by the DDP model's
    reducer whether or not the group was destroyed) can be torn down mid-flight: the rank then dies
    of SIGABRT ("terminate called without an active exception") instead of exiting with its status.
    CI saw it in test_full_disk; two bare gloo ranks exiting after a barrier: 4 of 90 runs. (A lost
    peer _exits at once: lost_peer.) Every file the trainer writes is closed by then. One process: a
    normal exit."""
    end_workers()
    if process_group() is None:
        return
    # What Python's exit does before it tears the interpreter down: the atexit handlers (trackers'
    # own shutdown, multiprocessing's, which ends the DataLoader workers, logging's flush). The
    # teardown after them is the race.
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def end_workers() -> None:
    """Before exit: end the DataLoader workers still running. A worker leaves a first SIGTERM to the
    trainer (data/load.py), and multiprocessing's exit handler sends exactly one, then joins without
    a timeout: a run whose persistent workers outlived its loop (your own Datasets, 2 ranks) hung
    there. A worker holds nothing to save. Other daemonic processes (a script's own) get that
    handler's SIGTERM, here, and up to 5 s to end."""
    mp = sys.modules.get("multiprocessing")
    daemonic = [c for c in mp.active_children() if c.daemon] if mp is not None else []
    children = [c for c in daemonic if _is_loader_worker(c)]
    if daemonic:
        # torch's DataLoader SIGCHLD handler would raise "DataLoader worker ... is killed by
        # signal" in the join
        try:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except ValueError:  # (not the main thread)
            pass
    for child in children:
        child.kill()
        child.join(5)
    # A worker still starting when we looked (fork copies the trainer's SIGTERM handler, which only
    # records it) absorbs multiprocessing's one SIGTERM and then waits for batches: the exit would
    # hang. The others get that SIGTERM here; one that becomes a loader worker meanwhile is killed.
    others = [c for c in daemonic if c.is_alive()]
    for child in others:
        child.terminate()
    deadline = time.monotonic() + 5
    while others and time.monotonic() < deadline:
        others = [c for c in others if c.is_alive()]
        for child in [c for c in others if _is_loader_worker(c)]:
            child.kill()
        time.sleep(0.05)


def _is_loader_worker(process) -> bool:
    """A DataLoader worker that leaves signals to the trainer: it ignores SIGINT and SIGUSR1
    (data/load.py _leave_signals_to_the_trainer), as /proc/<pid>/status's SigIgn mask says
    (bit signum - 1). Python 3.11's Process.start drops the target it ran, so the process object
    cannot say. Without /proc: every daemonic child, as before."""
    try:
        with open(f"/proc/{process.pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    except (OSError, StopIteration, ValueError):
        return True
    wanted = (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGUSR1 - 1))
    return mask & wanted == wanted


# Variables a multi-process launcher sets (torchrun; MPI's, which accelerate reads for CPU ranks).
LAUNCHER_VARS = ("TORCHELASTIC_RUN_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
# How long a rank that leaves a shared start-up error to its machine's first process waits before
# exiting: torchrun stops the other ranks once one exits, and the first must have printed by then.
QUIET_EXIT_DELAY_S = 2.0


def says_shared_errors() -> bool:
    """Whether this process prints an error it did not mark quiet.

    Inside a process group (an Accelerator exists) a rank prints what it raised: errors every rank
    raises alike are marked quiet on all but the main process where they are raised
    (ranks.said_once, on_every_rank). Before the group exists (arguments, --config, --log_with: the
    same argv and environment on every rank of a machine, so every rank fails alike) only the
    machine's first process prints. It is known from the launcher's environment as accelerate reads
    it (get_cpu_distributed_information, what PartialState uses for CPU ranks), without the
    rendezvous a PartialState would start; the others wait a moment so that torchrun, which stops
    the remaining ranks when one exits, does not stop the first before it has printed."""
    if process_group() is not None or not any(v in os.environ for v in LAUNCHER_VARS):
        return True  # (no launcher started several processes here: skip accelerate's import)
    from accelerate.utils import get_cpu_distributed_information

    if get_cpu_distributed_information().local_rank == 0:
        return True
    time.sleep(QUIET_EXIT_DELAY_S)
    return False


def note_aborts() -> None:
    """Under launch.sh: a rank ended by SIGABRT (NCCL's watchdog at the collective timeout, no
    Python exception) leaves a note (rank_files.py: Python's faulthandler), which launch.sh reads as
    a lost peer. A SIGTERM during start-up (torchrun stops the other ranks when one fails; the
    rank's own launcher watch), before the run's stop handler replaces it, ends the rank as before,
    with its stack in the note's SIGTERM file: launch.sh then names the rank that was killed, not
    every rank that ended."""
    opened = open_notes()
    if opened is None:
        return
    note, term = opened
    faulthandler.enable(file=note)  # (it keeps the file open as long as it is enabled)
    # (in C, at once, then the default action: a start-up blocked in C still ends)
    faulthandler.register(signal.SIGTERM, file=term, all_threads=False, chain=True)
    if not _fault_notes:
        atexit.register(_note_exit)
    _fault_notes.append(note)


def _note_exit() -> None:
    """Python runs its exit (any status; os._exit paths report theirs first): the note says so, and
    launch.sh tells this rank from one killed outright (SIGKILL: no fault, no exit, no status;
    EXIT_KILLED)."""
    for note in _fault_notes:
        try:
            note.write(PYTHON_EXIT + "\n")
            note.flush()
        except (OSError, ValueError):
            pass


_fault_notes: list = []


def note_backend(backend) -> None:
    """Once the process group exists, its backend heads this rank's abort note (`backend: gloo`).
    launch.sh counts a SIGABRT as a lost peer only where the backend aborts for one (NCCL's
    watchdog, at the collective timeout). gloo never does: a closed or reset connection and its
    timeouts are raised in the calling thread (tcp/pair.cc signalException: "Connection closed by
    peer", "Read error ...: Connection reset by peer", "Read timeout"); it aborts only when a check
    of its own fails in its I/O thread, e.g. a collective mismatch ("op.preamble.length <=
    op.nbytes ... Received data size doesn't match expected size. Is there a distributed collective
    mismatch in your code?"): a bug, exit status 1, never relaunched."""
    for note in _fault_notes:
        try:
            note.write(f"{BACKEND}{backend}\n")
            note.flush()  # (before anything faulthandler writes at the file's offset)
        except (OSError, ValueError):
            pass


# (a peer's bad-input note from before this process started is an earlier run's)
STARTED = time.time()


def note_bad_input(output_dir, error: Exception) -> None:
    """Bad input met mid-run by this rank alone (a file a DataLoader worker could not decode): a
    note in the output dir, so that its peers, which only see it gone, say the same line and exit 2
    as well (peer_gone, lost_peer)."""
    if isinstance(error, ConfigError) and output_dir:
        try:
            Path(output_dir, f".bad_input.{socket.gethostname()}.{os.getpid()}").write_text(
                str(error)
            )
        except OSError:
            pass


def clear_notes(output_dir) -> None:
    """The notes of earlier runs (note_bad_input), removed by a writer of the directory once it
    holds it, at start-up: they are read only by the peers of the run that wrote them, at its end,
    and this run's ranks write theirs only once training has started."""
    for note in Path(output_dir).glob(".bad_input.*"):
        note.unlink(missing_ok=True)


def bad_input_of_peer(output_dir, pids=()) -> str | None:
    """A peer's note of this run (note_bad_input): of one of `pids` on this machine, or (none given)
    any."""
    names = [f".bad_input.{socket.gethostname()}.{pid}" for pid in pids] if pids else None
    if not output_dir:
        return None
    try:
        notes = [
            p for p in Path(output_dir).glob(".bad_input.*") if names is None or p.name in names
        ]
        return next((p.read_text() for p in notes if p.stat().st_mtime >= STARTED - 1), None)
    except OSError:
        return None


def peer_gone(text: str, said: str, output_dir, pids) -> None:
    """The survivor's signal watch found a local peer gone: `text`, exit 3; or the bad input the
    peer met, exit 2 (written without print: the main thread may be in the middle of a write to
    sys.stderr)."""
    bad = bad_input_of_peer(output_dir, pids)
    line = f"{bad} (met by rank process {pids[0]}); {said}" if bad else text
    try:
        os.write(sys.__stderr__.fileno(), f"\naccel-train: error: {line}\n".encode())
    except Exception:  # (no stderr, a full pipe)
        pass
    report_status(EXIT_BAD_INPUT if bad else EXIT_LOST_PEER)
    os._exit(EXIT_BAD_INPUT if bad else EXIT_LOST_PEER)


def lost_peer(error: Exception, output_dir) -> None:
    """A collective failed: a peer died or stopped answering. One line, then exit without teardown
    (destroying a process group whose peer is gone can hang); the bad input a peer met, if it left a
    note, exit 2."""
    from .files import checkpoint_dirs, resumed_from

    text = " ".join(str(error).split())
    peer = re.search(r"\[([0-9a-fA-F.:]+)\]:\d+", text) or re.search(
        r"(\d+\.\d+\.\d+\.\d+:\d+)", text
    )
    detail = re.sub(r"\[/?[^\]]*\.(cc|cpp|hpp):\d+\]\s*", "", text)[:160]
    # (or its start)
    found = checkpoint_dirs(output_dir) or [p for p in [resumed_from(output_dir)] if p]
    where = f"newest complete checkpoint: {found[-1]}" if found else "no complete checkpoint yet"
    # the last completed step, written by this machine's survivor (survivor.py)
    if getattr(error, "survivor", None):
        where = (
            error.survivor
            if found and str(found[-1]) in error.survivor
            else f"{error.survivor}; {where}"
        )
    end_progress_line()
    if (bad := bad_input_of_peer(output_dir)) is not None:
        print(f"accel-train: error: {bad} (met by a peer); {where}", file=sys.stderr, flush=True)
        report_status(EXIT_BAD_INPUT)
        os._exit(EXIT_BAD_INPUT)
    print(
        f"accel-train: error: lost contact with peer {peer.group(1) if peer else '(unknown)'} "
        f"during a collective ({detail}); the job stops here, {where}; relaunch with --resume "
        "auto (launch.sh --max_restarts N does it) once every node is back",
        file=sys.stderr,
        flush=True,
    )
    report_status(EXIT_LOST_PEER)
    os._exit(EXIT_LOST_PEER)
