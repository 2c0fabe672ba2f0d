"""One resume decision per job: elastic resume, runs that own their checkpoints, EMA and
cpu-pipeline resume."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, clean_env, launch, reference_args, run_cli, steps_logged, wait_for
from safetensors.torch import load_file
from test_checkpoint import assert_same_train_rows
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3

from accel_train.checkpoint.resume import check_data, reconcile
from accel_train.cli import parse_train_args
from accel_train.errors import ConfigError
from accel_train.files import checkpoint_dirs
from accel_train.model.create import create_model


def small(out, *extra):
    # 256 random samples, global batch 32: 8 optimizer steps per epoch
    return [
        *TINY,
        "--train_samples",
        "256",
        "--test_samples",
        "32",
        "--epochs",
        "2",
        "--log_every",
        "1",
        "--output_dir",
        out,
        *extra,
    ]


def worst(a, b):
    return max(
        (a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point()
    )


def one_line_error(proc, *needles, status=2):
    """status: torchrun's `accelerate launch` returns 1 for any failed rank (launch.sh passes the 2
    on)."""
    assert proc.returncode == status, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert len(errors) == 1 and (status == 1 or "Traceback" not in proc.stderr), proc.stderr[-2000:]
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


@pytest.mark.launches
def test_two_rank_checkpoint_continues_on_one_and_four_ranks_exactly(tmp_path, two_rank_reference):
    full, part = two_rank_reference  # 2 ranks x 16, stopped at step 11 (3 steps into epoch 2)
    ref = load_file(full / "model.safetensors")
    for ranks, per in ((1, 32), (4, 8)):
        out = tmp_path / f"on{ranks}"
        shutil.copytree(part, out)
        # the same command line as before (--batch_size 16): the per-process batch follows the
        # global batch (1 process: cpu.yaml, in the test process; 4: the 2-process config with 4
        # ranks)
        proc = (
            launch("cpu.yaml", reference_args(2, out, "--resume", "auto"))
            if ranks == 1
            else launch(
                "2proc_cpu.yaml",
                reference_args(2, out, "--resume", "auto"),
                launcher=("--num_processes", ranks),
            )
        )
        assert (
            f"2 -> {ranks} processes; per-process batch 16 -> {per} keeps the checkpoint's global"
            " batch 32" in proc.stderr
        ), proc.stderr[-3000:]
        assert (
            "step 11, " in proc.stderr
            and f"{3 * 32 // (per * ranks)} batches into the epoch" in proc.stderr
        )
        # ranks the checkpoint had no RNG state for say so themselves, once, with their rank (not
        # twice, without the rank)
        # (ranks write to stderr concurrently: their lines come in any order, and may share a line)
        said = {r: proc.stderr.count(f"has no RNG state for rank {r} ") for r in range(ranks)}
        assert said == {r: int(r >= 2) for r in range(ranks)}, proc.stderr[-3000:]
        assert all(f"[RANK {r}] " in proc.stderr for r in range(2, ranks))
        got = load_file(out / "model.safetensors")
        assert worst(ref, got) <= 1e-5, (ranks, worst(ref, got))
        steps = [json.loads(r)["step"] for r in (out / "steps.jsonl").read_text().splitlines()]
        assert steps == list(range(1, 25))
        # epoch 2's row is the uninterrupted run's: the 2 ranks' sums before the stop, kept, plus
        # these ranks'
        assert_same_train_rows(rows(full), rows(out))
    # the sums a checkpoint taken mid-epoch reduces (--checkpoint_every's step 10; 11 was where
    # --max_steps stopped, after the row), continued on 1 rank
    out = shutil.copytree(part, tmp_path / "from10")
    assert (
        json.loads((out / "checkpoints" / "step_00000010" / "trainer_state.json").read_text())[
            "epoch_sums"
        ]["samples"]
        == 2 * 32
    )
    launch("cpu.yaml", reference_args(2, out, "--resume", out / "checkpoints" / "step_00000010"))
    assert_same_train_rows(rows(full), rows(out))
    # and 1e-5 means something: training moved the weights far more than that
    init = create_model(TINY[1], "imagenet", norm_layer="groupnorm1").state_dict()
    assert worst(ref, init) > 1e-3

    # what would change the run's math is refused (reconcile / check_data, in-process below, on this
    # real checkpoint); the refusal end-to-end once: 2 ranks, one line naming the flag, nothing in
    # --output_dir touched
    part = shutil.copytree(part, tmp_path / "part")
    before = {
        str(p.relative_to(part)): p.read_bytes() for p in sorted(part.rglob("*")) if p.is_file()
    }
    one_line_error(
        launch("2proc_cpu.yaml", reference_args(4, part, "--resume", "auto"), check=False),
        "--batch_size 8",
        "global batch 32",
        status=1,
    )
    assert {
        str(p.relative_to(part)): p.read_bytes() for p in sorted(part.rglob("*")) if p.is_file()
    } == before
    refusals_of_a_real_checkpoint(part)


@pytest.mark.launches
def test_two_rank_cpu_pipeline_continues_on_one_rank_exactly(tmp_path, two_rank_reference):
    # the cpu pipeline (its workers augment per sample) on 2 ranks, stopped 3 steps into epoch 2 and
    # finished on 1 rank, ends where the uninterrupted 2-rank run ends (the reference: the device
    # pipeline, which augments alike): every rank augmented epochs 2 and 3 as epochs 2 and 3, not as
    # epoch 1 again
    full = two_rank_reference[0]
    out = tmp_path / "out"
    cpu = ["--pipeline", "cpu", "--num_workers", "1"]
    launch("2proc_cpu.yaml", reference_args(2, out, *cpu, "--max_steps", "11"))
    # a newer copy cut short (a crash, a full disk): skipped, said
    damaged = out / "checkpoints" / "step_00000012"
    shutil.copytree(out / "checkpoints" / "step_00000011", damaged)
    with open(damaged / "model.safetensors", "r+b") as f:
        f.truncate(40)
    proc = launch("cpu.yaml", reference_args(2, out, *cpu, "--resume", "auto"))
    assert "step 11, " in proc.stderr and "pipeline cpu" in proc.stderr, proc.stderr[-3000:]
    assert (
        f"--resume auto: skipping checkpoint {damaged}: damaged (model.safetensors has 40 bytes, "
        in proc.stderr
        and "resuming from step_00000011" in proc.stderr
    ), proc.stderr[-3000:]
    # (1e-4: the two pipelines normalise in another order, ~1e-7 apart per input; frozen
    # augmentation was 5e-3 away)
    assert (
        worst(load_file(full / "model.safetensors"), load_file(out / "model.safetensors")) <= 1e-4
    )


def rows(out):
    return [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]


def refuses(meta, args, num_processes=1, train_size=None):
    """The resume checks the loop runs on this checkpoint (reconcile, then check_data): the
    ConfigError's line."""
    cfg = parse_train_args([str(a) for a in args])
    with pytest.raises(ConfigError) as e:
        reconcile(meta, cfg, num_processes, lambda msg: None)
        check_data(meta, cfg.train_samples if train_size is None else train_size)
    assert "\n" not in str(e.value)  # the message is the whole one-line error
    return str(e.value)


