"""The ranks' heartbeat (accel_train/heartbeat.py), in-process on localhost with short periods. With real ranks: a
frozen rank (test_survivor.py), a frozen machine and a cut link (test_faults.py), a rank 60 s slow in one step, no alarm
(test_survivor.py)."""

import os
import socket
import time

from accel_train.heartbeat import TAG, Heartbeat, silent
from conftest import wait_for


def beats(n, period_s=0.1, timeout_s=0.6):
    hearts = [Heartbeat(rank, period_s, timeout_s) for rank in range(n)]
    peers = {rank: (*h.address, os.getpid()) for rank, h in enumerate(hearts)}
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


def test_a_beat_of_another_process_under_the_same_rank_is_no_heartbeat():
    # an earlier attempt's rank, still sending to a port this attempt's peer reuses: only the gathered pid counts
    (a, b), lost = beats(2)
    b.closed.set()
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
            deadline = time.monotonic() + 5
            while not lost and time.monotonic() < deadline:
                stray.sendto(b"%s beat 1 %d" % (TAG, os.getpid() + 1), a.address)
                time.sleep(0.05)
        assert lost and lost[0][:2] == (0, 1), lost
    finally:
        a.close()
        b.close()


def test_silence_counts_from_the_last_beat_or_a_fresh_window():
    seen = {1: 10.0, 2: 14.0}
    assert silent(seen, since=0.0, now=31.0, timeout_s=20.0) == [1]
    # this process was stopped itself until 25.0: its peers get a fresh window from then
    assert silent(seen, since=25.0, now=31.0, timeout_s=20.0) == []
