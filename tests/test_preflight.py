import socket
import subprocess
import sys
import threading
import time

from conftest import ROOT, clean_env

import accel_train.commands.preflight as preflight_module
from accel_train.commands.preflight import preflight


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_succeeds_against_a_listening_rank0():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "accel_train",
                "preflight",
                "--host",
                "localhost",
                "--port",
                str(port),
                "--rank",
                "1",
                "--timeout",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            env=clean_env(),
        )
    assert proc.returncode == 0, proc.stderr
    assert "reachable" in proc.stdout and "preflight: ok" in proc.stdout


def test_fails_clearly_within_its_bound_when_nothing_listens():
    port = free_port()
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accel_train",
            "preflight",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--rank",
            "1",
            "--timeout",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=clean_env(),
    )
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot reach rank 0 at 127.0.0.1:{port}" in lines[0]
    assert "connection refused" in lines[0] and "firewall" in lines[0] and "MASTER_ADDR" in lines[0]
    assert time.monotonic() - start < 30  # interpreter start + the 3 s bound


def test_unresolvable_host_and_rank0_checks():
    failures = preflight("no-such-host.invalid", 29500, 1, timeout=5, log=lambda m: None)
    assert len(failures) == 1 and "does not resolve" in failures[0] and "MASTER_ADDR" in failures[0]
    assert preflight("127.0.0.1", free_port(), 0, timeout=5, log=lambda m: None) == []
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        failures = preflight("127.0.0.1", busy.getsockname()[1], 0, timeout=5, log=lambda m: None)
    assert len(failures) == 1 and "already in use" in failures[0]
    # TEST-NET: not ours
    failures = preflight("192.0.2.1", free_port(), 0, timeout=5, log=lambda m: None)
    assert len(failures) == 1 and "not an address of this machine" in failures[0]


def test_a_rank_started_before_rank0_waits_for_its_listener():
    port = free_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    timer = threading.Timer(3, lambda: (server.bind(("127.0.0.1", port)), server.listen()))
    start = time.monotonic()
    timer.start()
    try:
        failures = preflight("127.0.0.1", port, 1, timeout=30, log=lambda m: None)
    finally:
        timer.cancel()
        server.close()
    assert failures == [] and 3 <= time.monotonic() - start < 30


def test_a_rank0_name_that_resolves_late_is_waited_for(monkeypatch):
    # in Kubernetes the rank-0 pod's DNS name appears only once that pod is up
    answers = iter([[], [], ["127.0.0.1"]])
    monkeypatch.setattr(preflight_module, "resolve", lambda host, timeout: next(answers))
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert (
            preflight("rank0.job.svc", server.getsockname()[1], 1, timeout=30, log=lambda m: None)
            == []
        )
    answers = iter([[]] * 100)
    start = time.monotonic()
    failures = preflight("rank0.job.svc", 29500, 1, timeout=2, log=lambda m: None)
    assert (
        len(failures) == 1
        and "does not resolve within 2s" in failures[0]
        and time.monotonic() - start < 10
    )


def test_a_lookup_slower_than_5s_is_waited_for_and_one_that_never_answers_fails_in_one_line(
    monkeypatch, capsys
):
    # glibc waits 5 s per nameserver that does not answer, so one dead nameserver makes every lookup
    # take longer than 5 s; preflight capped each attempt at 5 s and dropped the late answer, so
    # such a host never resolved
    real, release = socket.getaddrinfo, threading.Event()

    def slow(host, *args, **kwargs):
        release.wait(6.5)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(preflight_module.socket, "getaddrinfo", slow)
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen()
            start = time.monotonic()
            code = preflight_module.main_preflight(
                [
                    "--host",
                    "rank0.slow-dns",
                    "--port",
                    str(server.getsockname()[1]),
                    "--rank",
                    "1",
                    "--timeout",
                    "20",
                ]
            )
            assert code == 0 and 6 <= time.monotonic() - start < 19, capsys.readouterr()
        assert "preflight: rank0.slow-dns resolves to 127.0.0.1" in capsys.readouterr().out

        def never(host, *args, **kwargs):
            release.wait(120)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

        monkeypatch.setattr(preflight_module.socket, "getaddrinfo", never)
        start = time.monotonic()
        assert (
            preflight_module.main_preflight(
                ["--host", "rank0.dead-dns", "--rank", "1", "--timeout", "3"]
            )
            == 1
        )
        assert time.monotonic() - start < 6
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "preflight: FAILED: rank-0 host 'rank0.dead-dns' does not resolve within 3s"
        ), err
    finally:
        release.set()  # (the lookups' threads end)
