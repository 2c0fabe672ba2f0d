"""Preemption: SIGTERM (Kubernetes, ModelArts, SLURM at the time limit) or SIGUSR1 (SLURM's --signal) on
any rank makes every rank stop at the same optimizer step, checkpoint it and exit with EXIT_PREEMPTED.

The handler only raises a flag; the loop asks `should_stop(accelerator)` once per optimizer step, which
is Accelerate's set_trigger / check_trigger: one scalar all-reduce, so a signal seen by one rank is
seen by all of them at the same step.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def install(self) -> "StopRequest":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame):
        self.signal = signum

    def should_stop(self, accelerator) -> bool:
        """Every rank calls this at the same point: True on every rank if any rank got a signal."""
        if self.signal is not None:
            accelerator.set_trigger()
        return accelerator.check_trigger()

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal else "a signal on another rank"
