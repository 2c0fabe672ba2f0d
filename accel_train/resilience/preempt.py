"""Preemption and Ctrl-C: SIGTERM (Kubernetes, ModelArts, SLURM at the time limit), SIGUSR1 (SLURM's
--signal) or SIGINT (Ctrl-C) on any rank makes every rank stop at the same optimizer step,
checkpoint it and exit with EXIT_PREEMPTED. A second Ctrl-C stops the process at once (one line,
exit 130).

The handler only raises a flag. The ranks agree on it in `AgreedChecks`: at step numbers every rank
computes the same way, one small all-gather carries each rank's stop flag, its non-finite-loss watch
and its measured seconds per step; from the slowest rank's step time every rank computes the same
next check step, about TARGET_S seconds of work later and never more than MAX_S. The steps in
between make no host sync and no collective beyond DDP's own gradient all-reduce.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from typing import NamedTuple

from ..errors import (
    EXIT_INTERRUPTED,
    EXIT_LOST_PEER,
    EXIT_PREEMPTED,
    Preempted,
    of_step,
    report_status,
)

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# stop signals within this many seconds of the first are the same stop
ONE_STOP_S = 1.0


class StopRequest:
    def __init__(self):
        self.signal: int | None = None
        self.since = 0.0  # when the first stop signal came (time.monotonic)
        self.agreed = False  # the ranks agreed on the stop (AgreedChecks): every peer answered
        # the slowest rank's seconds per training step at the last agreed check (survivor.py)
        self.step_s = None
        # Who speaks, on each machine (a Ctrl-C comes from the terminal of one): its main process
        # once start-up has ended (the start-up check answers a Ctrl-C during start-up itself); the
        # second Ctrl-C's line before that comes from every process (which one is main is not known
        # yet)
        self.announce = True  # this process prints the second Ctrl-C's line
        self.notice = False  # this process answers a first Ctrl-C at once
        # the pid of this rank's launcher, once it is gone (watch_launcher)
        self.launcher_gone: int | None = None
        # some rank's launcher is gone (agreed): every rank's status is then 3
        self.any_launcher_gone = False
        self._previous = {}

    def install(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        watch_launcher(self)
        return self

    def stopped(self, text: str) -> Preempted:
        """The stop's exception: a preemption (4), or where a launcher is gone a lost launcher (3:
        relaunched)."""
        e = Preempted(text)
        e.status = (
            EXIT_LOST_PEER if self.any_launcher_gone or self.launcher_gone else EXIT_PREEMPTED
        )
        e.signal = self.signal
        return e

    def uninstall(self) -> None:
        # (a launcher that ends after the run: nothing to stop)
        if _watching and _watching[0] is self:
            _watching.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        # After a Ctrl-C, any further stop signal is a second Ctrl-C: torchrun starts the ranks in
        # sessions of their own, so they never get the terminal's SIGINT; its agent passes the first
        # SIGINT it gets on and answers a second one with SIGTERM
        # (torch/distributed/elastic/agent/server/api.py, run()).
        # Signals that arrive together are one stop: the agent's SIGINT then SIGTERM when it got two
        # (`timeout` forwards the terminal's SIGINT to the group that got it too), a terminal and a
        # launcher both delivering. Only a Ctrl-C typed after them ends the run at once.
        if self.signal == signal.SIGINT and time.monotonic() - self.since > ONE_STOP_S:
            stop_at_once(self.announce)
        if self.signal is None:  # named after the first signal
            self.signal, self.since = signum, time.monotonic()
            # seconds may pass before the next agreed check
            if signum == signal.SIGINT and self.notice:
                say(
                    "\naccel-train: Ctrl-C: every rank stops at its next agreed check and saves a "
                    "checkpoint; Ctrl-C again stops at once, without one\n"
                )

    def check_start_up(self, accelerator, step: int) -> None:
        """A one-off agreed check at the end of start-up: every rank calls it; raises Preempted on
        every rank if any rank got a signal (nothing new to save)."""
        self.announce = self.notice = accelerator.is_local_main_process
        if self.signal is not None:
            accelerator.set_trigger()
        if accelerator.check_trigger():
            raise self.stopped(f"stopped by {self.name} during start-up, before step {step + 1}")

    @property
    def name(self) -> str:
        from .. import PARENT

        gone = self.launcher_gone
        if (
            self.any_launcher_gone
            and not (gone or self.signal)
            and LAUNCHED_BY in os.environ
            and os.getppid() != PARENT
        ):
            # (its own watch polls once a second: a local peer's may have agreed first)
            gone = PARENT
        if gone:
            return f"the end of its launcher (pid {gone}, killed or crashed)"
        if self.any_launcher_gone and not self.signal:
            return "the end of another machine's launcher"
        return signal.Signals(self.signal).name if self.signal else "a signal on another rank"


def launcher_status(signum: int | None, status: int, env=os.environ) -> str:
    """What the stop line adds after a Ctrl-C that reached the ranks through `accelerate launch`'s
    torchrun agent (torchrun starts each rank in a session of its own: the terminal's SIGINT comes
    to them from the agent): the launcher exits 130 (128 + SIGINT, its launch.py: for any signal it
    got), whatever the ranks' own status, which is 4 here: a checkpoint written, not the second
    Ctrl-C's 130."""
    torchrun = LAUNCHED_BY in env and "TORCHELASTIC_RUN_ID" in env
    if status != EXIT_PREEMPTED or signum != signal.SIGINT or not torchrun:
        return ""
    return (
        f" (exit status {status} on every rank; `accelerate launch` exits {128 + signum} "
        f"after a Ctrl-C all the same, launch.sh {status})"
    )


