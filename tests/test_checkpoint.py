"""Checkpoints and exact resume, through real `accelerate launch` runs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, TINY, clean_env, launch, reference_args, run_cli, steps_logged, wait_for
from safetensors.torch import load_file

CONFIG = {1: "cpu.yaml", 2: "2proc_cpu.yaml"}


def small_run(out, *extra):
    # 256 random samples, global batch 32: 8 optimizer steps per epoch on 1 rank and on 2 ranks
    return [
        *TINY,
        "--train_samples",
        "256",
        "--test_samples",
        "40",
        "--epochs",
        "3",
        "--output_dir",
        out,
        "--log_every",
        "1",
        *extra,
    ]


def state_dir(out, step):
    return out / "checkpoints" / f"step_{step:08d}"


def weights(out):
    return load_file(out / "model.safetensors")


def assert_same_weights(a, b, atol):
    assert a.keys() == b.keys()
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= atol, f"max weight difference {worst}"


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.core)])
def test_resume_mid_epoch_ends_with_the_uninterrupted_weights(
    tmp_path, ranks, one_process_reference, two_rank_reference
):
    # stopped after step 3 of epoch 2 (global step 8 + 3), then resumed in a new launch
    full, stopped = {1: one_process_reference, 2: two_rank_reference}[ranks]
    part = tmp_path / "part"
    shutil.copytree(stopped, part)
    state = json.loads(state_dir(part, 11).joinpath("trainer_state.json").read_text())
    # 3 steps into epoch 2: 3 batches on each rank (a rank's batch is 32 / ranks), saved by `ranks`
    # processes
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (1, 11, 3)
    assert sorted(p.name for p in state_dir(part, 11).glob("random_states_*")) == [
        f"random_states_{r}.pkl" for r in range(ranks)
    ]
    proc = launch(CONFIG[ranks], reference_args(ranks, part, "--resume", "auto"))
    assert (
        "resumed from" in proc.stderr + proc.stdout
        and "step 11, 3 batches into the epoch" in proc.stderr
    )
    assert_same_weights(weights(full), weights(part), atol=1e-6)
    rows_full = [json.loads(r) for r in (full / "metrics.jsonl").read_text().splitlines()]
    rows_part = [json.loads(r) for r in (part / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows_part] == [1, 2, 3] and rows_part[-1]["step"] == rows_full[-1][
        "step"
    ] == 24
    assert rows_part[-1]["test_acc"] == rows_full[-1]["test_acc"]
    assert_same_train_rows(rows_full, rows_part)
    steps_full = [json.loads(r) for r in (full / "steps.jsonl").read_text().splitlines()]
    steps_part = [json.loads(r) for r in (part / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps_part] == list(range(1, 25))
    for a, b in zip(steps_full, steps_part):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["lr"] == b["lr"]


def assert_same_train_rows(rows_full, rows_part):
    """Every epoch's training numbers are the uninterrupted run's, the interrupted epoch's too (its
    checkpoint kept the sums of the batches before the stop; they covered 5 of its 8 steps only)."""
    train = ("train_loss", "train_acc", "train_samples")
    assert len(rows_full) == len(rows_part)
    for a, b in zip(rows_full, rows_part):
        assert {k: b[k] for k in train} == pytest.approx({k: a[k] for k in train}, abs=1e-6), (a, b)
        assert "train_partial" not in b and b["epoch_seconds"] > 0


def test_checkpoints_are_complete_and_only_the_newest_k_are_kept(tmp_path):
    out = tmp_path / "out"
    launch(
        "cpu.yaml",
        small_run(
            out,
            "--batch_size",
            "32",
            "--checkpoint_every",
            "3",
            "--keep_checkpoints",
            "3",
            "--epochs",
            "2",
        ),
    )
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    # every 3 steps + the epoch ends (8, 16)
    assert ckpts == [
        "step_00000012",
        "step_00000015",
        "step_00000016",
    ]
    newest = out / "checkpoints" / "step_00000016"
    names = {p.name for p in newest.iterdir()}
    assert {
        "model.safetensors",
        "optimizer.bin",
        "random_states_0.pkl",
        "trainer_state.json",
    } <= names
    state = json.loads((newest / "trainer_state.json").read_text())
    assert (state["epoch"], state["step"], state["batch_in_epoch"]) == (2, 16, 0)
    assert (
        state["run"]["epochs"] == 2
        and state["run"]["global_batch"] == 32
        and state["run"]["train_size"] == 256
    )
    # the checkpoint's model is the exported model
    exported, saved = weights(out), load_file(newest / "model.safetensors")
    assert all(torch.equal(exported[k], saved[k]) for k in exported)


FOUR_STEPS = ["--batch_size", "32", "--epochs", "1", "--max_steps", "4"]


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """One 4-step run on 1 process, read-only: the first of test_same_seed_same_run's two equal
    runs, and the checkpoint test_resume_errors_are_one_line corrupts (in its own copy)."""
    out = tmp_path_factory.mktemp("four_steps") / "out"
    launch("cpu.yaml", small_run(out, *FOUR_STEPS))
    return out


def test_same_seed_same_run(tmp_path, four_steps):
    a, b = four_steps, tmp_path / "b"
    launch("cpu.yaml", small_run(b, *FOUR_STEPS))
    assert_same_weights(weights(a), weights(b), atol=0)
    c = tmp_path / "c"
    launch(
        "cpu.yaml",
        small_run(c, "--batch_size", "32", "--epochs", "1", "--max_steps", "4", "--seed", "7"),
    )
    assert not torch.equal(weights(a)["fc.weight"], weights(c)["fc.weight"])


def test_resume_errors_are_one_line(tmp_path, four_steps):
    # a --resume path that is no checkpoint: test_bad_input.py's "resume_missing" case (exit 2, one
    # line)
    out = tmp_path / "out"
    shutil.copytree(four_steps, out)
    ckpt = next((out / "checkpoints").glob("step_*"))
    model_file = ckpt / "model.safetensors"
    # (garbage of its size: shorter is incomplete)
    model_file.write_bytes(b"\0" * model_file.stat().st_size)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    # the seal's digest finds it first; without digests (an older accel_train's checkpoint) the load
    # does
    for says in ("model.safetensors is not the file sealed at step", "is corrupt or incompatible"):
        proc = run_cli(small_run(out, "--batch_size", "32", "--resume", ckpt))
        assert proc.returncode == 2, proc.stderr[-2000:]
        # (the tmp path: "errors")
        lines = [line for line in proc.stderr.splitlines() if "error:" in line.lower()]
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in proc.stderr, lines
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
        state = json.loads((ckpt / "trainer_state.json").read_text())
        state.pop("digests", None)
        (ckpt / "trainer_state.json").write_text(json.dumps(state))


FLUSH_HOOK = """\
# test only: the trainer's TensorBoard writer flushes every 0.2 s (default 120 s), so that steps
# logged after the checkpoint are on disk when the process is killed, as they are after a long run
if b"accel_train" in open("/proc/self/cmdline", "rb").read():
    from torch.utils.tensorboard import writer as _writer
    _init = _writer.SummaryWriter.__init__
    def _fast(self, *args, **kwargs):
        kwargs["flush_secs"] = 0.2
        _init(self, *args, **kwargs)
    _writer.SummaryWriter.__init__ = _fast
