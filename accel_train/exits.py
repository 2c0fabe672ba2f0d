"""How a rank's process ends (docs/failures.md): its output flushed and its status out with
`os._exit`, its DataLoader workers ended first, no interpreter teardown that can hang or abort
(gloo's threads, multiprocessing's exit join); and which process of a group speaks for it."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time


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
