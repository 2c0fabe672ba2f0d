"""The ranks' heartbeat (accel_train/resilience/heartbeat.py), in-process on localhost with short periods. With real ranks: a
frozen rank (test_survivor.py), a frozen machine and a cut link (test_faults.py), a rank slow in one step past the timeout, no
alarm (test_survivor.py)."""

import ctypes
import os
import socket
import time

from accel_train.resilience.heartbeat import TAG, Heartbeat, sign, silent
from conftest import wait_for


def beats(n, period_s=0.1, timeout_s=0.6):
    hearts = [Heartbeat(rank, period_s, timeout_s) for rank in range(n)]
    peers = {rank: (*h.address, os.getpid(), h.key) for rank, h in enumerate(hearts)}
    lost = []
    for h in hearts:
        h.start(peers, lambda rank, seconds, me=h.rank: lost.append((me, rank, seconds)))
    return hearts, lost


def test_a_silent_peer_is_lost_and_one_that_said_goodbye_is_not():
    (a, b, c), lost = beats(3)
    try:
        time.sleep(1.2)  # twice the timeout: every peer beats
        assert lost == []
        b.close()  # its training ended: a goodbye
        time.sleep(1.2)
        assert lost == []
        c.closed.set()  # c stops beating without one (a stopped process, a cut network)
        stopped = time.monotonic()
        wait_for(lambda: lost, timeout=5, interval=0.01)
        assert lost[0][:2] == (0, 2) and 0.6 <= lost[0][2] < 1.0, lost
        assert time.monotonic() - stopped < 1.0
    finally:
        for h in (a, b, c):
            h.close()


def forge_until_lost(target, messages, period=0.05, timeout=5):
    """Send `messages` to `target` from another socket every `period` until `target` reports a lost peer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
        deadline = time.monotonic() + timeout
        while not target.closed.is_set() and time.monotonic() < deadline:
            for message in messages:
                stray.sendto(message, target.address)
            time.sleep(period)


def test_forged_beats_and_goodbyes_keep_no_stopped_peer_alive():
    # a rank's pid and port are readable by any local user: a datagram naming them is still no heartbeat unless it
    # is signed with the peer's key, comes from the peer's address and is newer than the last one accepted
    (a, b), lost = beats(2)
    b.closed.set()  # b stops beating (a stopped process)
    try:
        pid = os.getpid()
        unsigned = [b"%s %s 1 %d %d " % (TAG, kind, pid, n) for kind in (b"beat", b"bye") for n in (10**6, 10**7)]
        wrong_key = [sign(b"k" * 32, m) for m in unsigned]
        forge_until_lost(a, [b"%s beat 1 %d" % (TAG, pid), *unsigned, *wrong_key])
        assert lost and lost[0][:2] == (0, 1), lost
    finally:
        a.close()
        b.close()


def test_a_signed_datagram_from_another_address_or_replayed_is_dropped():
    (a, b), lost = beats(2)
    try:
        body = b"%s beat 1 %d 99 " % (TAG, os.getpid())
        genuine = sign(b.key, body)
        assert a.accept(genuine, b.address) == (1, b"beat", b"")
        assert a.accept(genuine, b.address) is None  # replayed: its sequence number was seen
        newer = sign(b.key, b"%s beat 1 %d 100 " % (TAG, os.getpid()))
        assert a.accept(newer, ("127.0.0.1", b.address[1] + 1)) is None  # another sender's port
        assert a.accept(newer.replace(b" 100 ", b" 101 "), b.address) is None  # altered after signing
        assert a.accept(newer, b.address) == (1, b"beat", b"")
    finally:
        a.close()
        b.close()


def test_the_socket_listens_on_the_jobs_interface_only():
    h = Heartbeat(0, 0.1, 0.6)
    try:
        assert h.sock.getsockname()[0] != "0.0.0.0" and h.address[0] == h.sock.getsockname()[0]
    finally:
        h.close()


def test_a_beat_of_another_process_under_the_same_rank_is_no_heartbeat():
    # an earlier attempt's rank, still sending to a port this attempt's peer reuses: only the gathered pid counts
    (a, b), lost = beats(2)
    b.closed.set()
    try:
        key = b.key
        forge_until_lost(a, [sign(key, b"%s beat 1 %d %d " % (TAG, os.getpid() + 1, n)) for n in range(1, 3)])
        assert lost and lost[0][:2] == (0, 1), lost
    finally:
        a.close()
        b.close()


def test_silence_counts_from_the_last_beat_or_a_fresh_window():
    seen = {1: 10.0, 2: 14.0}
    assert silent(seen, since=0.0, now=31.0, timeout_s=20.0) == [1]
    # this process was stopped itself until 25.0: its peers get a fresh window from then
    assert silent(seen, since=25.0, now=31.0, timeout_s=20.0) == []


def test_beats_go_on_while_the_main_thread_is_blocked_in_a_c_call():
    # a long step is the training thread inside torch, a collective or a driver: C code that releases the GIL, as
    # libc's usleep through ctypes does. The heartbeat's own thread keeps both peers beating for 3x the timeout.
    (a, b), lost = beats(2)
    try:
        ctypes.CDLL(None).usleep(1_800_000)
        assert lost == [] and not a.closed.is_set() and not b.closed.is_set()
        b.closed.set()  # (the same watch still finds a peer that stops)
        wait_for(lambda: lost, timeout=5, interval=0.01)
        assert lost[0][:2] == (0, 1), lost
    finally:
        a.close()
        b.close()
