"""Preemption with real signals in one run of 2 ranks: SIGUSR1 to one rank mid epoch, SIGTERM to
launch.sh during the evaluation, and a rank killed outright, each resumed (Ctrl-C on 2 ranks:
test_ctrl_c.py); the stop request's handler in-process."""

import json
import os
import re
import signal
import sys
import time

import psutil
import pytest
from conftest import ROOT, Job, processes, steps_logged, trainer_pids, wait_for
from safetensors.torch import load_file

from accel_train.resilience import preempt

# resnet18 (the default, cifar stem) at 4 images per rank: ~0.3 s a step on 2 cores, long enough for
# a signal or a kill to land mid-epoch. 256 random samples, global batch 8: 32 steps an epoch (~10
# s, twice the longest gap between the ranks' agreed stop checks, preempt.AgreedChecks.MAX_S), 2
# epochs. Through the cpu pipeline and its default (persistent) DataLoader workers: they are running
# when each signal and the kill land.
SLOW_STEPS = [
    "--train_samples",
    "256",
    "--test_samples",
    "32",
    "--epochs",
    "2",
    "--batch_size",
    "4",
    "--pipeline",
    "cpu",
]
RUN = [*SLOW_STEPS, "--log_every", "1"]


def sigterm_when(job, ready, sleep=0.0, interval=0.05):
    """SIGTERM to launch.sh (as Kubernetes / ModelArts / SLURM send it) once ready(); its exit
    status and how long the job took to stop."""
    wait_for(ready, timeout=240, interval=interval)
    time.sleep(sleep)
    sent = time.monotonic()
    os.kill(job.proc.pid, signal.SIGTERM)
    code = job.end(60)
    return code, time.monotonic() - sent