def refusals_of_a_real_checkpoint(part):
    meta = json.loads((part / "checkpoints" / "step_00000011" / "trainer_state.json").read_text())
    ckpt = ["--resume", "auto"]
    line = refuses(meta, reference_args(4, part, *ckpt), num_processes=2)  # 2 x 8
    assert "--batch_size 8" in line and "global batch 32" in line, line
    assert "--seed 7" in refuses(meta, reference_args(1, part, "--seed", "7", *ckpt))
    assert "--grad_accum 2 differs from the checkpoint's 1" in refuses(
        meta, reference_args(2, part, "--grad_accum", "2", *ckpt)
    )
    assert "--model_kwargs {}" in refuses(
        meta, reference_args(1, part, "--model_kwargs", "{}", *ckpt)
    )
    assert "trained on 256 training samples, this data has 224" in refuses(
        meta, reference_args(1, part, "--train_samples", "224", *ckpt)
    )
    line = refuses(meta, reference_args(2, part, *ckpt), num_processes=3)
    assert "cannot be split over 3 processes" in line and "[1, 2, 4, 8, 16, 32]" in line, line
    # the same meta with the same flags passes both checks: the refusals above are caused by the
    # flag named
    cfg = parse_train_args([str(a) for a in reference_args(2, part, *ckpt)])
    reconcile(meta, cfg, 2, lambda msg: None)
    check_data(meta, 256)


