"""The survivor save (accel_train/resilience/survivor.py): a lost peer costs at most the step in
flight. Real ranks killed and stopped; the pure parts in-process. (Two hosts, a machine lost with
its disk: test_multinode.py.)"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from conftest import (
    CONFIGS,
    ROOT,
    TINY,
    TINY_GN,
    Job,
    clean_env,
    run,
    run_cli,
    steps_logged,
    trainer_pids,
    wait_for,
)
from safetensors.torch import load_file

from accel_train.resilience import heartbeat, preempt, survivor

# 512 random samples, 4 per rank, --grad_accum 2: 32 optimizer steps an epoch of ~0.1 s each
# (test_resnet), 2 epochs; the kill lands inside an accumulation window with an EMA and a row per
# step
RUN = [
    *TINY,
    "--train_samples",
    "512",
    "--test_samples",
    "32",
    "--epochs",
    "2",
    "--batch_size",
    "4",
    "--grad_accum",
    "2",
    "--ema",
    "--log_every",
    "1",
]
SAVED = re.compile(r"step (\d+) saved by the survivor in (\S+) in ([\d.]+) s")


def max_diff(a, b):
    a, b = load_file(a), load_file(b)
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture
def launched_ref(references):
    """The uninterrupted run of RUN, launched as the faulted runs are (launch.sh, 2 ranks)."""
    return references.get("launch.sh", 2, RUN)


def assert_equal_to_ref(ref, out):
    """The same weights, EMA and BatchNorm statistics as the uninterrupted run; no step's row lost
    or repeated."""
    assert max_diff(ref / "model.safetensors", out / "model.safetensors") <= 1e-6
    assert max_diff(ref / "model_ema.safetensors", out / "model_ema.safetensors") <= 1e-6
    assert [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()] == list(
        range(1, 65)
    )


def fault_a_rank(tmp_path, rank: int, sig: int, *extra) -> dict:
    """RUN through launch.sh --max_restarts 1, `sig` to rank `rank` after 6 steps; what it did: the
    log's text, the steps logged before, the survivor's step and its trainer_state.json, the seconds
    from the signal to the save and to the relaunch's first new step, the ranks' pids."""
    out, log = tmp_path / "out", tmp_path / "run.log"
    # --checkpoint_every 0 (the default): the epoch end is the only checkpoint
    with Job([*RUN, *extra, "--max_restarts", "1"], out, log) as job:
        job.steps(6)
        pids = job.pids()
        logged = steps_logged(out)
        job.kill(rank, sig)
        sent = time.monotonic()
        step = int(wait_for(lambda: SAVED.search(job.text), timeout=60, interval=0.02).group(1))
        saved = time.monotonic() - sent
        # (read before the relaunch's own checkpoints rotate it away)
        state = json.loads(
            (out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text()
        )
        wait_for(
            lambda: "resumed from" in job.text and steps_logged(out) > step,
            timeout=120,
            interval=0.02,
        )
        recovered = time.monotonic() - sent
        code = job.end()
    text = job.text
    assert code == 0, text[-4000:]
    print(
        f"{signal.Signals(sig).name} to rank {rank}: saved {saved:.1f} s, first new step"
        f" {recovered:.1f} s after it"
    )
    assert text.count("relaunching to resume") == 1
    return dict(
        text=text,
        logged=logged,
        step=step,
        state=state,
        saved=saved,
        recovered=recovered,
        pids=pids,
        out=out,
    )


@pytest.mark.core
def test_a_killed_rank_costs_no_completed_step_with_grad_accum_and_ema(tmp_path, launched_ref):
    run = fault_a_rank(tmp_path, 1, signal.SIGKILL)
    text, logged, state = run["text"], run["logged"], run["state"]
    # inside torchrun's grace (it SIGKILLs the others 30 s after its SIGTERM)
    assert run["saved"] < 30, run["saved"]
    lines = [
        line for line in text.splitlines() if line.startswith("accel-train: error: lost contact")
    ]
    assert len(lines) == 1, text[-4000:]  # rank 0, the machine's lowest surviving rank, says it
    step, where, seconds = SAVED.search(lines[0]).groups()
    step = int(step)
    assert step >= logged and step < 32, (step, logged)  # every completed step, mid-epoch
    assert where.endswith(f"step_{step:08d}") and float(seconds) < 10
    # window start
    assert f"resumed from {where}: epoch 1, step {step}, {2 * step} batches into the epoch" in text
    # the collective's reset, or (rank 0 between collectives when torchrun's SIGTERM came) its
    # signal watch
    failure = state["survivor"]["failure"]
    assert state["survivor"]["rank"] == 0, state["survivor"]
    assert "Connection" in failure or f"local rank process {run['pids'][1]} is gone" in failure, (
        failure
    )
    assert_equal_to_ref(launched_ref, run["out"])


@pytest.mark.faults
def test_a_frozen_rank_is_found_by_its_heartbeat_and_the_job_runs_again_within_a_minute(
    tmp_path, launched_ref
):
    # rank 1 stopped (SIGSTOP: a stuck driver, a swapping host) with the default --timeout_s (300
    # s): rank 0 hears no heartbeat for --heartbeat_timeout_s (a test-only 4 s; 15 s by default),
    # saves the last completed step, exits 3; launch.sh SIGKILLs the stopped rank at once (not after
    # torchrun's 30-s grace) and relaunches; the relaunch's first step within 60 s. (Rank 0
    # survives, as in the kill above: a survivor other than rank 0 saves its own EMA's BatchNorm
    # statistics)
    run = fault_a_rank(
        tmp_path, 1, signal.SIGSTOP, "--heartbeat_s", "0.5", "--heartbeat_timeout_s", "4"
    )
    text = run["text"]
    assert 3.5 <= run["saved"] < 15 and run["recovered"] < 60, (
        run["saved"],
        run["recovered"],
        text[-4000:],
    )
    line = next(
        line for line in text.splitlines() if line.startswith("accel-train: error: lost contact")
    )
    assert "rank 1 on " in line and re.search(r"sent no heartbeat for \d+ s", line), line
    assert run["state"]["survivor"]["rank"] == 0 and run["step"] >= run["logged"] - 1
    assert f"process(es) {run['pids'][1]} of this attempt are stopped (state T)" in text, text[
        -4000:
    ]
    assert_equal_to_ref(launched_ref, run["out"])


# test only: rank ACCEL_TEST_SLOW_RANK sleeps ACCEL_TEST_SLOW_S seconds before its backward number
# ACCEL_TEST_SLOW_AT (a long step, a first compile): its peer waits in that step's all-reduce
# meanwhile
SLOW_STEP_HOOK = """\
import os
if os.environ.get("ACCEL_TEST_SLOW_RANK") in (os.environ.get("RANK"), "*"):
    import time
    import accelerate
    _backward, _calls = accelerate.Accelerator.backward, []

    def _slow(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == int(os.environ["ACCEL_TEST_SLOW_AT"]):
            time.sleep(float(os.environ["ACCEL_TEST_SLOW_S"]))
        return _backward(self, *args, **kwargs)
    accelerate.Accelerator.backward = _slow
"""


@pytest.mark.faults
def test_a_rank_slow_in_one_step_past_the_heartbeat_timeout_is_no_lost_peer(tmp_path, launched_ref):
    # its heartbeat goes on from its own thread (tests/test_heartbeat.py: while the main thread is
    # blocked in a C call): no alarm, the run ends equal to the uninterrupted one. Test-only
    # timings: a 12-s step is 3x the 4-s heartbeat timeout and past the 6-s hang report (the
    # defaults, 15 s and 30 s, change neither behaviour)
    out, hooks = tmp_path / "out", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_STEP_HOOK)
    env = clean_env(
        NPROC_PER_NODE="2",
        ACCEL_TEST_SLOW_RANK="1",
        ACCEL_TEST_SLOW_AT="21",
        ACCEL_TEST_SLOW_S="12",
        PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    start = time.monotonic()
    timings = ["--heartbeat_s", "0.5", "--heartbeat_timeout_s", "4", "--hang_report_s", "6"]
    proc = run(["bash", ROOT / "launch.sh", *RUN, *timings, "--output_dir", out], 400, env, ROOT)
    assert proc.returncode == 0 and "lost contact" not in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start > 12  # (the hook slept)
    assert_equal_to_ref(launched_ref, out)
    # the stall is reported once, with both ranks' places; nothing was stopped
    text = proc.stderr
    reported = re.findall(r"rank (\d) has made no progress for (\d+) s", text)
    assert len(reported) == 1 and 6 <= int(reported[0][1]) <= 11, (reported, text[-6000:])
    print(
        f"measured (docs/failures.md): 2 ranks, a report {reported[0][1]} s after rank 1's last"
        " step (--hang_report_s 6)"
    )
    block = text[text.index("has made no progress") :]
    assert re.search(
        r"rank 1 \(.*training, step 10, \d+ s since; training thread in _slow", block
    ), block[:3000]
    assert re.search(
        r"rank 0 \(.*training thread in .*backward \(DDP's gradient all-reduce\)", block
    ), block[:3000]
    # rank 1's stack, its line
    assert "in _slow" in block and "time.sleep(float(os.environ" in block
    assert "nothing is stopped" in block


@pytest.mark.faults
def test_stop_on_hang_never_stops_a_slow_first_step_of_every_rank(tmp_path):
    # both ranks spend 12 s in their first step (a compile, a first large batch, a slow first read),
    # past a 4-s hang report: it is printed, says its bound, and stops nothing; the run finishes
    out, hooks = tmp_path / "out", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(SLOW_STEP_HOOK)
    env = clean_env(
        ACCEL_TEST_SLOW_RANK="*",
        ACCEL_TEST_SLOW_AT="1",
        ACCEL_TEST_SLOW_S="12",
        PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        CONFIGS / "2proc_cpu.yaml",
        "-m",
        "accel_train",
        *TINY,
        "--train_samples",
        "64",
        "--test_samples",
        "16",
        "--epochs",
        "1",
        "--batch_size",
        "8",
        "--hang_report_s",
        "4",
        "--stop_on_hang",
        "--heartbeat_s",
        "0.5",
        "--heartbeat_timeout_s",
        "30",
        "--output_dir",
        out,
    ]
    proc = run(list(map(str, cmd)), 300, env, ROOT)
    assert proc.returncode == 0 and (out / "model.safetensors").is_file(), proc.stderr[-4000:]
    text = proc.stderr
    assert "has made no progress" in text and "ends the run" not in text, text[-4000:]
    assert "(bound: --hang_report_s 4: before the first step no step time is known)" in text, text[
        -4000:
    ]
    assert "nothing is stopped (--stop_on_hang waits for the first step" in text, text[-4000:]
    block = text[text.index("has made no progress") :]
    # (each rank its own)
    assert re.search(r"rank 0 \(", block) and re.search(r"rank 1 \(", block), block[:3000]


# test only: rank 0 SIGKILLs itself inside its ACCEL_TEST_KILL_AT-th accelerate save_state (a
# checkpoint being written), once per ACCEL_TEST_KILL_MARK (the relaunch, same environment, spared)
KILL_IN_SAVE_HOOK = """\
import os
if os.environ.get("RANK") == "0" and not os.path.exists(os.environ["ACCEL_TEST_KILL_MARK"]):
    import signal
    import accelerate
    _save_state, _calls = accelerate.Accelerator.save_state, []

    def _killed(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == int(os.environ["ACCEL_TEST_KILL_AT"]):
            open(os.environ["ACCEL_TEST_KILL_MARK"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return _save_state(self, *args, **kwargs)
    accelerate.Accelerator.save_state = _killed
"""


@pytest.mark.faults
def test_rank_0_killed_during_a_checkpoint_write_resumes_with_its_batchnorm_statistics(
    tmp_path, launched_ref
):
    # rank 1 survives a kill of rank 0 inside the checkpoint of step 40 (mid-epoch: no evaluation's
    # broadcast since step 32's). The checkpoint's write begins with rank 0's buffers broadcast, so
    # the survivor saves rank 0's statistics, not its own: the relaunch ends equal to the
    # uninterrupted run, BatchNorm buffers and the EMA's included (before: 40 buffers differed)
    out, hooks = tmp_path / "out", tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(KILL_IN_SAVE_HOOK)
    env = clean_env(
        NPROC_PER_NODE="2",
        ACCEL_RESTART_DELAY="1",
        ACCEL_TEST_KILL_AT="3",
        ACCEL_TEST_KILL_MARK=str(tmp_path / "killed"),
        PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    # save_state's calls: step 20, the end of epoch 1 (step 32), step 40
    cmd = [
        "bash",
        ROOT / "launch.sh",
        *RUN,
        "--checkpoint_every",
        "20",
        "--output_dir",
        out,
        "--max_restarts",
        "1",
    ]
    proc = run(cmd, 400, env, ROOT)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and (tmp_path / "killed").exists(), text[-4000:]
    assert "step 40 saved by the survivor" in text, text[-4000:]
    assert text.count("relaunching to resume") == 1, text[-4000:]
    assert "resumed from" in text and "step 40, 16 batches into the epoch" in text, text[-4000:]
    buffers = [k for k in load_file(out / "model.safetensors") if "running_" in k]
    assert buffers
    assert max_diff(launched_ref / "model.safetensors", out / "model.safetensors") <= 1e-6
    assert max_diff(launched_ref / "model_ema.safetensors", out / "model_ema.safetensors") <= 1e-6
    steps = [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 65))


@pytest.mark.faults
def test_sigterm_while_a_peer_is_stopped_saves_at_once_not_at_an_agreed_check(tmp_path):
    # rank 0 frozen (SIGSTOP), then SIGTERM to rank 1 (torchrun's agent, or a platform stopping what
    # is left): rank 1 is blocked in a collective and never reaches an agreed check; its signal
    # watch sees the stopped peer. Rank 1, the lowest rank of the machine still answering, saves;
    # its BatchNorm statistics are rank 0's where the window in flight had begun (DDP's broadcast,
    # kept there), else its own (docs/failures.md: What a failure costs)
    out, tag = tmp_path / "out", uuid.uuid4().hex
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        CONFIGS / "2proc_cpu.yaml",
        "-m",
        "accel_train",
        *RUN,
        "--epochs",
        "1",
        "--timeout_s",
        "120",
        "--output_dir",
        out,
    ]
    log = tmp_path / "run.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            list(map(str, cmd)),
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
            env=clean_env(ACCEL_TEST_TAG=tag),
        )
    try:
        wait_for(lambda: steps_logged(out) >= 4, timeout=240, interval=0.01)
        pids = wait_for(lambda: len(trainer_pids(tag)) == 2 and trainer_pids(tag), timeout=30)
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(0.5)
        logged = steps_logged(out)
        sent = time.monotonic()
        os.kill(pids[1], signal.SIGTERM)
        wait_for(lambda: SAVED.search(log.read_text()), timeout=60, interval=0.02)
        took = time.monotonic() - sent
    finally:
        for pid in trainer_pids(tag).values():
            # (torchrun starts each rank in a session of its own)
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    text = log.read_text()
    # not the collective's --timeout_s (120 s), not torchrun's 30 s
    assert took < 10, (
        took,
        text[-3000:],
    )
    line = next(line for line in text.splitlines() if "lost contact" in line)
    assert f"local rank process {pids[0]} is gone" in line, line
    step = int(SAVED.search(line).group(1))
    assert step >= logged - 1, (step, logged)
    state = json.loads(
        (out / "checkpoints" / f"step_{step:08d}" / "trainer_state.json").read_text()
    )
    assert state["survivor"]["failure"].startswith("SIGTERM while local rank process"), state[
        "survivor"
    ]
    assert state["survivor"]["rank"] == 1, state["survivor"]
    assert state["survivor"]["buffers_of"] in ("rank 0", "rank 1 (its own)"), state["survivor"]
    assert state["batch_in_epoch"] == 2 * step and state["ema"]


def test_state_to_host_is_a_contiguous_copy():
    weight = torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)
    state = {"w": weight, "groups": [{"lr": 0.1, "params": [0]}], "n": torch.tensor(3)}
    copied = survivor.state_to_host(state)
    assert copied["w"].is_contiguous() and torch.equal(copied["w"], weight)
    weight.add_(1)  # the copy is the state at the time of the call
    assert not torch.equal(copied["w"], weight) and copied["groups"] == [{"lr": 0.1, "params": [0]}]


def test_a_stopped_or_dead_peer_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert heartbeat.alive(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        wait_for(lambda: not heartbeat.alive(child.pid), timeout=10)
        os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert not heartbeat.alive(child.pid)  # a zombie until reaped
    finally:
        child.kill()
        child.wait()
    assert not heartbeat.alive(child.pid)


def test_a_peer_that_is_exiting_is_not_alive():
    # a SIGKILLed rank 0 closes its sockets (do_exit) before it is a zombie: rank 1 saw the reset
    # while rank 0's stat still read "R", took it for the lower rank that saves, and no rank saved
    # (a 2-rank run, rank 0 killed)
    stat = "4242 (python -m x) R 1 4242 4242 0 -1 {} 5 0 0 0"
    assert heartbeat.answers(stat.format(0x400000)) and heartbeat.answers(stat.format(0x400040))
    assert not heartbeat.answers(stat.format(0x400044))  # PF_EXITING
    assert not heartbeat.answers(stat.format(0x400000).replace(" R ", " Z "))


def test_the_time_interval_keeps_writes_at_one_percent():
    assert preempt.checkpoint_interval_s(None, None) == preempt.FIRST_CHECKPOINT_S
    # a fast write: at least a minute
    assert preempt.checkpoint_interval_s(None, 0.2) == preempt.MIN_CHECKPOINT_S
    assert preempt.checkpoint_interval_s(None, 9.0) == pytest.approx(900.0)  # 100x the write
    assert preempt.checkpoint_interval_s(2.5, 9.0) == 150.0 and preempt.checkpoint_interval_s(
        0, 1.0
    ) == float("inf")
    assert "100x the measured write" in preempt.checkpoint_interval_text(None)


# ---------------------------------------------------------------------------------------------
# Where a peer can be lost: a lost-peer error raised in-process at each place a
# step can be, on one process (the same loop and save; group norm: no BatchNorm statistics). The
# save must be exactly the reference's checkpoint of the step it names, or nothing.
# ---------------------------------------------------------------------------------------------

ONE = [
    *TINY_GN,
    "--train_samples",
    "64",
    "--test_samples",
    "8",
    "--epochs",
    "1",
    "--batch_size",
    "4",
    "--grad_accum",
    "2",
    "--ema",
    "--log_every",
    "1",
]
LOST = (
    "[/w/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    " [10.1.2.3]:41000"
)


@pytest.fixture(scope="module")
def every_step(tmp_path_factory):
    out = tmp_path_factory.mktemp("every_step")
    assert (
        run_cli(
            [*ONE, "--checkpoint_every", "1", "--keep_checkpoints", "20", "--output_dir", out]
        ).returncode
        == 0
    )
    return out


def lose_peer_at(monkeypatch, target, name, when):
    """`target.name` raises a lost-peer error on the call for which when(*args) is true."""
    real = getattr(target, name)

    def failing(*args, **kwargs):
        if when(*args):
            raise RuntimeError(LOST)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, failing)


def micro_batches():
    count = [0]

    def nth(*args):
        count[0] += 1
        return count[0] == 6  # the second micro-batch of step 3's window

    return nth


@pytest.mark.parametrize(
    "where,step,batch",
    [
        ("the step's all-reduce", 2, 4),
        ("logging a step", 5, 10),
        ("an agreed check", None, None),
        ("writing a checkpoint", 4, 8),
        ("evaluating", 8, 16),
    ],
)
def test_a_lost_peer_anywhere_saves_exactly_the_last_completed_step(
    tmp_path, monkeypatch, every_step, where, step, batch
):
    from accelerate import Accelerator

    from accel_train.checkpoint import checkpointer as checkpoint
    from accel_train.training import loop, metrics

    out = tmp_path / "out"
    if where == "the step's all-reduce":
        lose_peer_at(monkeypatch, Accelerator, "backward", micro_batches())
    elif where == "logging a step":
        lose_peer_at(monkeypatch, metrics.MetricsLog, "log_step", lambda self, acc, s, *a: s == 5)
    elif where == "an agreed check":
        lose_peer_at(monkeypatch, preempt.AgreedChecks, "agree", lambda *a: True)
    elif where == "writing a checkpoint":
        # its second agree: accelerate's files are in its .tmp- folder
        calls = iter(range(99))
        lose_peer_at(monkeypatch, checkpoint, "_agree", lambda *a: next(calls) == 1)
    else:
        lose_peer_at(monkeypatch, loop, "evaluate", lambda *a: True)
    monkeypatch.setattr(survivor.os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    extra = ["--checkpoint_every", "4"] if where == "writing a checkpoint" else []
    proc = run_cli([*ONE, *extra, "--output_dir", out])
    assert proc.returncode == 3, proc.stderr[-3000:]
    found = SAVED.search(proc.stderr)
    assert found, proc.stderr[-2000:]
    saved = Path(found.group(2))
    state = json.loads((saved / "trainer_state.json").read_text())
    step = step or state["step"]
    ref = every_step / "checkpoints" / f"step_{step:08d}"
    expected = json.loads((ref / "trainer_state.json").read_text())
    assert (state["step"], state["batch_in_epoch"]) == (
        step,
        batch or expected["batch_in_epoch"],
    ), state
    # (the epoch's evaluation is redone on resume)
    epoch = 0 if where == "evaluating" else expected["epoch"]
    assert (state["epoch"], state["run_id"] != expected["run_id"]) == (epoch, True)
    assert (
        state["survivor"]["failure"].startswith("[/w/third_party/gloo")
        and state["survivor"]["rank"] == 0
    )
    # the files save_state and the checkpointer write, by their names (no random state: a function
    # of the step)
    assert {p.name for p in ref.iterdir() if not p.name.startswith("random_states")} <= {
        p.name for p in saved.iterdir()
    }
    for name in ("model.safetensors", "ema.safetensors"):
        assert max_diff(ref / name, saved / name) == 0, name
    a, b = torch.load(ref / "optimizer.bin"), torch.load(saved / "optimizer.bin")
    assert all(
        torch.equal(a["state"][i]["momentum_buffer"], b["state"][i]["momentum_buffer"])
        for i in a["state"]
    )
    rows = [json.loads(r) for r in (saved / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    # its reduce never completed: this rank's loss
    assert ("loss_of" in rows[-1]) == (where == "logging a step")
    # (before: the checkpoint's own partial copy was left)
    assert not list(saved.parent.glob(".tmp-*"))


def test_survivors_that_saved_different_steps_resume_from_the_newest():
    # a ring all-reduce can complete on some ranks and not others: machine 1's survivor saved one
    # step more
    from accel_train.checkpoint.resume import _choose

    reports = [{"listing": [(16, "run"), (21, "run")]}, {"listing": [(16, "run"), (22, "run")]}]
    assert _choose("auto", False, reports) == ((22, "run"), {"run"})


def test_the_signal_watch_saves_when_no_agreed_stop_comes_and_stands_down_when_one_does(
    monkeypatch,
):
    # a platform's SIGTERM to the remaining machines of a job whose peer hangs elsewhere: no local
    # peer is gone, the ranks never agree on the stop and no step completes; the watch saves after
    # GRACE_S / 2 (torchrun's grace: 30 s)
    import types

    watch = object.__new__(survivor.Survivor)
    watch.local, watch.owner, watch.cfg = [], None, types.SimpleNamespace(output_dir=None)
    # (an agreed check measured)
    watch.stop = types.SimpleNamespace(agreed=False, signal=signal.SIGTERM, step_s=0.1)
    # no step completes: stalled
    watch.run = types.SimpleNamespace(state=types.SimpleNamespace(step=7))
    saved, exits = [], []

    def save(failure, in_main=False):
        saved.append(failure)
        watch.owner = "watch"
        return "step 7 saved by the survivor in out/checkpoints/step_00000007 in 0.1 s"

    def exit_(code):
        exits.append(code)
        raise SystemExit(code)

    watch.save = save
    monkeypatch.setattr(survivor, "GRACE_S", 1.0)
    monkeypatch.setattr(survivor, "LATE_S", 0.2)  # (stalled at 0.5 s, late at 0.8 s)
    monkeypatch.setattr(survivor.os, "_exit", exit_)
    # (exits.peer_gone says and exits)
    monkeypatch.setattr("accel_train.exits.report_status", lambda code: None)
    read, write = os.pipe()
    # (other signals' bytes are passed over)
    os.write(write, bytes([signal.SIGCHLD, signal.SIGTERM]))
    start = time.monotonic()
    with pytest.raises(SystemExit):
        watch._on_signal(read)
    assert exits == [3] and 0.5 <= time.monotonic() - start < 3
    assert len(saved) == 1 and saved[0].startswith("SIGTERM while no step and no agreed stop"), (
        saved
    )
    assert "does not answer" in saved[0]
    # steps still completing (every peer answers): no save until late in torchrun's grace
    ticking = threading.Event()

    def tick():
        while not ticking.is_set():
            watch.run.state.step += 1
            time.sleep(0.05)

    ticker = threading.Thread(target=tick)
    ticker.start()
    os.write(write, bytes([signal.SIGTERM]))
    start = time.monotonic()
    try:
        with pytest.raises(SystemExit):
            watch._on_signal(read)
    finally:
        ticking.set()
        ticker.join()
    assert time.monotonic() - start >= 0.7 and saved[1].startswith(
        "SIGTERM while no agreed stop"
    ), saved
    # a step slower than GRACE_S / 2 with every peer alive (a big batch), or one not measured yet
    # (the first step may compile): the agreed stop after it can still come; only `late` saves.
    # Before: saved at GRACE_S / 2, exit 3
    for step_s in (0.6, None):
        watch.stop.step_s = step_s
        os.write(write, bytes([signal.SIGTERM]))
        start = time.monotonic()
        with pytest.raises(SystemExit):
            watch._on_signal(read)
        assert time.monotonic() - start >= 0.75 and saved[-1].startswith(
            "SIGTERM while no agreed stop"
        ), saved
    watch.stop.agreed = (
        True  # the ranks agreed (AgreedChecks): every peer answered, the agreed checkpoint follows
    )
    os.write(write, bytes([signal.SIGTERM]))
    watch._on_signal(read)
    assert exits == [3] * 4 and len(saved) == 4
    # the training ended (guard closed): an armed watch stands down
    watch.stop.agreed, watch.closed = (
        False,
        True,
    )
    # (before: it saved 'late' and exited 3 after a finished run)
    os.write(write, bytes([signal.SIGTERM]))
    watch._on_signal(read)
    assert exits == [3] * 4 and len(saved) == 4
    os.close(read)
    os.close(write)


def test_the_module_is_handed_back_without_the_buffer_hook():
    # a module given to train() on 2 ranks kept the survivor's forward pre-hook (and its lock):
    # copy.deepcopy or torch.save of it after train() raised "cannot pickle '_thread.lock' object"
    import copy

    saver = object.__new__(survivor.Survivor)
    saver.lock, saver.watcher, module = threading.Lock(), None, torch.nn.BatchNorm1d(3)
    saver.hook = module.register_forward_pre_hook(saver._window_start)
    saver.close()
    assert not module._forward_pre_hooks and copy.deepcopy(module) is not None


def _wakeup_fd_in_child(queue):
    queue.put((signal.set_wakeup_fd(-1), [fd for fd in survivor.WATCHED]))


def test_a_forked_child_does_not_signal_into_the_watch(monkeypatch):
    # a DataLoader worker (forked) inherits the wakeup fd: its own SIGTERM (the DataLoader ending a
    # slow worker) armed the trainer's watch, which saved and exited 3 25 s later in a healthy
    # 2-rank run (--num_workers 1)
    import multiprocessing
    import types

    watch = object.__new__(survivor.Survivor)
    watch.stop, watch.local = types.SimpleNamespace(agreed=True, signal=None), []
    watch.watcher = watch._watch_signals()
    try:
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_wakeup_fd_in_child, args=(queue,))
        child.start()
        assert queue.get(timeout=30) == (-1, [])
        child.join(timeout=30)
    finally:
        watch.close()


def test_on_an_accelerator_the_survivor_saves_nothing_and_says_why(tmp_path):
    # docs/failures.md: on CUDA/NPU the host runs ahead of the device and the backend's abort lets
    # the queued updates run on a partly reduced gradient; a save would be a checkpoint of no step.
    # Before: it was written as step 5.
    import types

    # gloo: the collective runs in the calling thread
    assert survivor.readable_step(torch.device("cpu")) is None
    for kind in ("cuda", "npu"):
        assert survivor.readable_step(types.SimpleNamespace(type=kind)).startswith(
            f"nothing saved: on {kind}"
        )
    saver = object.__new__(survivor.Survivor)
    saver.run = types.SimpleNamespace(
        state=survivor.TrainState(step=5),
        accelerator=types.SimpleNamespace(
            device=torch.device("cuda"), gradient_accumulation_steps=1, process_index=0
        ),
    )
    saver.first_step, saver.lower, saver.cfg = 0, [], types.SimpleNamespace(output_dir=tmp_path)
    assert saver._save("ncclRemoteError").startswith("nothing saved: on cuda")
    assert list(tmp_path.iterdir()) == []


def test_the_signal_watch_does_not_save_beside_a_checkpoint_being_written(monkeypatch):
    """A SIGTERM during a checkpoint write longer than the watch's wait must not make it save the
    same step beside the writer, remove the writer's .tmp-step_N and exit 3 instead of the agreed
    stop's 4. While the checkpoint is written the watch waits; the agreed stop
    after it stands the watch down."""
    import types

    watch = object.__new__(survivor.Survivor)
    watch.local, watch.owner = [], None
    watch.stop = types.SimpleNamespace(agreed=False, signal=signal.SIGTERM, step_s=0.1)
    watch.run = types.SimpleNamespace(state=types.SimpleNamespace(step=7))
    watch.checkpointer = types.SimpleNamespace(writing=True)
    watch.cfg = types.SimpleNamespace(output_dir="out")
    saved = []
    watch.save = lambda failure, in_main=False: saved.append(failure) or "saved"
    monkeypatch.setattr(survivor, "GRACE_S", 1.0)
    # (stalled at 0.5 s, late at 0.8 s, without the write)
    monkeypatch.setattr(survivor, "LATE_S", 0.2)
    exits = []

    def peer_gone(*a, **k):
        exits.append(a)
        raise SystemExit(3)

    monkeypatch.setattr(survivor, "peer_gone", peer_gone)

    def write_then_agree():
        time.sleep(1.5)  # past both
        watch.checkpointer.writing = False
        watch.stop.agreed = True  # the agreed check after the write: every peer answered

    writer = threading.Thread(target=write_then_agree)
    writer.start()
    read, write = os.pipe()
    os.write(write, bytes([signal.SIGTERM]))
    try:
        watch._on_signal(read)
        assert saved == [] and exits == []
        # the control: the same signal without a write in progress saves (late) and exits
        watch.stop.agreed, watch.owner = False, "watch"
        os.write(write, bytes([signal.SIGTERM]))
        with pytest.raises(SystemExit):
            watch._on_signal(read)
        assert len(saved) == 1 and len(exits) == 1
    finally:
        writer.join()
        os.close(read)
        os.close(write)
    # and the flag the watch reads is the one a real save sets while it writes
    from accel_train.checkpoint.checkpointer import Checkpointer

    seen = []
    ckpt = object.__new__(Checkpointer)
    ckpt.accelerator, ckpt.output_dir, ckpt.run_math, ckpt.model, ckpt.ema, ckpt.keep = (
        None,
        None,
        {},
        None,
        None,
        2,
    )
    ckpt.facts, ckpt.history, ckpt.writing, ckpt.meter, ckpt.buffers_shared = (
        None,
        dict,
        False,
        None,
        None,
    )
    ckpt.decision = types.SimpleNamespace(writer=True, shared=True)
    ckpt.watch = types.SimpleNamespace(check=lambda *a: None)
    monkeypatch.setattr(
        "accel_train.checkpoint.checkpointer.save_checkpoint",
        lambda *a, **k: seen.append(ckpt.writing) or "p",
    )
    assert (
        ckpt.save(types.SimpleNamespace(step=3)) == "p" and seen == [True] and ckpt.writing is False
    )


def test_a_step_is_updated_under_the_lock_and_a_failure_inside_leaves_it_held(monkeypatch):
    # Survivor.updating: the lock only around a micro-batch that ends a step, released as the step
    # is whole; a failure inside keeps it, so the save in the main thread knows the state is half
    # updated
    import types

    monkeypatch.setattr(survivor, "gather_object", lambda mine: mine + [("elsewhere", 1, 0)])
    monkeypatch.setattr(survivor.Survivor, "_watch_signals", lambda self: None)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    acc = types.SimpleNamespace(
        num_processes=2,
        local_process_index=0,
        device=torch.device("cpu"),
        _models=[module],
        gradient_accumulation_steps=1,
    )
    run = types.SimpleNamespace(accelerator=acc, state=survivor.TrainState(), model=module)
    saver = survivor.Survivor(
        run, types.SimpleNamespace(heartbeat_timeout_s=0, output_dir="x"), None, None, None
    )
    try:
        with saver.updating(False):
            assert not saver.lock.locked()  # (inside a window: nothing of a step changes)
        with saver.updating(True):
            assert saver.lock.locked()
            run.state.step = 7
        assert not saver.lock.locked()
        saver.hooked = False  # compiled: the step's own buffers are kept as the step ends
        with saver.updating(True):
            run.state.step = 8
        assert (saver.kept_step, saver.kept_own, saver.lock.locked()) == (8, True, False)
        with pytest.raises(RuntimeError):
            with saver.updating(True):
                raise RuntimeError("a bug in the update")
        assert saver.lock.locked()
        assert saver.save("a peer is gone", in_main=True).startswith(
            "nothing saved: the failure came"
        )
    finally:
        saver.close()


def test_on_an_accelerator_no_buffers_are_kept_for_a_save_that_cannot_happen(monkeypatch):
    # on CUDA/NPU the survivor saves nothing (readable_step), so on 2+ ranks it neither hooks the
    # module nor copies its BatchNorm buffers on the device at every accumulation window's start
    import types

    # a second rank
    monkeypatch.setattr(survivor, "gather_object", lambda mine: mine + [("elsewhere", 1, 0)])
    monkeypatch.setattr(survivor.Survivor, "_watch_signals", lambda self: None)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4))
    for device, keeps in (("cpu", True), ("cuda", False)):
        acc = types.SimpleNamespace(
            num_processes=2,
            local_process_index=0,
            device=torch.device(device),
            _models=[module],
            gradient_accumulation_steps=1,
        )
        run = types.SimpleNamespace(accelerator=acc, state=survivor.TrainState(), model=module)
        saver = survivor.Survivor(
            run, types.SimpleNamespace(heartbeat_timeout_s=0), None, None, None
        )
        try:
            assert (
                bool(saver.buffers),
                saver.hook is not None,
                bool(module._forward_pre_hooks),
            ) == (keeps,) * 3
            with saver.updating(True):
                pass  # (the step's end copies nothing either)
            assert saver.kept_step == -1
        finally:
            saver.close()