@pytest.mark.faults
def test_preempted_twice_and_a_rank_killed_each_resumed_ends_with_the_uninterrupted_weights(
    tmp_path, references
):
    # One run, three interruptions, each resumed, ending with the uninterrupted run's weights. One
    # launch.sh with --max_restarts 2 --restart_on_preempt:
    # 1. SIGUSR1 to rank 1 only, mid epoch 1 (what `scancel --signal=USR1` or SLURM's --signal
    #    delivers): every rank stops at one step with a checkpoint; a preemption that did not come
    #    through launch.sh, which relaunches it;
    # 2. SIGKILL to rank 1 a few steps later: rank 0, the survivor, saves the last step it
    #    completed and the job is relaunched from it (the second relaunch: attempt 3 of 3);
    # 3. SIGTERM to launch.sh (as Kubernetes / ModelArts / SLURM send it) during epoch 1's
    #    evaluation: the epoch's checkpoint is written, its metrics row is not; a signal to
    #    launch.sh itself is never relaunched. Then `--resume auto` redoes only that evaluation
    #    and trains epoch 2. (A kill resumed from a periodic checkpoint: test_faults.py's kill
    #    during a save, test_multinode.py's machines lost with their disks.)
    # 1000 test samples: an evaluation of ~6 s alone (~10 s in the suite), long enough for a signal
    # to land in it (the test set does not change what is trained).
    out = tmp_path / "out"
    # the uninterrupted run, launched the same way (its own test set and log settings do not change
    # the weights)
    ref = references.get("launch.sh", 2, SLOW_STEPS)
    # (the survivor's save is one)
    flags = [
        "--test_samples",
        "1000",
        "--log_all_ranks",
        "--keep_checkpoints",
        "3",
    ]

    with Job(
        [*RUN, *flags, "--max_restarts", "2", "--restart_on_preempt"], out, tmp_path / "run.log"
    ) as job:
        job.steps(3)
        first = job.pids()
        os.kill(first[1], signal.SIGUSR1)
        step = int(
            wait_for(lambda: re.findall(r"stopped by SIGUSR1 at step (\d+)", job.text), timeout=60)[
                0
            ]
        )
        assert 3 <= step < 28, step  # (room for the kill below within epoch 1)
        job.steps(step + 3)  # the relaunched job, 3 steps on
        pids = wait_for(
            lambda: trainer_pids(job.tag).get(1, first[1]) != first[1] and trainer_pids(job.tag),
            timeout=30,
        )
        os.kill(pids[1], signal.SIGKILL)
        code, elapsed = sigterm_when(job, lambda: steps_logged(out) >= 32, sleep=1, interval=0.01)
    text = (tmp_path / "run.log").read_text()
    assert code == 4 and elapsed < 30, (elapsed, text[-3000:])
    # written at the start
    assert (out / "config.yaml").is_file() and not (out / "model.safetensors").exists()
    stops = re.findall(r"stopped by (SIGUSR1|a signal on another rank) at step (\d+)", text)
    # rank 1 got it
    assert sorted(s[0] for s in stops) == [
        "SIGUSR1",
        "a signal on another rank",
    ], stops
    assert {int(s[1]) for s in stops} == {step}  # every rank at the same step
    assert (
        text.count("relaunching to resume from the newest checkpoint") == 2
        and "(attempt 3 of 3)" in text
    )
    # the first relaunch (every rank says it) resumes the preemption's checkpoint, the second the
    # survivor's save
    saved = int(re.findall(r"step (\d+) saved by the survivor", text)[0])
    assert saved >= step + 3, (saved, step)
    assert (
        re.findall(r"resumed from .*step_(\d{8})", text)
        == [f"{step:08d}"] * 2 + [f"{saved:08d}"] * 2
    )
    assert f"step {step}, {step} batches into the epoch" in text
    ckpt = out / "checkpoints" / f"step_{step:08d}"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (0, step, step)
    assert sorted(p.name for p in ckpt.glob("random_states_*")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]
    assert "while evaluating epoch 1" in text and "preempted (exit status 4)" in text
    state = json.loads((out / "checkpoints" / "step_00000032" / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (0, 32, 32)
    # the epoch's row comes with its evaluation
    assert not (out / "metrics.jsonl").read_text().strip()
    assert not (out / "model.safetensors").exists()  # no export of an unfinished run

    with Job([*RUN, *flags, "--resume", "auto"], out, tmp_path / "end.log") as job:
        code = job.end(300)
    text = (tmp_path / "end.log").read_text()
    assert code == 0, text[-4000:]
    assert re.findall(r"resumed from .*step_(\d{8})", text) == ["00000032"] * 2
    assert "step 32, 32 batches into the epoch" in text and "relaunching" not in text
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["step"], r["test_samples"]) for r in rows] == [
        (1, 32, 1000),
        (2, 64, 1000),
    ]
    # no step's row lost or repeated across the four launches (a resume trims the history to its
    # checkpoint)
    assert [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()] == list(
        range(1, 65)
    )
    a, b = load_file(ref / "model.safetensors"), load_file(out / "model.safetensors")
    assert max((a[k].double() - b[k].double()).abs().max().item() for k in a) <= 1e-6


@pytest.mark.parametrize(
    "first,announce,said",
    [(signal.SIGINT, True, 1), (signal.SIGINT, False, 0), (signal.SIGTERM, True, 0)],
)
def test_a_first_ctrl_c_says_what_happens_next_and_a_second_stops_at_once(
    capfd, monkeypatch, first, announce, said
):
    # a Ctrl-C is answered at once (the stop itself waits for the next agreed check, seconds away);
    # a preemption's SIGTERM is not a user at a terminal; only the main process speaks
    exits = []
    monkeypatch.setattr(preempt.os, "_exit", lambda code: exits.append(code))
    stop = preempt.StopRequest().install()
    try:
        stop.announce = stop.notice = announce  # (the main process; start-up over)
        os.kill(os.getpid(), first)
        assert stop.signal == first and not exits
        assert (
            capfd.readouterr().err.count(
                "accel-train: Ctrl-C: every rank stops at its next agreed check"
            )
            == said
        )
        # a signal right behind the first (the agent's SIGTERM after its SIGINT when it got two,
        # `timeout` forwarding the terminal's) is the same stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert not exits and "a second Ctrl-C" not in capfd.readouterr().err
        stop.since -= preempt.ONE_STOP_S  # a Ctrl-C typed later
        # torchrun's agent answers a second Ctrl-C with SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)
        err = capfd.readouterr().err
        assert exits == ([130] if first == signal.SIGINT else [])
        assert err.count("a second Ctrl-C stopped the run at once") == (
            said if first == signal.SIGINT else 0
        )
    finally:
        stop.uninstall()


