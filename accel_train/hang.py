"""A hang is never silent: a rank whose training thread makes no progress prints where
every rank is.

The training thread marks its progress at the loop's named moments (a micro-batch done, an
evaluation batch, a start-up phase, an epoch's end) with `PROGRESS.mark`: two attribute writes, no
host sync. A thread of its own (HangReport) looks once a second. A rank without progress for longer
than the bound, max(--hang_report_s, HANG_STEPS x the slowest rank's step time as the ranks last
agreed it), prints once, in one block: each rank's phase, the step it reached, the seconds since,
the function and collective its training thread waits in, and every thread's Python stack. The
peers' parts come over the heartbeat's signed datagrams (heartbeat.py): a rank whose training thread
waits in a collective, a file read or a lock still runs its other threads (the blocking call
releases the GIL). Every rank watches itself, so a rank that waits for a silent peer asks for the
same report; the lower rank asks first.

A checkpoint write and a torch.compile are no progress and no hang (`PROGRESS.exempt`). A training
thread that holds the GIL and never returns stops this thread too: faulthandler's C watchdog,
re-armed every second from here, then dumps the stacks itself. Nothing is stopped by the report: a
slow step goes on; --timeout_s ends a hung run (the survivors save the last completed step), or
--stop_on_hang ends it at the report in the same way, where it tells waiting from computing: only a
rank that waits on a peer (in a collective) once the first step has completed is stopped. Before
the first step (a compile, a first large batch, a slow first read) and while every rank computes,
the report is printed and nothing is stopped.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager

HANG_STEPS = 10  # a step this many times the slowest agreed one is no hang yet
ANSWER_S = 3.0  # how long a report waits for its peers' parts
PART_BYTES = 8000  # a part's text per datagram (well under UDP's 64 KiB, a few IP fragments across
# machines)
FRAMES = 30  # innermost frames shown per thread
STAGGER_S = 1.0  # rank r reports r x this later: the lower rank's request reaches it first


class Progress:
    """What the training thread last completed, and when (monotonic seconds)."""

    def __init__(self):
        self.phase, self.step, self.detail, self.at, self.exempt_depth = (
            "start-up",
            0,
            "",
            time.monotonic(),
            0,
        )

    def mark(self, phase: str, step: int | None = None, detail: str = "") -> None:
        self.phase, self.detail, self.at = phase, detail, time.monotonic()
        if step is not None:
            self.step = step

    @contextmanager
    def exempt(self, phase: str):
        """Work that may take long and is no hang (a checkpoint write, a compile): the bound starts
        after it."""
        self.exempt_depth += 1
        self.mark(phase)
        try:
            yield
        finally:
            self.exempt_depth -= 1
            self.at = time.monotonic()


PROGRESS = Progress()


def where(frame) -> str:
    """The function a thread is in, the collective it waits in, and the trainer's frame that called
    it."""
    frames = traceback.extract_stack(frame)
    if not frames:
        return "no Python frame"
    inner = frames[-1]
    text = f"in {inner.name} ({short(inner.filename)}:{inner.lineno})"
    collective = next(
        (
            f
            for f in reversed(frames)
            if f"torch{os.sep}distributed" in f.filename and not f.name.startswith("_")
        ),
        None,
    )
    if collective is not None:
        text += f", collective {collective.name}"
    elif any(f.name == "_engine_run_backward" for f in frames):
        text += ", backward (DDP's gradient all-reduce)"
    ours = next((f for f in reversed(frames) if f"accel_train{os.sep}" in f.filename), None)
    # your own code (a model's forward, a Dataset's read): the line a user looks for first
    own = next((f for f in reversed(frames) if own_file(f.filename)), None)
    if own is not None and own is not inner:
        text += f", in your {short(own.filename)}:{own.lineno} {own.name}"
    if ours is not None and ours is not inner:
        text += f", called from {short(ours.filename)}:{ours.lineno} {ours.name}"
    return text


def own_file(filename: str) -> bool:
    """A file of the user's: not accel_train's, an installed package's or the standard library's."""
    import sysconfig

    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    path = os.path.abspath(filename)
    return (
        os.path.isfile(path)
        and f"accel_train{os.sep}" not in path
        and not any(path.startswith(os.path.abspath(p) + os.sep) for p in installed)
    )


def waits_on_a_peer(where_text: str) -> bool:
    """A training thread waiting in a collective (or in DDP's all-reduce), from `where`'s text."""
    return ", collective " in where_text or "all-reduce" in where_text


def short(filename: str) -> str:
    parts = filename.split(os.sep)
    for anchor in ("accel_train", "site-packages"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return os.sep.join(parts[i + (anchor == "site-packages") :])
    return filename


def stacks() -> tuple[str, str]:
    """(where the training thread is, every thread's stack) of this process."""
    frames, names = sys._current_frames(), {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    lines, here = [], "no training thread"
    for ident, frame in sorted(frames.items(), key=lambda item: item[0] != main):
        if ident == threading.get_ident():
            continue  # (this report's own thread)
        name = names.get(ident, f"thread {ident}") + (
            " (the training thread)" if ident == main else ""
        )
        if ident == main:
            here = where(frame)
        lines.append(f"  thread {name}:")
        for entry in traceback.format_list(traceback.extract_stack(frame)[-FRAMES:]):
            lines.extend("    " + line for line in entry.rstrip("\n").split("\n"))
    return here, "\n".join(lines)


class HangReport:
    """One rank's watch on its own training thread. `start()` at the beginning of train(),
    `attach(...)` once the heartbeat exists (the peers' parts), `close()` at the end."""

    def __init__(self, cfg, stop, progress: Progress = PROGRESS):
        self.cfg, self.stop, self.progress = cfg, stop, progress
        self.rank, self.heartbeat, self.on_hang = None, None, None
        # progress.at of the stall whose report was printed (here or by a peer)
        self.reported_at = None
        self.handled_at = None  # progress.at of the stall this rank's own watch has answered
        # (report, rank) -> part index -> bytes
        self.parts: dict[tuple[int, int], dict[int, bytes]] = {}
        self.counts: dict[tuple[int, int], int] = {}
        self.report_id = 0
        self.closed = threading.Event()
        self.thread = None
        self.compiling = None

    def start(self) -> HangReport:
        self.progress.mark("start-up", 0)
        if self.cfg.hang_report_s > 0:
            self.thread = threading.Thread(
                target=self._run, daemon=True, name="accel_train-hang-report"
            )
            self.thread.start()
        if getattr(self.cfg, "compile", False):
            self._exempt_compiles()
        return self

    def attach(self, rank: int, heartbeat=None, on_hang=None) -> None:
        """`heartbeat`: the channel to the peers (None: one process); `on_hang(text)`:
        --stop_on_hang's end."""
        self.rank, self.heartbeat, self.on_hang = rank, heartbeat, on_hang
        if heartbeat is not None:
            heartbeat.handlers[b"ask"] = self._answer
            heartbeat.handlers[b"part"] = self._part

    def bound(self) -> float:
        step_s = getattr(self.stop, "step_s", None) or 0.0
        return max(self.cfg.hang_report_s, HANG_STEPS * step_s)

    def idle(self, now: float) -> float | None:
        """Seconds without progress, None while exempt work runs."""
        return None if self.progress.exempt_depth else now - self.progress.at

    def _run(self) -> None:
        while not self.closed.wait(1.0):
            now = time.monotonic()
            idle, bound = self.idle(now), self.bound()
            # a training thread that holds the GIL for good stops this thread: the C watchdog speaks
            # instead
            faulthandler.dump_traceback_later(bound + 30.0, exit=False, file=sys.__stderr__)
            stagger = STAGGER_S * min(self.my_rank(), 8)
            if idle is None or idle <= bound + stagger or self.handled_at == self.progress.at:
                continue
            self.handled_at = self.progress.at  # (once per stall)
            if self.reported_at != self.progress.at:
                _, stop = self.report(idle, bound)
            else:  # (a peer printed the report: this rank stops if it waits on that peer)
                stop = self.stoppable({self.my_rank(): self.section(idle)})
            if stop:
                self.on_hang(
                    f"rank {self.my_rank()} made no progress for {idle:.0f} s "
                    f"({self.progress.phase}, {stacks()[0]})"
                )
        faulthandler.cancel_dump_traceback_later()

    def section(self, idle: float | None = None) -> dict:
        here, text = stacks()
        p = self.progress
        idle = time.monotonic() - p.at if idle is None else idle
        return {
            "rank": self.my_rank(),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "phase": p.phase,
            "step": p.step,
            "detail": p.detail,
            "idle_s": round(idle, 1),
            "exempt": bool(p.exempt_depth),
            "where": here,
            "stacks": text,
        }

    def my_rank(self) -> int:
        """This rank's number (before attach, during start-up: the launcher's RANK)."""
        return self.rank if self.rank is not None else int(os.environ.get("RANK") or 0)

    def stoppable(self, sections: dict) -> bool:
        """--stop_on_hang ends the run: once the first step completed, a rank waits on a peer."""
        return (
            bool(self.cfg.stop_on_hang)
            and self.on_hang is not None
            and self.progress.step > 0
            and any(s.get("missing") or waits_on_a_peer(s["where"]) for s in sections.values())
        )

    def report(self, idle: float, bound: float) -> tuple[bool, bool]:
        """Ask the peers for their parts (ANSWER_S at most) and print one block: (printed, whether
        --stop_on_hang ends the run). Nothing printed where every peer makes progress: this rank
        only waits for a busy one (a long decode at start, a slow evaluation)."""
        self.reported_at = self.progress.at
        mine = self.section(idle)
        sections = {self.my_rank(): mine}
        peers = list(self.heartbeat.peers) if self.heartbeat is not None else []
        if peers:
            self.report_id += 1
            self.heartbeat.send(b"ask", b"%d" % self.report_id)
            deadline = time.monotonic() + ANSWER_S
            while time.monotonic() < deadline and not all(self._whole(r) for r in peers):
                time.sleep(0.05)
            for r in peers:
                sections[r] = self._whole(r) or {"rank": r, "missing": True}
            if not any(stalled(sections[r], bound) for r in peers):
                return False, False
        step_s = getattr(self.stop, "step_s", None)
        if self.progress.step == 0:
            said = (
                f"--hang_report_s {self.cfg.hang_report_s:g}: before the first step no step "
                "time is known"
            )
        else:
            learned = f", {HANG_STEPS} x the slowest step {step_s:.2g} s" if step_s else ""
            said = f"max(--hang_report_s {self.cfg.hang_report_s:g}{learned})"
        head = (
            f"accel-train: warning: rank {mine['rank']} has made no progress for {idle:.0f} s "
            f"(bound: {said}); where every rank is:"
        )
        lines = [head] + [summary(sections[r]) for r in sorted(sections)]
        for r in sorted(sections):
            if not sections[r].get("missing"):
                lines += [f"rank {r}'s threads:", sections[r]["stacks"]]
        stop = self.stoppable(sections)
        why = (
            ""
            if not self.cfg.stop_on_hang or stop
            else (
                " (--stop_on_hang waits for the first step: a compile, a first batch or read may be"
                " slow)"
                if self.progress.step == 0
                else " (--stop_on_hang: no rank waits on a peer, every rank is computing)"
            )
        )
        ends = (
            "--stop_on_hang: the run ends here"
            if stop
            else (
                f"nothing is stopped{why}: the run goes on if the step completes; --timeout_s "
                f"{self.cfg.timeout_s} ends it"
            )
            + ("" if self.cfg.stop_on_hang else ", or --stop_on_hang at this report")
        )
        lines.append(f"accel-train: {ends} (the survivors save the last completed step)")
        write("\n" + "\n".join(lines) + "\n")
        return True, stop

    # ---- the channel's handlers (in the heartbeat's thread)
    def _answer(self, rank: int, payload: bytes) -> None:
        section = self.section()
        data = json.dumps(section).encode()
        chunks = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
        for i, chunk in enumerate(chunks):
            self.heartbeat.send(
                b"part", b"%s %d %d " % (payload.strip(), i, len(chunks)) + chunk, to=[rank]
            )
        # this stall is reported by `rank`: no second block from here
        if stalled(section, self.bound()):
            self.reported_at = self.progress.at
            write(
                f"\naccel-train: warning: rank {rank} reports no progress; "
                f"this rank's stacks are in its report (rank {rank}'s log)\n"
            )

    def _part(self, rank: int, payload: bytes) -> None:
        report, index, count, chunk = payload.split(b" ", 3)
        if int(report) != self.report_id:
            return  # (an answer to an earlier report)
        self.parts.setdefault((self.report_id, rank), {})[int(index)] = chunk
        self.counts[(self.report_id, rank)] = int(count)

    def _whole(self, rank: int) -> dict | None:
        key = (self.report_id, rank)
        got = self.parts.get(key, {})
        if not got or len(got) < self.counts.get(key, 1):
            return None
        return json.loads(b"".join(got[i] for i in range(len(got))))

    def _exempt_compiles(self) -> None:
        from torch._dynamo.callback import callback_handler

        progress = self.progress

        def started(*_):
            progress.exempt_depth += 1

        def ended(*_):
            progress.exempt_depth = max(progress.exempt_depth - 1, 0)
            progress.at = time.monotonic()

        callback_handler.register_start_callback(started)
        callback_handler.register_end_callback(ended)
        self.compiling = (callback_handler, started, ended)

    def __enter__(self) -> HangReport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.closed.set()
        if self.compiling is not None:
            handler, started, ended = self.compiling
            handler.remove_start_callback(started)
            handler.remove_end_callback(ended)
            self.compiling = None
        if self.thread is not None:
            self.thread.join(timeout=5)
            self.thread = None
        if self.heartbeat is not None:
            self.heartbeat.handlers.pop(b"ask", None)
            self.heartbeat.handlers.pop(b"part", None)


def stalled(section: dict, bound: float) -> bool:
    """A peer's part shows it stalled too (or it did not answer), not busy with progress of its
    own."""
    return section.get("missing") or not section["exempt"] and section["idle_s"] >= bound / 2


def summary(section: dict) -> str:
    if section.get("missing"):
        return (
            f"  rank {section['rank']}: no answer within {ANSWER_S:.0f} s (its process is "
            "stopped, its machine cut off, or its training thread holds the GIL)"
        )
    detail = f", {section['detail']}" if section["detail"] else ""
    return (
        f"  rank {section['rank']} ({section['host']}, pid {section['pid']}): "
        f"{section['phase']}{detail}, step {section['step']}, {section['idle_s']:.0f} s since; "
        f"training thread {section['where']}"
    )


def write(text: str) -> None:
    """Straight to stderr's descriptor, whole (the training thread may be inside a write to
    sys.stderr)."""
    if sys.__stderr__ is None:
        return
    data = text.encode(errors="replace")
    try:
        fd = sys.__stderr__.fileno()
        while data:
            data = data[os.write(fd, data) :]
    except Exception:  # (a closed stderr, a full non-blocking pipe)
        pass
