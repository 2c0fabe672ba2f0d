"""The CPU cores a process may use (its affinity, its cgroup's quota, the processes of its machine,
the machine's load) and what follows from them: DataLoader workers per process, intra-op threads per
process."""

from __future__ import annotations

import math
import os
from pathlib import Path

from ..config.train_config import MAX_WORKERS
from ..lines import counted


def usable_cores() -> tuple[int, str, int]:
    """(cores this process may run on, where that number comes from, processes of the job on this
    machine): its CPU affinity (os.sched_getaffinity) or its cgroup's CPU quota where that is fewer;
    the processes as Accelerate's get_cpu_distributed_information counts them (LOCAL_WORLD_SIZE,
    which torchrun sets)."""
    from accelerate.utils.environment import get_cpu_distributed_information

    affinity = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    cores = min(affinity, cpu_quota() or affinity)
    where = (
        "in this process's CPU affinity"
        if cores == affinity
        else f"of its cgroup's CPU quota ({affinity} in its CPU affinity)"
    )
    return cores, where, max(1, get_cpu_distributed_information().local_world_size)


def intra_op_threads(
    threads: int | None, env=os.environ, load: float | None = None
) -> tuple[int | None, str]:
    """torch's intra-op threads for this process and the line saying why (None: leave torch's own).
    --threads N; else OMP_NUM_THREADS where the launcher or the user set it (torchrun sets 1 per
    rank); else the cores per process, and 1 where the machine was busy as the run started (the
    1-minute load average, `load`, at least the cores: other work holds them; a one-process run on a
    busy 2-core machine measured 9 img/s with torch's default 2 threads and 67 with 1)."""
    if threads:
        return threads, f"intra-op threads {threads} per process (--threads)"
    if env.get("OMP_NUM_THREADS"):
        return None, f"intra-op threads {env['OMP_NUM_THREADS']} per process (OMP_NUM_THREADS)"
    cores, where, local = usable_cores()
    load = os.getloadavg()[0] if load is None and hasattr(os, "getloadavg") else load or 0.0
    n = max(1, cores // local)
    if load >= cores and n > 1:
        return (
            1,
            (
                "intra-op threads 1 per process: the machine was busy as the run started (load "
                f"{load:.1f} on {cores} cores {where}): more threads than free cores stall each "
                "other (--threads N to choose)"
            ),
        )
    return (
        n,
        (
            f"intra-op threads {n} per process: {cores} cores {where} / {local} process(es) "
            "(--threads N to choose)"
        ),
    )


def worker_count(num_workers: int | None) -> tuple[int, str]:
    """DataLoader workers per process and why: --num_workers, else the cores this process may run on
    (its CPU affinity, os.sched_getaffinity, or its cgroup's CPU quota where that is fewer) shared
    by the processes on this machine (Accelerate's get_cpu_distributed_information:
    LOCAL_WORLD_SIZE, which torchrun sets), at most MAX_WORKERS."""
    if num_workers is not None:
        return num_workers, f"{counted(num_workers, 'worker')} per process (--num_workers)"
    cores, where, local = usable_cores()
    n = max(1, min(MAX_WORKERS, cores // local))
    capped = f", at most {MAX_WORKERS}" if cores // local > MAX_WORKERS else ""
    return (
        n,
        (
            f"{counted(n, 'worker')} per process: {cores} cores {where} / {local} process"
            f"{'es' if local > 1 else ''} on this machine{capped} (--num_workers N to change)"
        ),
    )


def cpu_quota(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The cores that this process's cgroup CPU quota allows (docker --cpus, Kubernetes CPU limits;
    cgroup v2's cpu.max, v1's cpu.cfs_quota_us / cpu.cfs_period_us; the smallest along its
    hierarchy), rounded up; None: none. The CPU affinity alone lets a container limited to 2 of 64
    cores start 8 workers per loader."""
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
            quota, period = (
                (folder / f"cpu.cfs_{k}_us").read_text().strip() for k in ("quota", "period")
            )
        return None if quota in ("max", "-1") else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None