# A launcher (`accelerate launch`: torchrun's agent, or its one-process launcher) whose ranks run on
# without it: torchrun starts each rank in a session of its own, so a SIGKILL (or the OOM killer)
# that ends the agent leaves them training, re-parented, outside any control, while launch.sh
# relaunches into the same output directory. Each rank started by one watches, from the start of the
# run (api.run_training) every LAUNCHER_POLL_S, whether the process that started it (its parent when
# the package was imported, accel_train.PARENT) is still its parent (one gone before that is
# launch.sh's to find: it looks for every process of the attempt). Once it is not, the rank signals
# itself SIGTERM: in training the ranks agree on a stop at their next agreed check, checkpoint that
# step and exit 3; before the handler is installed the signal ends the process. A rank that has not
# stopped LAUNCHER_GRACE_S later without an agreed stop (blocked in the launcher's own store, a
# rendezvous) ends itself, status 3.
LAUNCHER_POLL_S, LAUNCHER_GRACE_S = 1.0, 30.0
# set for every process `accelerate launch` starts (utils/launch.py)
LAUNCHED_BY = "ACCELERATE_MIXED_PRECISION"
_watching: list = []


def watch_launcher(stop: StopRequest | None = None) -> None:
    """Start the watch (once a process); `stop`: the run's installed StopRequest, told which
    launcher ended."""
    if stop is not None:
        _watching[:] = [stop]  # the run in progress (a script may call train() again)
    if LAUNCHED_BY not in os.environ or getattr(watch_launcher, "started", False):
        return
    watch_launcher.started = True
    from .. import PARENT

    def poll():
        gone = orphaned_at_start(PARENT)
        while os.getppid() == PARENT and not gone:
            time.sleep(LAUNCHER_POLL_S)
        # (a stop signal first: a preemption, whose launcher went too)
        if _watching and _watching[0].signal is None:
            _watching[0].launcher_gone = PARENT
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + LAUNCHER_GRACE_S
        while time.monotonic() < deadline or (_watching and getattr(_watching[0], "agreed", False)):
            time.sleep(LAUNCHER_POLL_S)
        say(
            f"\naccel-train: error: the launcher that started this process (pid {PARENT}) is gone "
            f"and no stop was agreed within {LAUNCHER_GRACE_S:.0f} s (blocked in start-up or a "
            "collective): ended without a checkpoint; relaunch with --resume auto\n"
        )
        report_status(EXIT_LOST_PEER)
        os._exit(EXIT_LOST_PEER)

    threading.Thread(target=poll, daemon=True, name="accel_train-launcher-watch").start()