"""


@pytest.mark.faults
def test_tensorboard_steps_stay_increasing_after_a_kill_and_resume_auto(tmp_path):
    # steps.jsonl is cut back to the checkpoint on resume; the event files were not (no purge_step),
    # so TensorBoard drew ...12, 13, 14, 11, 12, 13... for step/train_loss
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    hooks, out = tmp_path / "hooks", tmp_path / "out"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(FLUSH_HOOK)
    # resnet18: steps take time
    args = [
        "--train_samples",
        "400",
        "--test_samples",
        "16",
        "--batch_size",
        "16",
        "--epochs",
        "1",
        "--log_every",
        "1",
        "--checkpoint_every",
        "10",
        "--log_with",
        "tensorboard",
        "--output_dir",
        out,
    ]
    env = clean_env(
        PYTHONPATH=os.pathsep.join([str(hooks), *filter(None, [os.environ.get("PYTHONPATH")])])
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "accel_train", *map(str, args)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    try:
        # checkpoint step 10 written, 3 steps on
        wait_for(lambda: steps_logged(out) >= 13, timeout=240)
        time.sleep(0.5)  # (the writer's flush)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    logged = [json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()]
    assert 13 <= logged[-1] < 20 and state_dir(out, 10).is_dir(), logged
    run_cli([*args, "--resume", "auto"], timeout=300)
    acc = EventAccumulator(str(out / "accel_train"), size_guidance={SCALARS: 0})  # (0: every event)
    acc.Reload()
    steps = {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    # as steps.jsonl
    assert steps["step/train_loss"] == steps["step/lr"] == list(range(1, 26)), steps
    assert [
        json.loads(line)["step"] for line in (out / "steps.jsonl").read_text().splitlines()
    ] == list(range(1, 26))
    for tag, seen in steps.items():
        assert seen == sorted(set(seen)), (tag, seen)  # strictly increasing, no duplicates
    assert steps["epoch/test_acc"] == [25]


def test_a_checkpoint_is_complete_only_with_every_file_recorded_and_publish_replaces_an_incomplete(
    tmp_path,
):
    """Every file of a step is flushed, not only trainer_state.json (after a machine's crash a
    "complete" step must not hold truncated tensors); a survivor's rename onto an incomplete
    directory of the same step replaces it, not taken for another survivor's copy (which would
    discard its own complete one)."""
    from accel_train.files import checkpoint_dirs, complete, publish, seal, step_dir

    out = tmp_path / "out"
    for step in (8, 16):
        folder = step_dir(out, step)
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"w" * 100)
        (folder / "optimizer.bin").write_bytes(b"o" * 50)
        seal(folder, {"step": step, "run_id": "r"})
    meta = json.loads((step_dir(out, 16) / "trainer_state.json").read_text())
    assert meta["files"] == {"model.safetensors": 100, "optimizer.bin": 50} and meta["step"] == 16
    assert checkpoint_dirs(out) == [step_dir(out, 8), step_dir(out, 16)]
    with open(step_dir(out, 16) / "model.safetensors", "r+b") as f:
        # what a crash can leave of unflushed data
        f.truncate(40)
    # resume takes step 8
    assert not complete(step_dir(out, 16)) and checkpoint_dirs(out) == [step_dir(out, 8)]
    (step_dir(out, 8) / "optimizer.bin").unlink()
    assert checkpoint_dirs(out) == []
    # an older accel_train's checkpoint: its state file alone says complete
    legacy = step_dir(out, 4)
    legacy.mkdir()
    (legacy / "trainer_state.json").write_text('{"step": 4}')
    assert complete(legacy)
    # publish: an incomplete directory under the final name is replaced; a complete one is another
    # survivor's
    tmp = out / "checkpoints" / ".tmp-step_00000016-survivor-1"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"n" * 100)
    seal(tmp, {"step": 16, "run_id": "r"})
    assert publish(tmp, step_dir(out, 16)) and complete(step_dir(out, 16)) and not tmp.exists()
    assert (step_dir(out, 16) / "model.safetensors").read_bytes() == b"n" * 100
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"x")
    seal(tmp, {"step": 16, "run_id": "r"})
    assert not publish(tmp, step_dir(out, 16)) and not tmp.exists()
    # the first complete copy stays
    assert (step_dir(out, 16) / "model.safetensors").read_bytes() == b"n" * 100


def test_a_checkpoint_whose_files_were_swapped_with_another_runs_is_refused_naming_them(tmp_path):
    # runs with --seed 1 and --seed 2; seed 2's weights and optimizer state copied into seed 1's
    # last checkpoint
    runs = {}
    for seed in (1, 2):
        runs[seed] = tmp_path / f"seed{seed}"
        proc = run_cli(
            [
                "--model",
                "test_resnet",
                "--train_samples",
                "64",
                "--test_samples",
                "16",
                "--batch_size",
                "16",
                "--epochs",
                "2",
                "--seed",
                str(seed),
                "--output_dir",
                runs[seed],
            ]
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    last = {seed: sorted((runs[seed] / "checkpoints").glob("step_*"))[-1] for seed in runs}
    for name in ("model.safetensors", "optimizer.bin"):
        shutil.copyfile(last[2] / name, last[1] / name)
    before = {p: p.read_bytes() for p in sorted(runs[1].rglob("*")) if p.is_file()}
    proc = run_cli(["--output_dir", runs[1], "--resume", "auto", "--epochs", "3"])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert (
        f"checkpoint {last[1]}: model.safetensors, optimizer.bin is not the file sealed at step 8"
        in errors[0]
    )
    assert "resumed from" not in proc.stderr
    # nothing touched
    assert {p: p.read_bytes() for p in sorted(runs[1].rglob("*")) if p.is_file()} == before
    # an honest checkpoint resumes
    assert run_cli(["--output_dir", runs[2], "--resume", "auto", "--epochs", "3"]).returncode == 0
