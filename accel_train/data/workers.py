"""DataLoader workers: the settings of every loader that has them (persistent, prefetch, pinned
memory, their signals); how many per process: cores.worker_count (the cores this process may use,
shared by the machine's processes)."""

from __future__ import annotations

import atexit

import torch

from ..exits import end_workers
from ..forks import worker_context
from ..platform.cores import worker_count

# batches each DataLoader worker prepares ahead (torch's default), each in /dev/shm: 8 workers x 2
# x a uint8 batch of 256 at 224 px is 0.6 GB per rank
PREFETCH = 2


def loader_kwargs(num_workers: int | None, device, workers: int | None = None) -> dict:
    """The DataLoader settings of a loader that prepares samples on the CPU: `workers` (default
    worker_count of --num_workers, `num_workers`) persistent workers, each seen to start (forks.py:
    a fork beside other threads can leave a child that never runs), that leave stop signals to the
    trainer, PREFETCH batches each ahead, and on an accelerator pinned batches, so that Accelerate's
    copy to the device (non_blocking=True, see accelerator.make_accelerator) does not wait for it: a
    copy from pageable memory is a host sync."""
    workers = worker_count(num_workers)[0] if workers is None else workers
    # (after multiprocessing's own exit handler, so it runs before it)
    if workers and not _ends_workers_at_exit:
        atexit.register(end_workers)
        _ends_workers_at_exit.append(True)
    return dict(
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=PREFETCH if workers else None,
        worker_init_fn=_leave_signals_to_the_trainer if workers else None,
        multiprocessing_context=worker_context() if workers else None,
        pin_memory=torch.device(device).type != "cpu",
    )


# A process that exits with a loader's iterator alive (an uncaught exception in your script: its
# traceback holds the frames) would hang in multiprocessing's exit handler, which sends its workers
# one SIGTERM, the one they leave to the trainer, and joins them without a timeout:
# exits.end_workers ends them first.
_ends_workers_at_exit: list = []


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C, SIGUSR1 and a first SIGTERM to the trainer, which stops at
    an agreed step and checkpoints it: a terminal signals the whole foreground group and torchrun
    signals each rank's whole session (os.killpg), so a worker that ended would fail the batch
    before that checkpoint. A second SIGTERM ends the worker: it is how the DataLoader (and
    multiprocessing at exit) end a worker that did not stop by itself. A forked worker inherits the
    trainer's wakeup fd (survivor.py's signal watch): its signals must not reach it."""
    import signal

    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _end_at_the_second_sigterm)


def _end_at_the_second_sigterm(signum, frame) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