def orphaned_at_start(parent: int) -> bool:
    """The launcher ended before this process read its parent: that parent is PID 1 and PID 1 is no
    launcher (one in a container may be: `accelerate launch` as the entry point)."""
    if parent != 1:
        return False
    try:
        cmd = open("/proc/1/cmdline", "rb").read()
    except OSError:
        return False
    return not any(name in cmd for name in (b"accelerate", b"torchrun", b"distributed.run"))


def pending_stop() -> str | None:
    """The name of the stop signal that this process's installed StopRequest recorded (None: none,
    or none installed): work that runs before the loop's agreed checks (the decoded cache's first
    decode) stops at it."""
    request = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return request.name if isinstance(request, StopRequest) and request.signal is not None else None


def say(text: str) -> None:
    """Write from a signal handler: straight to stderr's file descriptor (print could find
    sys.stderr's buffer in the middle of a write of the interrupted code and raise), and never raise
    into the code it interrupted (a full non-blocking pipe). No stderr at start-up (fd 2 closed, so
    a file opened later may hold fd 2): nothing."""
    if sys.__stderr__ is None:
        return
    try:
        os.write(sys.__stderr__.fileno(), text.encode())
    # (OSError: a full pipe; ValueError: a closed sys.__stderr__; AttributeError: no fileno)
    except Exception:
        pass


def stop_at_once(announce: bool) -> None:
    """A second Ctrl-C: no checkpoint, no teardown (a peer may be gone), one line, exit 130."""
    if announce:
        say(
            "\naccel-train: interrupted: a second Ctrl-C stopped the run at once, without a "
            "checkpoint; continue from the newest complete checkpoint with --resume auto\n"
        )
    report_status(EXIT_INTERRUPTED)
    os._exit(EXIT_INTERRUPTED)


class RankReport(NamedTuple):
    """One rank's numbers at an agreed check, one column each of its all-gather (float64)."""

    stop: float  # 1: a stop signal, 2: the launcher is gone too, 0: neither
    first_nonfinite: float  # the divergence watch's first step with a non-finite loss (0: none)
    step_s: float  # seconds per step since the last check
    check_s: float  # what the last check cost
    first_jump: float  # the divergence watch's first step whose weights jumped (0: none)
    since_checkpoint_s: float  # seconds since the last checkpoint
    write_s: float  # the last checkpoint write's seconds (-1: none measured)
    step: float  # the step every rank calls the check at (last: errors.of_step reads it)


