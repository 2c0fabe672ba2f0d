"""DataLoader workers: how many per process (the cores this process may use, shared by the machine's processes), and
the settings of every loader that has them (persistent, prefetch, pinned memory, their signals)."""

from __future__ import annotations

import atexit
import math
import os
from pathlib import Path

import torch

from ..config import MAX_WORKERS, TrainConfig
from ..errors import counted
from ..exits import end_workers

PREFETCH = 2         # batches each DataLoader worker prepares ahead (torch's default), each in /dev/shm: 8 workers
                     # x 2 x a uint8 batch of 256 at 224 px is 0.6 GB per rank



def worker_count(cfg: TrainConfig) -> tuple[int, str]:
    """DataLoader workers per process and why: --num_workers, else the cores this process may run on (its CPU
    affinity, os.sched_getaffinity, or its cgroup's CPU quota where that is fewer) shared by the processes on this
    machine (Accelerate's
    get_cpu_distributed_information: LOCAL_WORLD_SIZE, which torchrun sets), at most MAX_WORKERS."""
    if cfg.num_workers is not None:
        return cfg.num_workers, f"{counted(cfg.num_workers, 'worker')} per process (--num_workers)"
    from accelerate.utils.environment import get_cpu_distributed_information
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores = min(affinity, cpu_quota() or affinity)
    where = "in this process's CPU affinity" if cores == affinity else \
        f"of its cgroup's CPU quota ({affinity} in its CPU affinity)"
    local = max(1, get_cpu_distributed_information().local_world_size)
    n = max(1, min(MAX_WORKERS, cores // local))
    capped = f", at most {MAX_WORKERS}" if cores // local > MAX_WORKERS else ""
    return n, (f"{counted(n, 'worker')} per process: {cores} cores {where} / {local} process"
               f"{'es' if local > 1 else ''} on this machine{capped} (--num_workers N to change)")


def cpu_quota(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The cores that this process's cgroup CPU quota allows (docker --cpus, Kubernetes CPU limits; cgroup v2's
    cpu.max, v1's cpu.cfs_quota_us / cpu.cfs_period_us; the smallest along its hierarchy), rounded up; None: none.
    The CPU affinity alone lets a container limited to 2 of 64 cores start 8 workers per loader."""
    try:
        with open(cgroups) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    quotas = []
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers and "cpu" not in controllers.split(","):
            continue
        base = Path(root) / controllers  # (v2: the unified root itself)
        folder = base / path.lstrip("/")
        while True:
            quotas.append(_quota(folder, v2=not controllers))
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    quotas = [q for q in quotas if q]
    return max(1, math.ceil(min(quotas))) if quotas else None


def _quota(folder: Path, v2: bool) -> float | None:
    try:
        if v2:
            quota, period = (folder / "cpu.max").read_text().split()[:2]
        else:
            quota, period = ((folder / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period"))
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def loader_kwargs(cfg: TrainConfig, device, workers: int | None = None) -> dict:
    """The DataLoader settings of a loader that prepares samples on the CPU: `workers` (default worker_count)
    persistent workers that leave stop signals to the trainer, PREFETCH batches each ahead, and on an accelerator
    pinned batches, so that Accelerate's copy to the device (non_blocking=True, see accelerator.make_accelerator) does
    not wait for it: a copy from pageable memory is a host sync."""
    workers = worker_count(cfg)[0] if workers is None else workers
    if workers and not _ends_workers_at_exit:  # (after multiprocessing's own exit handler, so it runs before it)
        atexit.register(end_workers)
        _ends_workers_at_exit.append(True)
    return dict(num_workers=workers, persistent_workers=workers > 0, prefetch_factor=PREFETCH if workers else None,
                worker_init_fn=_leave_signals_to_the_trainer if workers else None,
                pin_memory=torch.device(device).type != "cpu")


# A process that exits with a loader's iterator alive (an uncaught exception in your script: its traceback holds the
# frames) would hang in multiprocessing's exit handler, which sends its workers one SIGTERM, the one they leave to the
# trainer, and joins them without a timeout: exits.end_workers ends them first.
_ends_workers_at_exit: list = []


def _leave_signals_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers leave Ctrl-C, SIGUSR1 and a first SIGTERM to the trainer, which stops at an agreed step
    and checkpoints it: a terminal signals the whole foreground group and torchrun signals each rank's whole
    session (os.killpg), so a worker that ended would fail the batch before that checkpoint. A second SIGTERM ends
    the worker: it is how the DataLoader (and multiprocessing at exit) end a worker that did not stop by itself. A
    forked worker inherits the trainer's wakeup fd (survivor.py's signal watch): its signals must not reach it."""
    import signal
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _end_at_the_second_sigterm)


def _end_at_the_second_sigterm(signum, frame) -> None:
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
