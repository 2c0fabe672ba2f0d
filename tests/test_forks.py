"""DataLoader workers forked while other threads run: a child stuck before its first line of Python
is killed and forked again (accel_train/forks.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accel_train import forks
from accel_train.config.train_config import TrainConfig
from accel_train.data.workers import loader_kwargs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_STALL = {"token": None}


def _stall_once_in_the_child():
    # What a fork under CPython's gh-112275 leaves: a child that never gets to its first line of
    # Python (here: it waits in an at-fork hook, past the reinit, before multiprocessing runs).
    token = _STALL["token"]
    if token and os.path.exists(token):
        os.remove(token)
        time.sleep(3600)


os.register_at_fork(after_in_child=_stall_once_in_the_child)


def test_a_worker_stuck_before_python_is_forked_again_and_the_loader_delivers(tmp_path, monkeypatch,
                                                                              capfd):
    monkeypatch.setattr(forks, "FORK_START_S", 0.5)
    token = tmp_path / "stall"
    token.write_text("")
    monkeypatch.setitem(_STALL, "token", str(token))
    data = TensorDataset(torch.arange(12.0).view(6, 2), torch.arange(6))
    kwargs = loader_kwargs(TrainConfig(num_workers=1), "cpu")
    assert kwargs["multiprocessing_context"] is forks.FORK
    loader = DataLoader(data, batch_size=3, **kwargs)
    got = []
    reader = threading.Thread(target=lambda: got.extend(y.tolist() for _, y in loader), daemon=True)
    reader.start()
    reader.join(60)
    alive = reader.is_alive()
    if alive:  # (the old fork: the loader waits for ever on the stuck child; end it for the next tests)
        for child in multiprocessing.active_children():
            child.kill()
    assert not alive, "the loader waited on a worker that never started"
    assert got == [[0, 1, 2], [3, 4, 5]]
    assert not token.exists()  # the first child did stall
    err = capfd.readouterr().err
    assert err.count("did not start in 0.5 s") == 1, err
    assert "CPython gh-112275" in err and "attempt 2 of 4" in err
    del loader


def test_a_worker_that_ends_by_itself_is_left_to_the_dataloader(monkeypatch):
    # A child that died before running (not stuck) closes the pipe: no second fork, the DataLoader's
    # own error says which worker died.
    monkeypatch.setattr(forks, "FORK_START_S", 30.0)
    process = forks.FORK.Process(target=os._exit, args=(3,))
    started = time.monotonic()
    process.start()
    process.join(10)
    assert process.exitcode == 3 and time.monotonic() - started < 10


def test_four_stuck_forks_end_in_one_line_naming_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(forks, "FORK_START_S", 0.2)
    monkeypatch.setattr(forks, "FORK_ATTEMPTS", 2)
    monkeypatch.setattr(forks._SeenToStartProcess, "run", lambda self: time.sleep(3600))
    with pytest.raises(forks.WorkerDidNotStart, match="2 forks of 0.2 s each; --num_workers 0"):
        forks.FORK.Process(target=os.getpid).start()


def test_workers_are_forked_by_it_only_where_they_would_be_forked(monkeypatch):
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: None)
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["fork", "spawn"])
    assert forks.worker_context() is forks.FORK
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["forkserver", "fork"])
    assert forks.worker_context() is None  # (Python 3.14's Linux default: nothing is forked)
    monkeypatch.setattr(multiprocessing, "get_start_method", lambda allow_none=False: "spawn")
    assert forks.worker_context() is None  # (a script's own choice)
    assert loader_kwargs(TrainConfig(num_workers=0), "cpu")["multiprocessing_context"] is None


# The race itself: native threads that enter Python (as c10d's gloo run loop does) create a thread
# state each time, under the lock a fork copies. With the plain fork, CPython 3.10.13 and 3.11.7
# leave a stuck child within ~500-5000 forks (seconds); 3.12 never.
RACE = textwrap.dedent("""
    import ctypes, os, sys, threading, time
    from accel_train import forks
    forks.FORK_START_S = 0.5
    libc = ctypes.CDLL(None)
    enter = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: None)

    def churn():
        tid = ctypes.c_ulong()
        while True:
            libc.pthread_create(ctypes.byref(tid), None, enter, None)
            libc.pthread_join(tid, None)

    for _ in range(2):
        threading.Thread(target=churn, daemon=True).start()
    context = forks.FORK if sys.argv[1] == "guarded" else forks.multiprocessing.get_context("fork")
    n, start = 0, time.monotonic()
    while time.monotonic() - start < float(sys.argv[2]):
        p = context.Process(target=os.getpid)
        p.start()
        p.join()
        assert p.exitcode == 0, p.exitcode
        n += 1
    print("started", n, flush=True)
""")


@pytest.mark.faults
def test_forks_beside_threads_that_enter_python_all_start():
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", RACE, "guarded", "20"], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    started = int(out.stdout.split()[-1])
    assert started > 500, out.stdout
    retried = out.stderr.count("did not start in 0.5 s")
    print(f"{started} forks, {retried} forked again ({sys.version.split()[0]})")