class AgreedChecks:
    """The steps (or evaluation batches) at which the ranks agree on a stop request and on the
    non-finite watch: `due(step)` is pure arithmetic on numbers every rank holds; `agree(...)` is a
    collective.

    Bound: a stop is seen after at most max(MAX_S of work, one step) plus the check itself, then the
    checkpoint is written: well inside the 30 s torchrun gives workers after forwarding SIGTERM
    (pytorch#119856) unless one step takes more than ~20 s. Cost: a check is one all-gather of 8
    numbers per rank (RankReport) and one host read (which drains the device queue); the interval is
    at least 100x the measured cost of the previous check (<= 1% of the time), and about TARGET_S of
    work otherwise."""

    TARGET_S, MAX_S, MAX_OVERHEAD = 2.0, 5.0, 0.01

    def __init__(self, stop: StopRequest, step: int = 0, minutes: float | None = None):
        self.stop, self.minutes = stop, minutes  # --checkpoint_minutes
        # the first step after a (re)start: its time (compile, warm-up) is then known
        self.next = step + 1
        self.since, self.since_step, self.cost = time.perf_counter(), step, 0.0
        self.save_now = False  # the ranks agreed that a checkpoint is due by time (checkpoint_due)

    def due(self, step: int) -> bool:
        return step >= self.next

    def agree(self, accelerator, step: int, watch=None, clock=None) -> bool:
        """Every rank calls it at the same step: True on every rank if any rank got a stop signal;
        raises Diverged on every rank if any rank's watch saw a non-finite loss. `clock` (the
        Checkpointer: seconds since its last checkpoint, the last write's seconds): whether a
        checkpoint is due by time, from the ranks' largest numbers, so every rank saves at this step
        or none does."""
        import torch  # (this module is imported by the command line before torch is needed)

        start = time.perf_counter()
        per_step = (start - self.since) / max(step - self.since_step, 1)
        since, write_s = (
            (start - clock.saved_at, clock.write_s or -1.0) if clock is not None else (0.0, -1.0)
        )
        # (2: a launcher is gone)
        stop = float(self.stop.signal is not None) + bool(self.stop.launcher_gone)
        report = RankReport(stop, 0.0, per_step, self.cost, 0.0, since, write_s, float(step))
        mine = torch.tensor([report], dtype=torch.float64, device=accelerator.device)
        if watch is not None:  # (they stay on the device until the one read below)
            columns = RankReport._fields
            mine[0, columns.index("first_nonfinite")] = watch.first
            mine[0, columns.index("first_jump")] = watch.jumped
        gathered = accelerator.gather(mine).reshape(-1, len(RankReport._fields)).tolist()
        rows = [RankReport(*r) for r in of_step(gathered, step, "the agreed check")]
        if watch is not None:
            watch.verdict(
                [int(r.first_nonfinite) for r in rows],
                True,
                step,
                [int(r.first_jump) for r in rows],
            )
        step_s = max(r.step_s for r in rows)
        self.next = step + self.interval(step_s, max(r.check_s for r in rows))
        self.since, self.since_step = time.perf_counter(), step
        self.cost = self.since - start
        write = max(r.write_s for r in rows)
        self.save_now = clock is not None and max(r.since_checkpoint_s for r in rows) >= (
            checkpoint_interval_s(self.minutes, write if write >= 0 else None)
        )
        if clock is not None:  # (training's checks; an evaluation's count batches): a step's length
            self.stop.step_s = step_s
        self.stop.agreed = any(r.stop for r in rows)  # (the survivor's signal watch stands down)
        self.stop.any_launcher_gone = any(r.stop > 1 for r in rows)  # (every rank's status: 3)
        return self.stop.agreed

    def checkpoint_due(self, step: int, every: int) -> bool:
        """A checkpoint at this step: every --checkpoint_every steps, or where the last agreed check
        found one due by time (the same answer on every rank)."""
        due, self.save_now = bool(every and step % every == 0) or self.save_now, False
        return due

    @classmethod
    def interval(cls, step_s: float, check_s: float) -> int:
        """Steps to the next check, from the slowest rank's seconds per step and the costliest
        check."""
        step_s = max(step_s, 1e-9)
        n = max(round(cls.TARGET_S / step_s), math.ceil(check_s / (cls.MAX_OVERHEAD * step_s)))
        return max(1, min(n, math.floor(cls.MAX_S / step_s)))


# The default checkpoint interval in training time (--checkpoint_minutes unset): 100x the last
# measured write, so that writes cost at most ~1% of the time; at least MIN_S; FIRST_S before this
# run has measured a write.
MAX_WRITE_SHARE, MIN_CHECKPOINT_S, FIRST_CHECKPOINT_S = 0.01, 60.0, 600.0


def checkpoint_interval_s(minutes: float | None, write_s: float | None) -> float:
    """Seconds of training between checkpoints taken by time: --checkpoint_minutes (0: never), else
    from the write's measured cost."""
    if minutes is not None:
        return minutes * 60 if minutes > 0 else math.inf
    if write_s is None:
        return FIRST_CHECKPOINT_S
    return max(write_s / MAX_WRITE_SHARE, MIN_CHECKPOINT_S)


def checkpoint_interval_text(minutes: float | None) -> str:
    """The start line's words for it."""
    if minutes is not None:
        return (
            f"every {minutes:g} min of training (--checkpoint_minutes)"
            if minutes > 0
            else "none by time"
        )
    return (
        f"every {MIN_CHECKPOINT_S / 60:.0f}+ min of training (100x the measured write: <= 1% "
        f"of the time; {FIRST_CHECKPOINT_S / 60:.0f} min to the first)"
    )
