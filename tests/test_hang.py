"""The hang report (accel_train/hang.py), in process: a training thread without progress is named
with its stack, the peers' parts come over the heartbeat's channel, a busy peer is no hang, exempt
work is none, --stop_on_hang ends. With real ranks: a model that blocks on one rank
(test_survivor.py)."""

import importlib.util
import threading
import time
import types

from accel_train.hang import HANG_STEPS, HangReport, Progress
from accel_train.resilience.heartbeat import Heartbeat


def settings(**kw):
    return types.SimpleNamespace(
        **{"hang_report_s": 1.0, "stop_on_hang": False, "timeout_s": 300, "compile": False, **kw}
    )


def wait_for_the_lock_that_never_comes(seconds):
    threading.Event().wait(seconds)


def test_a_training_thread_without_progress_is_named_with_its_stack_once(capfd):
    progress = Progress()
    with HangReport(settings(), types.SimpleNamespace(step_s=None), progress).start():
        progress.mark("training", 7)
        wait_for_the_lock_that_never_comes(4.5)
    err = capfd.readouterr().err
    assert err.count("has made no progress for") == 1, err  # once per stall
    assert "rank 0 (" in err and "training, step 7" in err, err
    assert "training thread in wait" in err and "wait_for_the_lock_that_never_comes" in err, err
    assert "Traceback" not in err  # (a warning, not an error)


def test_the_bound_is_learned_from_the_agreed_step_time_and_exempt_work_is_no_hang():
    stop = types.SimpleNamespace(step_s=5.0)
    report = HangReport(settings(hang_report_s=30), stop, Progress())
    assert report.bound() == HANG_STEPS * 5.0
    stop.step_s = 0.1
    assert report.bound() == 30
    with report.progress.exempt("checkpoint write"):
        assert report.idle(time.monotonic() + 1000) is None
    assert report.idle(time.monotonic() + 10) >= 9.9


def reports(n, progress):
    hearts = [Heartbeat(rank, 0.2, 600, n) for rank in range(n)]
    peers = {
        rank: (*h.address, __import__("os").getpid(), h.public) for rank, h in enumerate(hearts)
    }
    for h in hearts:
        h.start(peers, lambda *a: None)
    out = []
    for rank, (h, p) in enumerate(zip(hearts, progress)):
        r = HangReport(settings(hang_report_s=60), types.SimpleNamespace(step_s=None), p)
        r.attach(rank, h)
        out.append(r)
    return hearts, out


def test_every_ranks_place_comes_over_the_channel_and_a_busy_peer_is_no_hang(capfd):
    progress = [Progress(), Progress()]
    hearts, (zero, one) = reports(2, progress)
    try:
        progress[0].mark("evaluation", 9, "batch 1")
        progress[1].mark("training", 9)
        progress[0].at -= 100
        progress[1].at -= 100  # both stalled (a collective that waits for a peer blocked elsewhere)
        assert zero.report(100, 60)[0]
        err = capfd.readouterr().err
        assert "rank 0 (" in err and "evaluation, batch 1, step 9" in err, err
        assert "rank 1 (" in err and "training, step 9" in err and "rank 1's threads:" in err, err
        assert "this rank's stacks are in its report" in err  # rank 1 says where its stacks went
        # rank 1 works on: rank 0 only waits for it (a long decode, say)
        progress[1].mark("training", 10)
        progress[0].at -= 100
        assert not zero.report(100, 60)[0]
        assert "has made no progress" not in capfd.readouterr().err
    finally:
        for h in hearts:
            h.close()


def test_a_peer_that_does_not_answer_is_named():
    progress = [Progress(), Progress()]
    hearts, (zero, one) = reports(2, progress)
    hearts[1].handlers.clear()  # (its thread does not run: a stopped process, the GIL held)
    try:
        progress[0].at -= 100
        assert zero.report(100, 60)[0]
    finally:
        for h in hearts:
            h.close()


def waiting_in_a_collective(tmp_path):
    """A function whose frames read as torch.distributed's all_reduce: a rank waiting on a peer."""
    folder = tmp_path / "torch" / "distributed"
    folder.mkdir(parents=True)
    (folder / "fake_c10d.py").write_text(
        "import threading\n\ndef all_reduce(seconds):\n    threading.Event().wait(seconds)\n"
    )
    spec = importlib.util.spec_from_file_location("fake_c10d", folder / "fake_c10d.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.all_reduce


def test_stop_on_hang_ends_the_run_of_a_rank_waiting_on_a_peer(tmp_path, capfd):
    ended = []
    progress = Progress()
    all_reduce = waiting_in_a_collective(tmp_path)
    with HangReport(
        settings(stop_on_hang=True), types.SimpleNamespace(step_s=None), progress
    ).start() as report:
        report.attach(0, None, ended.append)
        progress.mark("training", 3)
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            all_reduce(0.2)
    assert "rank 0 made no progress" in ended[0] and "collective all_reduce" in ended[0], ended
    assert "--stop_on_hang: the run ends here" in capfd.readouterr().err


def test_stop_on_hang_waits_for_the_first_step_and_never_stops_a_computing_rank(capfd, monkeypatch):
    # a slow first step (a compile, a first large batch, a slow first read), then a slow step that
    # computes: the report is printed, nothing is stopped
    monkeypatch.setenv("RANK", "1")  # (during start-up the report knows the rank from the launcher)
    for step, says in (
        (0, "--stop_on_hang waits for the first step"),
        (5, "--stop_on_hang: no rank waits on a peer"),
    ):
        ended = []
        progress = Progress()
        with HangReport(
            settings(stop_on_hang=True), types.SimpleNamespace(step_s=None), progress
        ).start() as r:
            r.attach(None, None, ended.append)
            progress.mark("training", step)
            wait_for_the_lock_that_never_comes(3.5)
        err = capfd.readouterr().err
        assert not ended and err.count("has made no progress") == 1, err
        assert "rank 1 has made no progress" in err and "rank 1 (" in err, err
        assert f"nothing is stopped ({says}" in err and "the run ends here" not in err, err
        if step == 0:
            assert (
                "(bound: --hang_report_s 1: before the first step no step time is known)" in err
            ), err