def test_the_flags_every_machine_must_share_are_named_and_per_machine_paths_are_not(tmp_path):
    # what decide() gathers from every rank (_report) and compares (_check_flags): the start-up
    # refusal a two-host run proves end to end for --batch_size (test_multinode.py), here for the
    # resume mode, a replaced machine started without --resume auto
    from types import SimpleNamespace

    from accel_train.checkpoint.resume import _check_flags, _report

    def report(rank, *args):
        accelerator = SimpleNamespace(process_index=rank, is_local_main_process=False)
        return _report(
            accelerator,
            parse_train_args([str(a) for a in small(tmp_path / "out", *args)]),
            tmp_path,
            "job",
        )

    with pytest.raises(ConfigError, match=r"--resume is None on rank 0 but 'auto' on rank 1"):
        _check_flags([report(0), report(1, "--resume", "auto")])
    with pytest.raises(
        ConfigError, match=r"--init_from is None on rank 0 but 'a weights file' on rank 1"
    ):
        _check_flags([report(0), report(1, "--init_from", tmp_path / "w.safetensors")])
    # each machine's own data copy, output dir and checkpoint path are its own business
    _check_flags(
        [
            report(
                0,
                "--data",
                "random",
                "--data_dir",
                "a",
                "--resume",
                "/m0/step_8",
                "--num_workers",
                "2",
            ),
            report(
                1,
                "--data",
                "random",
                "--data_dir",
                "b",
                "--resume",
                "/m1/step_8",
                "--num_workers",
                "0",
            ),
        ]
    )


@pytest.fixture(scope="module")
def one_epoch(tmp_path_factory):
    """One whole epoch (8 steps) on 1 process, read-only: the run
    test_more_epochs_on_resume_rebuild_the_schedule continues (in a copy), and the other run whose
    checkpoint test_checkpoints_belong_to_a_run copies in.
    """
    out = tmp_path_factory.mktemp("one_epoch") / "out"
    launch("cpu.yaml", small(out, "--batch_size", "32", "--epochs", "1"))
    return out


def test_more_epochs_on_resume_rebuild_the_schedule(tmp_path, one_epoch):
    out = tmp_path / "out"
    shutil.copytree(one_epoch, out)
    proc = launch("cpu.yaml", small(out, "--batch_size", "32", "--epochs", "2", "--resume", "auto"))
    assert "--epochs 1 -> 2: the lr schedule is rebuilt for 2 epochs" in proc.stderr
    lrs = [json.loads(r)["lr"] for r in (out / "steps.jsonl").read_text().splitlines()]
    # steps 9..16 follow the 2-epoch schedule (warmup 1 epoch, then the cosine from the peak to 0 at
    # step 16), not the old one's min_lr
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.025)
    sched, _ = create_scheduler_v2(
        opt,
        "cosine",
        num_epochs=1,
        warmup_epochs=1,
        warmup_prefix=True,
        min_lr=0,
        warmup_lr=0.025 / 100,
        step_on_epochs=False,
        updates_per_epoch=8,
    )
    expected = []
    for step in range(8, 16):
        # the lr the optimizer steps with at step s+1 was set by step_update(s)
        sched.step_update(step)
        expected.append(opt.param_groups[0]["lr"])
    assert len(lrs) == 16 and lrs[8:] == pytest.approx(expected, rel=1e-9), (lrs[8:], expected)
    # the peak (the old 1-epoch schedule had ended at min_lr 0)
    assert lrs[8] == pytest.approx(0.025)


