"""A heartbeat between the ranks, beside the training thread: a frozen or unreachable peer is found in
--heartbeat_timeout_s (default 15 s), not when a collective times out (--timeout_s, default 300 s).

Each rank of a process group sends a small UDP datagram to every other rank every --heartbeat_s from a thread of its
own, and notes when each peer's last one came. A stopped process (SIGSTOP, a stuck driver, a paused VM, a swapping
host) and a cut network stop a peer's datagrams; a long step, the first compile, an evaluation, a checkpoint write or
a slow first decode do not (the thread needs the GIL for a moment every --heartbeat_s, and torch's operators release
it). A peer silent for --heartbeat_timeout_s is lost: the survivor saves the last completed step and the rank exits
3, as for a lost peer (survivor.py). A live process whose training thread hangs keeps beating: --timeout_s bounds it.

The side channel is the job's own network, not the process group's store (the c10d TCPStore lives in rank 0's
launcher, one machine: a frozen machine 0 would silence every heartbeat at once) and not a collective (one that
waits on the frozen peer is the thing that hangs). The addresses are exchanged in the survivor's one gather at start.
A rank that ends its training (a finished run, a stop, an error) says goodbye, so its silence after that is no alarm;
a process that was itself stopped gives its peers a fresh window once it runs again (datagrams sent meanwhile wait in
its socket's buffer).
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from pathlib import Path

TAG = b"accel_train-heartbeat"
PF_EXITING = 0x4  # the task's flag from the start of its exit (linux include/linux/sched.h; proc(5): stat field 9)
BYE_COPIES = 3  # the goodbye is sent this many times (a datagram can be lost; a lost goodbye is a false alarm)


def local_address(env=os.environ) -> str:
    """The address this machine's peers reach it at: the one its route to the rank-0 host (MASTER_ADDR, set by the
    launcher for every rank) leaves from. No packet is sent (a UDP connect only picks the route)."""
    master = env.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master), int(env.get("MASTER_PORT") or 29500)))
            return probe.getsockname()[0]
    except OSError:  # (no route, an IPv6-only name: a loopback address, which peers on other machines leave out)
        return "127.0.0.1"


def silent(seen: dict[int, float], since: float, now: float, timeout_s: float) -> list[int]:
    """The peers whose last heartbeat (or the start of this window, `since`, whichever is later) is more than
    `timeout_s` ago."""
    return [rank for rank, last in seen.items() if now - max(last, since) > timeout_s]


class Heartbeat:
    """One rank's heartbeat: `address` goes to the peers (the survivor's gather), `start(peers, on_lost)` begins the
    thread, `close()` says goodbye. `on_lost(rank, seconds)` runs in the thread when a peer is silent too long."""

    def __init__(self, rank: int, period_s: float, timeout_s: float):
        self.rank, self.period_s, self.timeout_s = rank, period_s, timeout_s
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        self.address = (local_address(), self.sock.getsockname()[1])
        self.peers: dict[int, tuple[str, int, int]] = {}  # rank -> (ip, port, pid)
        self.seen: dict[int, float] = {}  # rank -> when its last heartbeat came (monotonic); ended ranks leave it
        self.closed = threading.Event()
        self.thread = None

    def start(self, peers: dict[int, tuple[str, int, int]], on_lost) -> None:
        self.peers = {rank: peer for rank, peer in peers.items() if rank != self.rank}
        self.seen = dict.fromkeys(self.peers, time.monotonic())
        self.on_lost = on_lost
        self.thread = threading.Thread(target=self._run, daemon=True, name="accel_train-heartbeat")
        self.thread.start()

    def _send(self, kind: bytes) -> None:
        message = b"%s %s %d %d" % (TAG, kind, self.rank, os.getpid())
        for ip, port, _ in self.peers.values():
            try:
                self.sock.sendto(message, (ip, port))
            except OSError:  # (a network that is down: the peer hears nothing, as it should)
                pass

    def _receive(self, now: float) -> None:
        while True:
            try:
                data = self.sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (closed by close(); an ICMP error)
                return
            parts = data.split()
            if len(parts) != 4 or parts[0] != TAG or not (parts[2].isdigit() and parts[3].isdigit()):
                continue
            rank, pid = int(parts[2]), int(parts[3])
            if rank in self.seen and self.peers[rank][2] == pid:  # (this job's peer, not an earlier attempt's)
                if parts[1] == b"bye":
                    del self.seen[rank]  # it ended its training: its silence is no alarm
                else:
                    self.seen[rank] = now

    def _run(self) -> None:
        since = last = next_beat = time.monotonic()
        while not self.closed.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self._send(b"beat")
                next_beat = now + self.period_s
            try:
                select.select([self.sock], [], [], max(0.0, min(next_beat - now, self.period_s)))
            except (OSError, ValueError):  # (the socket closed under the select)
                return
            now = time.monotonic()
            self._receive(now)
            if now - last > max(self.timeout_s / 2, 3 * self.period_s):
                since = now  # this process did not run (stopped itself, its machine paused): a fresh window
            last = now
            lost = silent(self.seen, since, now, self.timeout_s)
            if lost and not self.closed.is_set():
                self.on_lost(lost[0], now - max(self.seen[lost[0]], since))
                return

    def close(self) -> None:
        """Goodbye to the peers (the training is over here: no alarm at this rank's silence), the thread ends."""
        if self.closed.is_set():
            return
        self.closed.set()
        for _ in range(BYE_COPIES):
            self._send(b"bye")
        self.sock.close()


def alive(pid: int) -> bool:
    """A local peer that can still answer: its process exists and is neither exiting, a zombie nor stopped (SIGSTOP).
    A killed process closes its sockets in its exit (do_exit: exit_files) before it is a zombie, so a peer sees the
    connection reset while the killed one's state still reads running: its PF_EXITING flag is set by then."""
    try:
        return answers(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, IndexError, ValueError):
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def answers(stat: str) -> bool:
    """From a /proc/PID/stat line: the process is neither exiting, a zombie nor stopped."""
    fields = stat.rsplit(")", 1)[1].split()  # (state, ppid, pgrp, session, tty_nr, tpgid, flags, ...)
    return fields[0] not in ("Z", "X", "x", "T", "t") and not int(fields[6]) & PF_EXITING
