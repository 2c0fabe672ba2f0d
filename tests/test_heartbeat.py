"""The ranks' heartbeat (accel_train/resilience/heartbeat.py), in-process on localhost with short
periods. With real ranks: a frozen rank (test_survivor.py), a frozen machine and a cut link
(test_faults.py), a rank slow in one step past the timeout, no alarm (test_survivor.py)."""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from conftest import CONFIGS, ROOT, TINY, clean_env, steps_logged, trainer_pids, wait_for

from accel_train.resilience.heartbeat import TAG, Heartbeat, sign, silent


def beats(n, period_s=0.1, timeout_s=0.6):
    hearts = [Heartbeat(rank, period_s, timeout_s, n) for rank in range(n)]
    peers = {rank: (*h.address, os.getpid(), h.public) for rank, h in enumerate(hearts)}
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
    """Send `messages` to `target` from another socket every `period` until `target` reports a lost
    peer."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stray:
        deadline = time.monotonic() + timeout
        while not target.closed.is_set() and time.monotonic() < deadline:
            for message in messages:
                for port in filter(None, target.ports):
                    stray.sendto(message, (target.address[0], port))
            time.sleep(period)


def test_forged_beats_and_goodbyes_keep_no_stopped_peer_alive():
    # a rank's pid and port are readable by any local user: a datagram naming them is still no
    # heartbeat unless it is signed with the peer's key, comes from the peer's address and is newer
    # than the last one accepted
    (a, b), lost = beats(2)
    b.closed.set()  # b stops beating (a stopped process)
    try:
        pid = os.getpid()
        unsigned = [
            b"%s %s 1 %d %d " % (TAG, kind, pid, n)
            for kind in (b"beat", b"bye")
            for n in (10**6, 10**7)
        ]
        wrong_key = [sign(b"k" * 32, m) for m in unsigned]
        forge_until_lost(a, [b"%s beat 1 %d" % (TAG, pid), *unsigned, *wrong_key])
        assert lost and lost[0][:2] == (0, 1), lost
    finally:
        a.close()
        b.close()


def test_the_pair_keys_are_secrets_no_sniffer_or_local_user_can_compute():
    # what crosses the job's network in the gather (the cards) and what another local user reads
    # (pids, ports, the command line, the environment) give no key: a beat signed with anything
    # computed from them is dropped
    from accel_train.resilience.heartbeat import DH_PRIME, pair_key

    assert pow(2, (DH_PRIME - 1) // 2, DH_PRIME) in (1, DH_PRIME - 1)  # (2 is in the group)
    (a, b), lost = beats(2, timeout_s=600)
    try:
        assert a.keys[1] == b.keys[0] and len(a.keys[1]) == 32  # one key per pair, agreed
        public = [
            repr(a.card()).encode(),
            repr(b.card()).encode(),
            b"%d" % os.getpid(),
            " ".join(os.environ).encode(),
            open(f"/proc/{os.getpid()}/cmdline", "rb").read(),
        ]
        assert not any(a.keys[1] in text or a.keys[1].hex().encode() in text for text in public)
        import hashlib

        guesses = [hashlib.sha256(text).digest() for text in public] + [
            pair_key(2, b.public, (0, 1)),
            hashlib.sha256(b"%d" % (a.public * b.public % DH_PRIME)).digest(),
        ]
        body = b"%s beat 1 %d %d " % (TAG, os.getpid(), 10**9)
        assert all(a.accept(sign(guess, body), b.source(0)) is None for guess in guesses)
        assert a.accept(sign(b.keys[0], body), b.source(0)) == (1, b"beat", b"")
        # a fresh pair of ranks agrees on another key: nothing is fixed or derived from the process
        (c, d), _ = beats(2, timeout_s=600)
        try:
            assert c.keys[1] != a.keys[1]
        finally:
            c.close()
            d.close()
    finally:
        a.close()
        b.close()


def test_a_signed_datagram_from_another_address_or_replayed_is_dropped():
    (a, b), lost = beats(2)
    try:
        body = b"%s beat 1 %d 99 " % (TAG, os.getpid())
        genuine = sign(b.keys[0], body)
        assert a.accept(genuine, b.source(0)) == (1, b"beat", b"")
        assert a.accept(genuine, b.source(0)) is None  # replayed: its sequence number was seen
        newer = sign(b.keys[0], b"%s beat 1 %d 100 " % (TAG, os.getpid()))
        # another sender's port
        assert a.accept(newer, (b.source(0)[0], b.source(0)[1] + 1)) is None
        # altered after signing
        assert a.accept(newer.replace(b" 100 ", b" 101 "), b.source(0)) is None
        assert a.accept(newer, b.source(0)) == (1, b"beat", b"")
    finally:
        a.close()
        b.close()


def test_each_peer_has_a_socket_on_the_jobs_interface_that_hears_that_peer_only():
    (a, b, c), lost = beats(3, timeout_s=600)
    try:
        assert sorted(a.socks) == [1, 2] and a.ports[0] == 0
        for rank, sock in a.socks.items():
            assert sock.getsockname() == (a.address[0], a.ports[rank]) and a.address[0] != "0.0.0.0"
            # connected: the kernel delivers only the peer's socket for this rank
            assert sock.getpeername() == [b, c][rank - 1].source(0)
        # each hears its own peer
        wait_for(lambda: all(a.last_seq.values()), timeout=5, interval=0.05)
        assert lost == []
    finally:
        for h in (a, b, c):
            h.close()


def test_a_beat_of_another_process_under_the_same_rank_is_no_heartbeat():
    # an earlier attempt's rank, still sending to a port this attempt's peer reuses: only the
    # gathered pid counts
    (a, b), lost = beats(2)
    b.closed.set()
    try:
        key = b.keys[0]
        forge_until_lost(
            a, [sign(key, b"%s beat 1 %d %d " % (TAG, os.getpid() + 1, n)) for n in range(1, 3)]
        )
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
    # a long step is the training thread inside torch, a collective or a driver: C code that
    # releases the GIL, as libc's usleep through ctypes does. The heartbeat's own thread keeps both
    # peers beating for 3x the timeout.
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


# test only: every optimizer step ends in one C call that holds the GIL for ACCEL_TEST_GIL_N
# additions (~0.4 s at 2e7): the heartbeat's thread cannot drain its sockets meanwhile, as with a
# forward that holds the GIL
GIL_HOOK = """\
import os
if os.environ.get("ACCEL_TEST_GIL_N"):
    from torch.optim.optimizer import register_optimizer_step_post_hook
    _n = int(os.environ["ACCEL_TEST_GIL_N"])

    def _hold(optimizer, args, kwargs):
        sum(range(_n))
    register_optimizer_step_post_hook(_hold)
