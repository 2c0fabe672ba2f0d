"""A heartbeat between the ranks, beside the training thread: a frozen or unreachable peer is found
in --heartbeat_timeout_s (default 15 s), not when a collective times out (--timeout_s, default
300 s).

Each rank of a process group sends a small UDP datagram to every other rank every --heartbeat_s from
a thread of its own, and notes when each peer's last one came. A stopped process (SIGSTOP, a stuck
driver, a paused VM, a swapping host) and a cut network stop a peer's datagrams; a long step, the
first compile, an evaluation, a checkpoint write or a slow first decode do not (the thread needs the
GIL for a moment every --heartbeat_s, and torch's operators release it). A peer silent for
--heartbeat_timeout_s is lost: the survivor saves the last completed step and the rank exits 3, as
for a lost peer (survivor.py). A live process whose training thread hangs keeps beating: the hang
report (hang.py) says where it waits, --timeout_s (or --stop_on_hang) ends it.

The side channel is the job's own network, not the process group's store (the c10d TCPStore lives in
rank 0's launcher, one machine: a frozen machine 0 would silence every heartbeat at once) and not a
collective (one that waits on the frozen peer is the thing that hangs). The addresses are exchanged
in the survivor's one gather at start. A rank that ends its training (a finished run, a stop, an
error) says goodbye, so its silence after that is no alarm; a process that was itself stopped gives
its peers a fresh window once it runs again (datagrams sent meanwhile wait in its socket's buffer).

Every datagram is signed (HMAC-SHA256) with its sender's key, a random one each rank draws at start
and hands its peers in that same gather (the process group's connection: no other user of the
machine reads it); it must come from the peer's gathered address and port, name the peer's pid, and
carry a sequence number above the last one accepted. A forged or replayed datagram (a rank's pid and
port are readable by any local user) is dropped. The socket is bound to the address of the interface
the job's route leaves from, not every interface.

The same channel carries the hang report's request and its parts (hang.py):
`send(kind, payload, to)` and `handlers[kind](rank, payload)`, run in the heartbeat's thread.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import secrets
import select
import socket
import threading
import time
from pathlib import Path

TAG = b"accel_train-heartbeat"
MAC_BYTES = 32  # HMAC-SHA256
# the task's flag from the start of its exit (linux include/linux/sched.h; proc(5): stat field 9)
PF_EXITING = 0x4
# the goodbye is sent this many times (a datagram can be lost; a lost goodbye is a false alarm)
BYE_COPIES = 3
MAX_DATAGRAM = 65507  # UDP's largest payload over IPv4


def local_address(env=os.environ) -> str:
    """The address this machine's peers reach it at: the one its route to the rank-0 host
    (MASTER_ADDR, set by the launcher for every rank) leaves from. No packet is sent (a UDP connect
    only picks the route)."""
    master = env.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(master), int(env.get("MASTER_PORT") or 29500)))
            return probe.getsockname()[0]
    # (no route, an IPv6-only name: a loopback address, which peers on other machines leave out)
    except OSError:
        return "127.0.0.1"


def silent(seen: dict[int, float], since: float, now: float, timeout_s: float) -> list[int]:
    """The peers whose last heartbeat (or the start of this window, `since`, whichever is later) is
    more than `timeout_s` ago."""
    return [rank for rank, last in seen.items() if now - max(last, since) > timeout_s]


def reachable(my_host: str, my_ip: str, host: str, ip: str) -> bool:
    """Whether two ranks hear each other's heartbeats: on one machine always; across machines only
    where neither address is a loopback one (a name that resolves to 127.0.1.1 on its own machine):
    the watch is mutual or none."""
    return host == my_host or not (ip.startswith("127.") or my_ip.startswith("127."))


def sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest() + body


class Heartbeat:
    """One rank's heartbeat: `address` and `key` go to the peers (the survivor's gather),
    `start(peers, on_lost)` begins the thread, `close()` says goodbye. `on_lost(rank, seconds)` runs
    in the thread when a peer is silent too long. `peers`: rank -> (ip, port, pid, key)."""

    def __init__(self, rank: int, period_s: float, timeout_s: float):
        self.rank, self.period_s, self.timeout_s = rank, period_s, timeout_s
        self.key = secrets.token_bytes(32)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((local_address(), 0))
        self.sock.setblocking(False)
        self.address = self.sock.getsockname()[:2]
        self.peers: dict[int, tuple[str, int, int, bytes]] = {}
        # rank -> when its last heartbeat came (monotonic); ended ranks leave it
        self.seen: dict[int, float] = {}
        # rank -> the sequence number of its last accepted datagram
        self.last_seq: dict[int, int] = {}
        self.seq = itertools.count(1)  # (next() is atomic: the hang report's thread sends too)
        # kind -> fn(rank, payload): the hang report's request and parts
        self.handlers: dict[bytes, object] = {}
        self.closed = threading.Event()
        self.thread = None

    def card(self) -> tuple[str, int, bytes]:
        """What the peers need to hear this rank: its address, port and key."""
        return (*self.address, self.key)

    def start(self, peers: dict[int, tuple[str, int, int, bytes]], on_lost) -> None:
        self.peers = {rank: peer for rank, peer in peers.items() if rank != self.rank}
        self.seen = dict.fromkeys(self.peers, time.monotonic())
        self.last_seq = dict.fromkeys(self.peers, 0)
        self.on_lost = on_lost
        self.thread = threading.Thread(target=self._run, daemon=True, name="accel_train-heartbeat")
        self.thread.start()

    def send(self, kind: bytes, payload: bytes = b"", to=None) -> None:
        """A signed datagram of `kind` to the peers `to` (default: every peer)."""
        body = b"%s %s %d %d %d %s" % (TAG, kind, self.rank, os.getpid(), next(self.seq), payload)
        message = sign(self.key, body)
        for rank in self.peers if to is None else to:
            ip, port = self.peers[rank][:2]
            try:
                self.sock.sendto(message, (ip, port))
            except OSError:  # (a network that is down: the peer hears nothing, as it should)
                pass

    def accept(self, data: bytes, sender) -> tuple[int, bytes, bytes] | None:
        """(rank, kind, payload) of a datagram this job's peer signed and sent, else None."""
        parts = data[MAC_BYTES:].split(b" ", 5)
        if len(parts) != 6 or parts[0] != TAG or not all(p.isdigit() for p in parts[2:5]):
            return None
        rank, pid, seq = int(parts[2]), int(parts[3]), int(parts[4])
        peer = self.peers.get(rank)
        if (peer is None or rank not in self.last_seq or tuple(sender[:2]) != (peer[0], peer[1])
                or pid != peer[2]):
            return None  # (not this job's peer, or an earlier attempt's rank under its rank)
        if not hmac.compare_digest(data[:MAC_BYTES], sign(peer[3], data[MAC_BYTES:])[:MAC_BYTES]):
            return None
        if seq <= self.last_seq[rank]:
            return None  # (a replay)
        self.last_seq[rank] = seq
        return rank, parts[1], parts[5]

    def _receive(self, now: float) -> None:
        while True:
            try:
                data, sender = self.sock.recvfrom(MAX_DATAGRAM + 64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (closed by close(); an ICMP error)
                return
            accepted = self.accept(data, sender)
            if accepted is None:
                continue
            rank, kind, payload = accepted
            if kind == b"bye":
                self.seen.pop(rank, None)  # it ended its training: its silence is no alarm
            elif kind == b"beat":
                if rank in self.seen:
                    self.seen[rank] = now
            elif kind in self.handlers:
                try:
                    self.handlers[kind](rank, payload)
                except Exception:  # (a report that cannot be written never stops the heartbeat)
                    pass

    def _run(self) -> None:
        since = last = next_beat = time.monotonic()
        while not self.closed.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.send(b"beat")
                next_beat = now + self.period_s
            try:
                select.select([self.sock], [], [], max(0.0, min(next_beat - now, self.period_s)))
            except (OSError, ValueError):  # (the socket closed under the select)
                return
            now = time.monotonic()
            self._receive(now)
            if now - last > max(self.timeout_s / 2, 3 * self.period_s):
                # this process did not run (stopped itself, its machine paused): a fresh window
                since = now
            last = now
            lost = silent(self.seen, since, now, self.timeout_s)
            if lost and not self.closed.is_set():
                self.on_lost(lost[0], now - max(self.seen[lost[0]], since))
                return

    def close(self) -> None:
        """Goodbye to the peers (the training is over here: no alarm at this rank's silence), the
        thread ends."""
        if self.closed.is_set():
            return
        self.closed.set()
        for _ in range(BYE_COPIES):
            self.send(b"bye")
        self.sock.close()


def alive(pid: int) -> bool:
    """A local peer that can still answer: its process exists and is neither exiting, a zombie nor
    stopped (SIGSTOP). A killed process closes its sockets in its exit (do_exit: exit_files) before
    it is a zombie, so a peer sees the connection reset while the killed one's state still reads
    running: its PF_EXITING flag is set by then."""
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
    # (state, ppid, pgrp, session, tty_nr, tpgid, flags, ...)
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X", "x", "T", "t") and not int(fields[6]) & PF_EXITING