def test_every_resumed_step_trains_with_the_lr_its_row_says(tmp_path, one_epoch, monkeypatch):
    # steps.jsonl's lr comes from the schedule as a function of the step (exports.lr_of_step): the
    # optimizer's own lr at each step, the one it steps with, must be that one, the first resumed
    # step's too (start-up sets it: startup.resume)
    from accel_train.training import loop

    used, real = {}, loop.apply_step

    def recording(run, parts, grad_norm):
        if run.accelerator.sync_gradients:
            used[run.state.step + 1] = run.optimizer.param_groups[0]["lr"]
        return real(run, parts, grad_norm)

    monkeypatch.setattr(loop, "apply_step", recording)
    out = tmp_path / "out"
    shutil.copytree(one_epoch, out)
    proc = run_cli(small(out, "--batch_size", "32", "--epochs", "2", "--resume", "auto"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = {
        r["step"]: r["lr"] for r in map(json.loads, (out / "steps.jsonl").read_text().splitlines())
    }
    assert sorted(used) == list(range(9, 17)), used
    assert [used[s] for s in used] == pytest.approx([logged[s] for s in used], rel=1e-9)


def test_checkpoints_belong_to_a_run(tmp_path, one_epoch):
    out, other = tmp_path / "out", one_epoch  # other: a second run, 8 steps
    launch(
        "cpu.yaml",
        small(
            out,
            "--batch_size",
            "32",
            "--epochs",
            "1",
            "--max_steps",
            "6",
            "--checkpoint_every",
            "2",
            "--keep_checkpoints",
            "5",
        ),
    )
    before = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert before == ["step_00000002", "step_00000004", "step_00000006"]
    # a fresh run in that directory is refused, nothing of the older run is touched
    one_line_error(
        run_cli(small(out, "--batch_size", "32", "--max_steps", "2")),
        "--resume auto",
        "--overwrite",
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == before
    # checkpoints of a second run copied in: --resume auto will not mix them
    shutil.copytree(other / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000099")
    one_line_error(
        run_cli(small(out, "--batch_size", "32", "--resume", "auto")), "2 different runs"
    )
    # rotation counts only the run's own checkpoints: the stranger is neither kept in its place nor
    # deleted
    first = json.loads((out / "checkpoints" / "step_00000006" / "trainer_state.json").read_text())[
        "run_id"
    ]
    assert [p.name for p in checkpoint_dirs(out, first)] == before
    assert [p.name for p in checkpoint_dirs(out)] == before + ["step_00000099"]
    shutil.rmtree(out / "checkpoints" / "step_00000099")
    proc = launch(
        "cpu.yaml",
        small(
            out,
            "--batch_size",
            "32",
            "--epochs",
            "1",
            "--keep_checkpoints",
            "1",
            "--resume",
            "auto",
        ),
    )
    assert "resumed from" in proc.stderr and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000008"]
    # --overwrite with bad input (data that is not there, a model timm does not have): refused,
    # nothing deleted
    one_line_error(
        run_cli(
            small(
                out,
                "--batch_size",
                "32",
                "--overwrite",
                "--data",
                "cifar10",
                "--data_dir",
                tmp_path / "nowhere",
            )
        ),
        "nowhere",
    )
    one_line_error(
        run_cli([*small(out, "--batch_size", "32", "--overwrite"), "--model", "resnet1800"]),
        "resnet1800",
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000008"]
    # ... a first step that fails (a model that builds but cannot run): the earlier run is set
    # aside, not deleted, so that a relaunch (launch.sh's: --resume auto added, the same run id)
    # starts afresh as --overwrite asked
    # (what launch.sh gives every attempt)
    as_launched = clean_env(ACCEL_TRAIN_RUN_ID="0123456789ab")
    # (a forward that fails only with gradients: the start-up check of one batch runs without them;
    # fp32 stated, as on a CPU with native bf16 the precision check's own step with gradients would
    # fail first: exit 2)
    crash = run_cli(
        small(
            out,
            "--batch_size",
            "32",
            "--overwrite",
            "--model",
            "tests_pkg.mod:build",
            "--mixed_precision",
            "no",
        ),
        env={**as_launched, "TESTS_PKG_FAIL_WITH_GRAD": "1"},
    )
    assert crash.returncode == 1 and "the first training step fails" in crash.stderr, crash.stderr[
        -2000:
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [".overwritten-step_00000008"]
    # (by hand, the two flags contradict each other: refused in one line)
    one_line_error(
        run_cli(small(out, "--batch_size", "32", "--overwrite", "--resume", "auto")),
        "pass one of them",
    )
    relaunch = run_cli(
        small(
            out,
            "--batch_size",
            "32",
            "--epochs",
            "1",
            "--overwrite",
            "--resume",
            "auto",
            "--max_steps",
            "1",
            "--checkpoint_every",
            "1",
        ),
        env=as_launched,
    )
    assert relaunch.returncode == 0 and "resumed from" not in relaunch.stderr, relaunch.stderr[
        -2000:
    ]
    # its first: the earlier go
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]
    # the run the relaunch continues (had it saved before the crash) is the one launch.sh named
    assert (
        json.loads((out / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())[
            "run_id"
        ]
        == "0123456789ab"
    )
    # --overwrite with the earlier run's step (8) as its first checkpoint: the new run's is kept
    shutil.copytree(other / "checkpoints" / "step_00000008", out / "checkpoints" / "step_00000008")
    shutil.rmtree(out / "checkpoints" / "step_00000001")
    proc = launch("cpu.yaml", small(out, "--batch_size", "32", "--epochs", "1", "--overwrite"))
    assert (
        "--overwrite: setting" in proc.stderr
        and "set aside at the start of this run" in proc.stderr
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000008"]

    def run_of(ckpt):
        return json.loads((ckpt / "trainer_state.json").read_text())["run_id"]

    assert run_of(out / "checkpoints" / "step_00000008") != run_of(
        other / "checkpoints" / "step_00000008"
    )


def test_ema_is_restored_before_first_use(tmp_path):
    full, part, plain = tmp_path / "full", tmp_path / "part", tmp_path / "plain"
    run = ["--batch_size", "32", "--epochs", "1", "--ema", "--ema_decay", "0.9"]
    launch("cpu.yaml", small(full, *run, "--max_steps", "4"))
    launch("cpu.yaml", small(part, *run, "--max_steps", "3"))
    assert (part / "checkpoints" / "step_00000003" / "ema.safetensors").is_file()
    launch("cpu.yaml", small(part, *run, "--max_steps", "4", "--resume", "auto"))
    assert (
        worst(load_file(full / "model_ema.safetensors"), load_file(part / "model_ema.safetensors"))
        <= 1e-6
    )

    # a checkpoint without EMA weights: the EMA starts from the resumed weights
    launch("cpu.yaml", small(plain, "--batch_size", "32", "--epochs", "1", "--max_steps", "3"))
    w3 = load_file(plain / "checkpoints" / "step_00000003" / "model.safetensors")
    proc = launch("cpu.yaml", small(plain, *run, "--max_steps", "4", "--resume", "auto"))
    assert "has no EMA weights: the EMA starts from the resumed weights" in proc.stderr
    w4, ema = load_file(plain / "model.safetensors"), load_file(plain / "model_ema.safetensors")
    model = create_model(TINY[1], "imagenet")
    model.load_state_dict(w3)
    expected = ModelEmaV3(model, decay=0.9, use_warmup=True)
    model.load_state_dict(w4)
    expected.update(model, step=4)
    assert worst(expected.module.state_dict(), ema) <= 1e-6
    assert worst(w4, ema) > 1e-4  # it is an average, not a copy


def test_cpu_pipeline_with_workers_resumes_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run = ["--batch_size", "32", "--pipeline", "cpu", "--num_workers", "2"]
    launch("cpu.yaml", small(full, *run))
    launch("cpu.yaml", small(part, *run, "--max_steps", "11"))
    launch("cpu.yaml", small(part, *run, "--resume", "auto"))
    assert (
        worst(load_file(full / "model.safetensors"), load_file(part / "model.safetensors")) <= 1e-6
    )


@pytest.mark.parametrize("newest_on", [0, 1, 2])
def test_resume_auto_takes_the_newest_step_whichever_machine_holds_it(newest_on):
    """README (resume, each machine's own disk): --resume auto continues from the newest complete
    step any machine holds, wherever the newest copy is (not always the last machine, where
    taking the last machine's step would pass).
    """
    from accel_train.checkpoint.resume import _choose

    listings = [[(8, "run"), (16, "run")], [(8, "run"), (16, "run")], [(8, "run"), (16, "run")]]
    listings[newest_on].append((24, "run"))
    reports = [{"listing": listing, "launch": "run", "explicit": None} for listing in listings]
    assert _choose("auto", False, reports) == ((24, "run"), {"run"})
    # launch.sh's relaunch of an --overwrite run (--resume auto --overwrite): that run's newest,
    # wherever it is
    assert _choose("auto", True, reports) == ((24, "run"), {"run"})


@pytest.mark.launches
def test_a_second_job_in_a_written_output_dir_is_one_line_naming_the_holder(tmp_path):
    """Two jobs never write one output directory at once. The holder here is this
    test process (as the ranks of a killed launcher were, training on): the second job gets one line
    with its host and pid, exit 2, and the directory is left as it was; once the holder ends, the
    directory is free again.
    """
    import socket

    from accel_train.checkpoint.output_dir import LOCK_FILE, hold_output_dir, release_output_dir

    out = tmp_path / "out"
    # a finished run in it: the holder is named, not the run
    launch("cpu.yaml", small(out, "--max_steps", "1"))
    hold_output_dir(out)
    try:
        before = sorted(p.name for p in out.iterdir())
        proc = run_cli(small(out, "--max_steps", "1"), fresh=True)  # (another process)
        errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
        assert (
            f"host {socket.gethostname()}, pid {os.getpid()}" in errors[0]
            and "another job" in errors[0]
        ), errors
        assert sorted(p.name for p in out.iterdir()) == before and LOCK_FILE in before
    finally:
        release_output_dir(out)
    # the holder gone: the directory free
    launch("cpu.yaml", small(out, "--max_steps", "1", "--overwrite", "true"))


# A second job whose look at the lock file comes between its open and its lock: it opens the file,
# waits for a line on stdin (the moment the first job's release deletes that file), then locks;
# "held" or "refused ..." says how its hold_output_dir ended, and it keeps what it holds until its
# stdin closes.
LATE_LOCKER = """
import os, sys
from pathlib import Path
import accel_train.checkpoint.output_dir as runs
real, waited = os.open, []
def late_open(path, *args, **kwargs):
    fd = real(path, *args, **kwargs)
    if str(path).endswith(runs.LOCK_FILE) and not waited:
        waited.append(fd)
        print("opened", flush=True)
        sys.stdin.readline()
    return fd
os.open = late_open
try:
    runs.hold_output_dir(Path(sys.argv[1]))
    print("held", flush=True)
except runs.ConfigError as e:
    print("refused", e, flush=True)
sys.stdin.readline()
"""


def read_line(proc, timeout: float = 60) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no line from the second job in {timeout}s"
    return proc.stdout.readline().strip()


@pytest.mark.launches
def test_a_job_that_opened_the_lock_file_before_its_release_deleted_it_is_never_a_second_holder(
    tmp_path,
):
    """The lock file a refused start made is deleted on release; a second job that had opened it
    just before locked the deleted file, and the first job's next hold made a new one: both held the
    directory. Only the lock on the file at the path counts."""
    from accel_train.checkpoint.output_dir import LOCK_FILE, hold_output_dir, release_output_dir

    out = tmp_path / "out"
    out.mkdir()
    hold_output_dir(out)  # (this look made the lock file: a refused start deletes it)
    second = subprocess.Popen(
        [sys.executable, "-c", LATE_LOCKER, str(out)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=clean_env(PYTHONPATH=str(ROOT)),
        cwd=ROOT,
    )
    try:
        assert read_line(second) == "opened"
        release_output_dir(out, refused=True)
        assert not (out / LOCK_FILE).exists()
        second.stdin.write("\n")
        second.stdin.flush()
        assert read_line(second) == "held"  # (the directory is free: the second job holds it)
        with pytest.raises(ConfigError, match=f"being written by another job .*pid {second.pid},"):
            hold_output_dir(out)
    finally:
        release_output_dir(out)
        second.kill()
        second.communicate(timeout=30)


@pytest.mark.launches
def test_an_immediate_resume_after_kill_9_is_not_refused_by_the_dead_trainers_dataloader_workers(
    tmp_path,
):
    """The lock ends with the process that holds it, however it ends: kill -9 of a trainer leaves
    its DataLoader workers running for seconds (they notice their parent gone every 5 s); an flock
    they inherited refused the resume started at once, naming the dead pid. The workers are stopped
    here, so they outlive the resume.
    """
    import psutil

    out, log = tmp_path / "out", tmp_path / "run.log"
    args = [
        "--model",
        "tests_pkg.mod:build",
        "--data",
        "random",
        "--train_samples",
        "256",
        "--test_samples",
        "8",
        "--batch_size",
        "8",
        "--epochs",
        "1",
        "--log_every",
        "1",
        "--checkpoint_every",
        "2",
        "--pipeline",
        "cpu",
        "--num_workers",
        "2",
        "--output_dir",
        out,
    ]
    env = clean_env(
        TESTS_PKG_DELAY="0.1", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    )
    with open(log, "w") as f:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "accel_train", *map(str, args)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        wait_for(
            lambda: steps_logged(out) >= 3 or trainer.poll() is not None, timeout=240, interval=0.02
        )
        assert trainer.poll() is None, log.read_text()[-3000:]
        workers = psutil.Process(trainer.pid).children(recursive=True)
        assert workers, "no DataLoader workers"
        for worker in workers:
            worker.suspend()
        trainer.kill()
        trainer.wait(timeout=30)
        resumed = run_cli([*args, "--resume", "auto"], timeout=240)
        # (the resume ran beside the dead trainer's workers)
        assert all(w.is_running() for w in workers)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "another job" not in resumed.stderr and (out / "model.safetensors").is_file()
    finally:
        os.killpg(trainer.pid, signal.SIGKILL)  # (the workers: in the trainer's session)
        trainer.wait(timeout=30)


def test_a_machine_whose_disk_lost_the_runs_record_takes_another_machines():
    from accel_train.checkpoint.resume import _check_flags, share_the_record
    from accel_train.config.train_config import TrainConfig

    said = []
    # machine 0's command line took --epochs 3 and --lr 0.01 from its config.yaml; machine 1's disk
    # was replaced
    mine = TrainConfig(resume="auto", model="test_resnet")
    flags = {k: v for k, v in mine.to_dict().items() if k not in ("output_dir", "resume")}
    reports = [
        {
            "rank": 0,
            "flags": {**flags, "epochs": 3, "lr": 0.01},
            "from_run": {"epochs": 3, "lr": 0.01},
        },
        {"rank": 1, "flags": dict(flags), "from_run": None},
    ]
    adopted = share_the_record(mine, reports, 1, said.append)
    _check_flags(reports)  # (no "started with different flags")
    assert adopted == {"epochs": 3, "lr": 0.01} and mine == TrainConfig(
        resume="auto", model="test_resnet"
    )
    assert said and "rank 0's: --epochs 3 --lr 0.01" in said[0]
    # without the share, the machines would disagree (and train two runs)
    reports[1]["flags"] = dict(flags)
    with pytest.raises(ConfigError, match="started with different flags"):
        _check_flags(reports)