"""


def flood_as_nobody(targets: list[tuple[str, int]]) -> int:
    """Another local user's flood (uid 65534, who can read the ports in /proc/net/udp): 1-byte
    datagrams at every target, as fast as one process sends them, until killed. Its pid."""
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setgid(65534)
        os.setuid(65534)
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(4)]
        while True:
            for sock in socks:
                for target in targets:
                    try:
                        sock.sendto(b"x", target)
                    except OSError:
                        pass
    finally:
        os._exit(0)


@pytest.mark.faults
def test_a_flood_of_datagrams_from_another_user_does_not_silence_a_rank_whose_steps_hold_the_gil(
    tmp_path,
):
    import psutil

    out, hooks = tmp_path / "out", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(GIL_HOOK)
    tag = uuid.uuid4().hex
    env = clean_env(
        ACCEL_TEST_GIL_N="20000000",
        ACCEL_TEST_TAG=tag,
        PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIGS / "2proc_cpu.yaml"),
        "-m",
        "accel_train",
        *TINY,
        "--train_samples",
        "512",
        "--test_samples",
        "16",
        "--batch_size",
        "8",
        "--epochs",
        "2",
        "--log_every",
        "1",
        "--heartbeat_s",
        "0.5",
        "--heartbeat_timeout_s",
        "3",
        "--output_dir",
        str(out),
    ]
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        job = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True
        )
    flood = None
    try:
        wait_for(lambda: steps_logged(out) >= 2, timeout=240)
        # (psutil 6 renamed connections to net_connections)
        sockets = [
            getattr(proc, "net_connections", None) or proc.connections
            for proc in map(psutil.Process, trainer_pids(tag).values())
        ]
        targets = sorted({tuple(c.laddr) for of in sockets for c in of(kind="udp")})
        assert targets, "the ranks' heartbeat sockets"
        flood = flood_as_nobody(targets)
        code = job.wait(timeout=300)
    finally:
        if flood is not None:
            os.kill(flood, signal.SIGKILL)
            os.waitpid(flood, 0)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    text = log.read_text()
    assert code == 0 and "lost contact" not in text and "sent no heartbeat" not in text, text[
        -3000:
    ]
    assert steps_logged(out) == 64


def probably_prime(n: int, rounds: int = 32) -> bool:
    """Miller-Rabin."""
    import random

    if n % 2 == 0:
        return n == 2
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for _ in range(rounds):
        x = pow(random.randrange(2, n - 2), d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def test_the_key_exchange_group_is_a_safe_prime_of_2048_bits():
    from accel_train.resilience.heartbeat import DH_PRIME

    assert (
        DH_PRIME.bit_length() == 2048
        and probably_prime(DH_PRIME)
        and probably_prime((DH_PRIME - 1) // 2)
    )
    assert not probably_prime(DH_PRIME + 2)  # (the check can say no)


def test_what_stops_the_beats_is_said_where_the_flag_is():
    # a C call that holds the GIL past --heartbeat_timeout_s silences the heartbeat's thread: the
    # flag's help and docs/failures.md say so, and what to do
    from conftest import ROOT

    from accel_train.cli import train_parser

    flag = next(a for a in train_parser()._actions if "--heartbeat_timeout_s" in a.option_strings)
    assert "C call holding the GIL" in flag.help and "never a long step" not in flag.help
    table = (
        (ROOT / "docs" / "failures.md")
        .read_text()
        .split("## What the liveness and the files promise")[1]
    )
    assert (
        "holds the GIL longer than `--heartbeat_timeout_s`" in table
        and "raise `--heartbeat_timeout_s`" in table
    )
