"""The fault campaign's view of a job from outside (tools/campaign.py): its processes, found by the
CAMPAIGN_TAG in their environment; the files the run writes, read for the named events a fault waits
for; the faults themselves.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

TAG_ENV = "CAMPAIGN_TAG"
NODE_ENV = "CAMPAIGN_NODE"


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    kind: str  # launch.sh, launcher (accelerate launch / torchrun's agent), rank, other
    rank: int  # ranks: RANK (0 for a one-process job); -1 otherwise
    local_rank: int
    node: int


def _read(pid: str) -> tuple[list[bytes], list[bytes], int] | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return env, argv, ppid


def _env(env: list[bytes], name: str, default: int) -> int:
    prefix = f"{name}=".encode()
    return next(
        (int(e[len(prefix) :]) for e in env if e.startswith(prefix) and e[len(prefix) :].isdigit()),
        default,
    )


def job_procs(tag: str, workers: set | None = None) -> list[Proc]:
    """Every live process started for this job (whatever it has reached), classified. DataLoader
    workers (forked from a rank, with its command line and environment) count as 'other', also once
    their rank is gone (a killed rank's workers live on for a few seconds, children of PID 1) when
    `workers` (kept by the caller over its calls) holds them from an earlier call."""
    marker, found = f"{TAG_ENV}={tag}".encode(), []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        read = _read(d)
        if read is None or marker not in read[0]:
            continue
        env, argv, ppid = read
        # (-m accel_train, not launch.sh's -m accel_train.platform.accel_config check)
        cmd = b"\0".join(argv) + b"\0"
        if (
            argv[0].endswith(b"bash")
            and any(a.endswith(b"launch.sh") for a in argv[1:3])
            or (argv[1:2] == [b"-c"] and b"accel_train.launcher" in cmd)
        ):
            # (launch.sh, once it execs Python)
            kind = "launch.sh"
        elif (
            b"accelerate.commands.launch" in cmd
            or b"torchrun" in argv[0]
            or b"distributed.run" in cmd
        ):
            kind = "launcher"
        elif (
            argv[0].split(b"/")[-1].startswith(b"python")
            and b"preflight" not in cmd
            and (b"-m\0accel_train\0" in cmd or any(a.endswith(b".py") for a in argv[1:3]))
        ):
            kind = "rank"
        else:
            kind = "other"
        found.append(
            Proc(
                int(d),
                ppid,
                kind,
                _env(env, "RANK", 0),
                _env(env, "LOCAL_RANK", 0),
                _env(env, NODE_ENV, 0),
            )
        )
    ranks = {p.pid for p in found if p.kind == "rank"}
    workers = set() if workers is None else workers
    workers.update(p.pid for p in found if p.kind == "rank" and p.ppid in ranks)
    return [
        Proc(p.pid, p.ppid, "other", -1, -1, p.node) if p.kind == "rank" and p.pid in workers else p
        for p in found
    ]


def ranks(procs: list[Proc], node: int | None = None) -> list[Proc]:
    return [p for p in procs if p.kind == "rank" and (node is None or p.node == node)]


def writers(procs: list[Proc]) -> list[str]:
    """Machines with two live processes that each take themselves for the machine's writer (local
    rank 0)."""
    seen: dict[int, list] = {}
    for p in ranks(procs):
        if p.local_rank == 0:
            seen.setdefault(p.node, []).append(p)
    return [
        f"machine {node}:"
        f" {[(p.pid, p.ppid, p.rank, p.local_rank, attempt_of(p.pid)) for p in found]}"
        for node, found in seen.items()
        if len(found) > 1
    ]


def attempt_of(pid: int) -> str:
    """The launch.sh attempt a process belongs to (its ACCEL_TRAIN_STATUS_DIR), or '-'."""
    read = _read(str(pid))
    found = [e for e in (read[0] if read else []) if e.startswith(b"ACCEL_TRAIN_STATUS_DIR=")]
    return found[0].split(b"=", 1)[1].decode() if found else "-"


def kill_all(tag: str) -> list[int]:
    """SIGKILL every process of the job still alive; their pids."""
    pids = [p.pid for p in job_procs(tag)]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pids


# --- what the run has written: the named events ---------------------------------------------------


def rows(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # (a row being written)
    return out


class Watch:
    """Cheap reads of rank 0's output directory, polled every few ms: the last step row, the metrics
    rows, the checkpoint directories (a `.tmp-` one is a write in progress; a `-survivor-` one a
    survivor's save).
    """

    def __init__(self, out: Path):
        self.out, self._stat, self._last = Path(out), None, (0, None)
        # steps.jsonl as the job found it (a run it continues, or none)
        self.initial = self.last_step()[1]

    def last_step(self) -> tuple[int, object]:
        """(step of the last row, a token that changes whenever steps.jsonl does)"""
        path = self.out / "steps.jsonl"
        try:
            st = path.stat()
        except OSError:
            return 0, None
        token = (st.st_ino, st.st_size, st.st_mtime_ns)
        if token != self._stat:
            found = rows(path)
            self._stat, self._last = token, ((found[-1].get("step", 0) if found else 0), token)
        return self._last

    def epochs(self) -> int:
        return len(rows(self.out / "metrics.jsonl"))

    def checkpoint_dirs(self) -> list[str]:
        try:
            return os.listdir(self.out / "checkpoints")
        except OSError:
            return []

    def event(
        self, name: str, steps_per_epoch: int, at_step: int, started_steps: int, procs_seen: bool
    ) -> bool:
        """Has the named event (at or after step at_step) happened?"""
        step, token = self.last_step()
        if name == "startup":
            return procs_seen and step == started_steps
        if step < at_step or token == self.initial:
            # (rows of the run it continues are not this job's steps)
            return False
        if name == "step":
            return True
        if name == "checkpoint":  # a write in progress, or one just finished
            return any(
                d.startswith(".tmp-step_") or d.startswith("step_") and int(d[5:13]) >= at_step
                for d in self.checkpoint_dirs()
            )
        if name == "eval":  # the epoch's last step row is out, its metrics row not yet
            return step % steps_per_epoch == 0 and self.epochs() < step // steps_per_epoch
        if name == "epoch_end":
            return self.epochs() >= max(at_step // steps_per_epoch, 1)
        if name == "survivor":
            return any("survivor" in d for d in self.checkpoint_dirs())
        raise ValueError(name)


# --- the faults -----------------------------------------------------------------------------------

SIGNALS = {
    "kill": signal.SIGKILL,
    "stop": signal.SIGSTOP,
    "term": signal.SIGTERM,
    "int": signal.SIGINT,
    "usr1": signal.SIGUSR1,
}


def victims(fault: str, procs: list[Proc], node: int, rank_choice: int) -> list[int]:
    """The pids a fault hits: kill_rank/stop_rank one rank of the node (rank_choice picks it),
    kill_machine every rank of the node, kill_launcher its accelerate launch, kill_launch_sh its
    launch.sh (the outer one), the preemptions (term, usr1, int) the outermost process of the node:
    launch.sh or accelerate launch.
    """
    here = [p for p in procs if p.node == node]
    if fault in ("kill_rank", "stop_rank"):
        found = sorted(ranks(here), key=lambda p: p.rank)
        return [found[rank_choice % len(found)].pid] if found else []
    if fault == "kill_machine":
        return [p.pid for p in ranks(here)]
    kinds = {"kill_launcher": ("launcher",), "kill_launch_sh": ("launch.sh",)}.get(
        fault, ("launch.sh", "launcher")
    )
    pids = {p.pid for p in here}
    outer = [p for p in here if p.kind in kinds and p.ppid not in pids]
    return [outer[0].pid] if outer else []


def inject(fault: str, pids: list[int]) -> None:
    sig = SIGNALS[fault.split("_")[0]] if fault.split("_")[0] in SIGNALS else SIGNALS[fault]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def resume_all(pids: list[int]) -> None:
    """SIGCONT to processes a stop_rank fault stopped (still alive when the job is being cleaned
    up)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def wait_gone(tag: str, timeout: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = job_procs(tag)
        if not left:
            return []
        time.sleep(0.25)
    return job_procs(tag)
