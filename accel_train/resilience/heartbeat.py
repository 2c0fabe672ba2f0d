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

Every datagram is signed (HMAC-SHA256) with a key of the pair of ranks, agreed by a Diffie-Hellman
exchange (RFC 3526's 2048-bit group) over that same gather: each rank hands its peers a public
value only, so a sniffer of the job's network (the gather crosses it in the clear) learns no key;
it must come from the peer's gathered address and port, name the peer's pid, and carry a sequence
number above the last one accepted. A forged or replayed datagram (a rank's pid and
port are readable by any local user) is dropped. A rank holds one UDP socket per peer, bound to the
address of the interface the job's route leaves from and connected to that peer's socket for it: the
kernel drops a datagram from any other sender before it is queued, so datagrams nobody asked for (a
local user's flood at the ports /proc/net/udp lists) never fill the buffer that the peer's beats
wait in while a step holds the GIL.

The same channel carries the hang report's request and its parts (hang.py):
`send(kind, payload, to)` and `handlers[kind](rank, payload)`, run in the heartbeat's thread.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import resource
import secrets
import selectors
import socket
import threading
import time
from pathlib import Path

TAG = b"accel_train-heartbeat"
# RFC 3526's 2048-bit MODP group (group 14): a safe prime, generator 2 (tests/test_heartbeat.py
# checks both primes)
DH_PRIME = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A0879"
    "8E3404DDEF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B"
    "0BFF5CB6F406B7EDEE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA4836"
    "1C55D39A69163FA8FD24CF5F83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804"
    "F1746C08CA18217C32905E462E36CE3BE39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6"
    "955817183995497CEA956AE515D2261898FA051015728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
DH_GENERATOR = 2
DH_SECRET_BITS = 256  # (the exponent: 128-bit security, more than the group's 112)
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


def pair_key(secret: int, peer_public: int, ranks: tuple[int, int]) -> bytes:
    """The key two ranks share: a hash of their Diffie-Hellman secret and their ranks (the same
    on both sides). A public value outside the group's (1, p - 1) is refused."""
    if not 1 < peer_public < DH_PRIME - 1:
        raise ValueError("a heartbeat public value outside the group")
    shared = pow(peer_public, secret, DH_PRIME)
    low, high = sorted(ranks)
    return hashlib.sha256(TAG + shared.to_bytes(256, "big") + b"%d-%d" % (low, high)).digest()


def sign(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest() + body


def enough_descriptors(needed: int) -> None:
    """Raise this process's soft limit of open files (to the hard one) where a socket per peer would
    not fit under it beside the data loading's files."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        limit = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, limit), hard))
        except (ValueError, OSError):
            pass


class Heartbeat:
    """One rank's heartbeat among `world` ranks: `card()` goes to the peers (the survivor's
    gather), `start(peers, on_lost)` begins the thread, `close()` says goodbye. `on_lost(rank,
    seconds)` runs in the thread when a peer is silent too long. `peers`: rank -> (ip, ports, pid,
    public value), `ports[r]`: the port of that rank's socket for rank r."""

    def __init__(self, rank: int, period_s: float, timeout_s: float, world: int):
        self.rank, self.period_s, self.timeout_s = rank, period_s, timeout_s
        # (this rank's Diffie-Hellman secret; only the public value leaves the process)
        self._secret = secrets.randbits(DH_SECRET_BITS) | (1 << (DH_SECRET_BITS - 1))
        self.public = pow(DH_GENERATOR, self._secret, DH_PRIME)
        self.keys: dict[int, bytes] = {}  # rank -> the key this rank and that one share
        enough_descriptors(world)
        ip = local_address()
        # rank -> this rank's socket for it (connected to the peer's socket for this rank at start)
        self.socks: dict[int, socket.socket] = {}
        for peer in range(world):
            if peer != rank:
                sock = self.socks[peer] = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                sock.bind((ip, 0))
                sock.setblocking(False)
        self.ports = tuple(
            self.socks[r].getsockname()[1] if r in self.socks else 0 for r in range(world)
        )
        self.address = (ip, self.ports)
        self.peers: dict[int, tuple[str, tuple[int, ...], int, bytes]] = {}
        # rank -> when its last heartbeat came (monotonic); ended ranks leave it
        self.seen: dict[int, float] = {}
        # rank -> the sequence number of its last accepted datagram
        self.last_seq: dict[int, int] = {}
        self.seq = itertools.count(1)  # (next() is atomic: the hang report's thread sends too)
        # kind -> fn(rank, payload): the hang report's request and parts
        self.handlers: dict[bytes, object] = {}
        self.closed = threading.Event()
        self.thread = None
        self.selector = None

    def card(self) -> tuple[str, tuple[int, ...], int]:
        """What the peers need to hear this rank: its address, its port for each rank, its public
        Diffie-Hellman value."""
        return (*self.address, self.public)

    def source(self, rank: int) -> tuple[str, int]:
        """The address and port this rank's datagrams to `rank` come from."""
        return self.address[0], self.ports[rank]

    def start(self, peers: dict[int, tuple[str, tuple[int, ...], int, int]], on_lost) -> None:
        """`peers`: rank -> (ip, ports, pid, public value), as their cards were gathered."""
        self.peers = {rank: peer for rank, peer in peers.items() if rank != self.rank}
        self.keys = {
            rank: pair_key(self._secret, peer[3], (self.rank, rank))
            for rank, peer in self.peers.items()
        }
        for rank, sock in list(self.socks.items()):
            if rank in self.peers:  # (from here the kernel takes datagrams from that peer only)
                ip, ports = self.peers[rank][:2]
                sock.connect((ip, ports[self.rank]))
            else:  # (a rank this one cannot reach: no watch either way)
                sock.close()
                del self.socks[rank]
        self.selector = selectors.DefaultSelector()
        for sock in self.socks.values():
            self.selector.register(sock, selectors.EVENT_READ)
        self.seen = dict.fromkeys(self.peers, time.monotonic())
        self.last_seq = dict.fromkeys(self.peers, 0)
        self.on_lost = on_lost
        self.thread = threading.Thread(target=self._run, daemon=True, name="accel_train-heartbeat")
        self.thread.start()

    def send(self, kind: bytes, payload: bytes = b"", to=None) -> None:
        """A signed datagram of `kind` to the peers `to` (default: every peer)."""
        body = b"%s %s %d %d %d %s" % (TAG, kind, self.rank, os.getpid(), next(self.seq), payload)
        for rank in self.peers if to is None else to:
            try:
                self.socks[rank].send(sign(self.keys[rank], body))
            # (a network that is down, a peer's socket closed: the peer hears nothing, as it
            # should)
            except (OSError, KeyError):
                pass

    def accept(self, data: bytes, sender) -> tuple[int, bytes, bytes] | None:
        """(rank, kind, payload) of a datagram this job's peer signed and sent, else None.
        `sender`: the address and port it came from."""
        parts = data[MAC_BYTES:].split(b" ", 5)
        if len(parts) != 6 or parts[0] != TAG or not all(p.isdigit() for p in parts[2:5]):
            return None
        rank, pid, seq = int(parts[2]), int(parts[3]), int(parts[4])
        peer = self.peers.get(rank)
        if (
            peer is None
            or rank not in self.last_seq
            or tuple(sender[:2]) != (peer[0], peer[1][self.rank])
            or pid != peer[2]
        ):
            return None  # (not this job's peer, or an earlier attempt's rank under its rank)
        if not hmac.compare_digest(
            data[:MAC_BYTES], sign(self.keys[rank], data[MAC_BYTES:])[:MAC_BYTES]
        ):
            return None
        if seq <= self.last_seq[rank]:
            return None  # (a replay)
        self.last_seq[rank] = seq
        return rank, parts[1], parts[5]

    def _receive(self, now: float, ready) -> None:
        for sock in ready:
            self._drain(sock, now)

    def _drain(self, sock, now: float) -> None:
        while True:
            try:
                data, sender = sock.recvfrom(MAX_DATAGRAM + 64)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionRefusedError:  # (an ICMP error of an earlier send: the peer's socket
                continue  # was not there yet, or is gone)
            except OSError:  # (closed by close())
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
            try:  # (epoll: no limit on the descriptors' numbers)
                ready = [
                    key.fileobj
                    for key, _ in self.selector.select(
                        max(0.0, min(next_beat - now, self.period_s))
                    )
                ]
            except (OSError, ValueError):  # (a socket closed under the select)
                return
            now = time.monotonic()
            self._receive(now, ready)
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
        for sock in self.socks.values():
            sock.close()
        if self.selector is not None:
            self.selector.close()


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