def test_the_handlers_line_never_raises_into_the_interrupted_code(monkeypatch):
    writes = []

    def full(fd, data):
        writes.append(fd)
        raise BlockingIOError(11, "Resource temporarily unavailable")  # a full non-blocking pipe

    monkeypatch.setattr(preempt.os, "write", full)
    preempt.say("accel-train: Ctrl-C: ...\n")  # returns: the step it interrupted goes on
    assert writes == [sys.__stderr__.fileno()]
    # started without a stderr: fd 2 may be a file opened since (a checkpoint, a log), never written
    # to
    monkeypatch.setattr(sys, "__stderr__", None)
    preempt.say("accel-train: Ctrl-C: ...\n")
    monkeypatch.setattr(sys, "__stderr__", object())  # a stand-in without a file descriptor
    preempt.say("accel-train: Ctrl-C: ...\n")
    assert writes == [2]


@pytest.mark.parametrize("local_main", [True, False])
def test_after_start_up_each_machines_main_process_speaks(local_main):
    class Rank1:  # of a job on 2 machines: not the main process; its machine's own, or not
        is_main_process, is_local_main_process = False, local_main

        def set_trigger(self):
            raise AssertionError("no signal came")

        def check_trigger(self):
            return False

    stop = preempt.StopRequest()
    # start-up: the start-up check answers a first Ctrl-C
    assert (stop.notice, stop.announce) == (
        False,
        True,
    )
    stop.check_start_up(Rank1(), 0)
    assert stop.notice == stop.announce == local_main  # the terminal of each machine hears from it


def test_a_ctrl_c_during_start_up_is_answered_by_the_start_up_check_not_by_every_rank(capfd):
    stop = preempt.StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal == signal.SIGINT and "accel-train: Ctrl-C" not in capfd.readouterr().err
    finally:
        stop.uninstall()


def test_the_stop_line_says_what_accelerate_launchs_130_after_one_ctrl_c_means():
    """accelerate launch exits 128 + the signal it got (130 after a Ctrl-C) although one Ctrl-C
    wrote a checkpoint and every rank exits 4; docs/failures.md's table said 130 meant "a second
    Ctrl-C, no checkpoint".
    """
    from accel_train.resilience.preempt import launcher_status

    torchrun = {"ACCELERATE_MIXED_PRECISION": "no", "TORCHELASTIC_RUN_ID": "none"}
    said = launcher_status(signal.SIGINT, 4, torchrun)
    assert (
        said
        == " (exit status 4 on every rank; `accelerate launch` exits 130 after a Ctrl-C all the"
        " same, "
        "launch.sh 4)"
    )
    # python -m accel_train: its own 4 is the process's status
    assert launcher_status(signal.SIGINT, 4, {}) == ""
    # (a SIGTERM may have come to the rank alone)
    assert launcher_status(signal.SIGTERM, 4, torchrun) == ""
    assert launcher_status(signal.SIGINT, 3, torchrun) == ""  # a lost launcher: its own line
    docs = " ".join((ROOT / "docs" / "failures.md").read_text().split())
    row = docs[docs.index("| 130 |") : docs.index("| 137 |")]
    assert (
        "accelerate launch" in row and "checkpoint" in row and "exit status 4 on every rank" in row
    ), row


@pytest.mark.faults
def test_kill_9_of_launch_sh_ends_its_job_within_10_s_with_a_checkpoint(tmp_path):
    # kill -9 runs no handler of launch.sh's own: the kernel tells its job (the launcher's death
    # signal), whose ranks stop as on a SIGTERM, with a checkpoint of the step reached, every
    # process gone within 10 s
    out = tmp_path / "out"
    with Job(RUN, out, tmp_path / "log") as job:
        job.steps(3)
        job.pids()  # (every rank is there)
        # every process of the job but the launcher: the agent, the ranks, their DataLoader workers
        procs = processes(
            lambda p: p.pid != job.proc.pid and p.environ().get("ACCEL_TEST_TAG") == job.tag
        )
        os.kill(job.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        job.proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(procs, timeout=10)
        took = time.monotonic() - killed
        left = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not left, (left, job.text[-3000:])
    assert took < 10, took
    saved = sorted((out / "checkpoints").glob("step_*"))
    assert saved and int(saved[-1].name.split("_")[1]) >= 3, job.text[-3000:]
    assert "preempted: stopped by SIGTERM at step" in job.text, job.text[-3000:]
