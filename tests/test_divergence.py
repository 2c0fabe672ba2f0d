"""A diverged run stops every rank at one step with one line, exit status 5, no export of non-finite
weights, the last finite checkpoint kept, and metrics files that strict JSON readers accept."""

import json
import math
import re

import pytest
import torch
from conftest import launch, run_cli
from safetensors.torch import load_file
from timm.scheduler import create_scheduler_v2

from accel_train.errors import EXIT_DIVERGED

# --lr 100: the first steps are sane; then the weights jump by orders of magnitude (step 6 here), or
# on another CPU's floating-point path the loss or the weights become non-finite first: whichever
# comes first stops the run
# fp32 numbers
ARGS = [
    "--train_samples",
    "128",
    "--test_samples",
    "16",
    "--batch_size",
    "16",
    "--epochs",
    "2",
    "--lr",
    "100",
    "--warmup_epochs",
    "0.5",
    "--checkpoint_every",
    "2",
    "--log_every",
    "1",
    "--mixed_precision",
    "no",
]


def schedule_lr(step):
    """The lr optimizer step `step` runs with: timm's cosine schedule, 8 steps per epoch, 4 warmup
    steps, then the cosine from the peak (warmup_prefix) over the other 12."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=100)
    sched, _ = create_scheduler_v2(
        opt,
        "cosine",
        num_epochs=1.5,
        warmup_epochs=0.5,
        warmup_prefix=True,
        min_lr=0.0,
        warmup_lr=1,
        step_on_epochs=False,
        updates_per_epoch=8,
    )
    sched.step_update(step - 1)
    return opt.param_groups[0]["lr"]


def strict_jsonl(path):
    def refuse(token):
        raise AssertionError(f"{path.name} holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def assert_diverged_cleanly(out, stderr):
    errors = [line for line in stderr.splitlines() if "accel-train: error" in line]
    assert len(errors) == 1, stderr[-3000:]
    # one of the three forms, each naming the step and the lr that step ran with (never "nan")
    m = re.fullmatch(
        r"accel-train: error: (the training loss became non-finite at step|the weights became"
        r" non-finite "
        r"after step|the weights of \S+ jumped from norm \S+ to \S+ at step) (\d+) \(lr"
        r" ([\d.e+-]+)\): "
        r"every rank stopped, nothing exported; newest finite checkpoint: (\S+); .*",
        errors[0],
    )
    assert m, errors[0]
    step, lr, kept = int(m.group(2)), float(m.group(3)), m.group(4)
    # the weights are checked when a step is checkpointed
    logged = step if "after step" in m.group(1) else step - 1
    # no trainer traceback
    assert "accel_train/training/loop.py" not in stderr and "Diverged" not in stderr
    assert not (out / "model.safetensors").exists() and not (out / "model_config.json").exists()
    steps = strict_jsonl(out / "steps.jsonl")
    # every step before the diverged one is logged (log_every 1), none after; its lr is the one
    # named
    assert [r["step"] for r in steps] == list(range(1, logged + 1)) and all(
        math.isfinite(r["loss"]) for r in steps
    )
    assert lr == pytest.approx(schedule_lr(step), rel=1e-3)  # the lr that step ran with
    assert [r["lr"] for r in steps] == pytest.approx([schedule_lr(s) for s in range(1, logged + 1)])
    strict_jsonl(out / "metrics.jsonl")
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert ckpts and str(ckpts[-1]) == kept and int(ckpts[-1].name.split("_")[1]) < step
    for ckpt in ckpts:
        weights = load_file(ckpt / "model.safetensors")
        assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point()), ckpt
    return step, lr


def test_divergence_one_process_exit_5(tmp_path):
    out = tmp_path / "out"
    proc = run_cli([*ARGS, "--output_dir", out])
    assert proc.returncode == EXIT_DIVERGED == 5, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    step, _ = assert_diverged_cleanly(out, proc.stderr)
    assert step > 2  # the checkpoint of step 2 was finite and stays


@pytest.mark.launches
def test_divergence_two_ranks_stop_together(tmp_path):
    out = tmp_path / "out"
    proc = launch("2proc_cpu.yaml", [*ARGS, "--batch_size", "8", "--output_dir", out], check=False)
    assert proc.returncode != 0
    assert "lost contact" not in proc.stderr
    assert_diverged_cleanly(out, proc.stderr)
    # torchrun's report: the first rank to leave left with 5; it stops the others (SIGTERM) as soon
    # as one exits
    root = re.search(
        r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", proc.stderr, re.S
    )
    assert root and root.group(1) == "5", proc.stderr[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)) <= {"5", "-15"}


def test_weights_that_diverge_within_an_epoch_are_neither_evaluated_exported_nor_recorded(tmp_path):
    # an epoch of 1 step whose loss is finite but whose update leaves non-finite weights: the
    # weights are checked (every rank agreeing) before the epoch's evaluation, its metrics row and
    # its model_best export
    out = tmp_path / "out"
    proc = run_cli(
        [
            "--model",
            "test_resnet",
            "--data",
            "random",
            "--batch_size",
            "16",
            "--train_samples",
            "16",
            "--test_samples",
            "16",
            "--epochs",
            "2",
            "--lr",
            "1e37",
            "--weight_decay",
            "1000",
            "--warmup_epochs",
            "0",
            "--output_dir",
            out,
        ]
    )
    assert proc.returncode == EXIT_DIVERGED == 5, proc.stderr[-3000:]
    m = re.search(
        r"accel-train: error: the weights became non-finite after step (\d+) .*nothing exported",
        proc.stderr,
    )
    assert m, proc.stderr[-3000:]
    diverged = int(m.group(1))
    best = out / "model_best.safetensors"
    assert not best.exists() or all(
        torch.isfinite(t).all() for t in load_file(best).values() if t.is_floating_point()
    )
    rows = strict_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
    assert all(r["step"] < diverged for r in rows), rows
    assert not (out / "model.safetensors").exists()


def test_an_infinite_loss_stops_the_run_as_a_nan_does(tmp_path):
    """+inf is as non-finite as NaN (a watch that tests isnan lets a loss of +inf train on, exit 0
    and export, with `loss: null` in steps.jsonl)."""
    from types import SimpleNamespace

    from accel_train.errors import Diverged
    from accel_train.training.divergence import NonFiniteWatch

    gather = SimpleNamespace(gather=lambda t: t)  # one process: gather is the identity
    for bad in (float("inf"), float("-inf"), float("nan")):
        watch = NonFiniteWatch("cpu", tmp_path)
        watch.update(torch.tensor(1.5), 1, 0.1)
        watch.update(torch.tensor(bad), 2, 0.1)
        watch.update(torch.tensor(1.0), 3, 0.1)  # a finite loss after it does not hide it
        with pytest.raises(
            Diverged, match=r"the training loss became non-finite at step 2 \(lr 0\.1\)"
        ):
            watch.check(gather, 3)
    fine = NonFiniteWatch("cpu", tmp_path)
    fine.update(torch.tensor(3.0e38), 1, 0.1)  # large but finite: no alarm from the loss watch
    fine.check(gather, 1)


def test_a_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    """A checkpoint taken mid-epoch (--checkpoint_every 1, 2 steps per epoch) after a step that left
    the weights non-finite is not written, and the error names no non-finite checkpoint as the
    "newest finite" one (several steps per epoch: with one, the epoch-end check always runs before
    any checkpoint).
    """
    out = tmp_path / "out"
    proc = run_cli(
        [
            "--model",
            "test_resnet",
            "--data",
            "random",
            "--batch_size",
            "16",
            "--train_samples",
            "32",
            "--test_samples",
            "16",
            "--epochs",
            "2",
            "--lr",
            "1e37",
            "--weight_decay",
            "1000",
            "--warmup_epochs",
            "0",
            "--checkpoint_every",
            "1",
            "--output_dir",
            out,
        ]
    )
    assert proc.returncode == EXIT_DIVERGED, proc.stderr[-3000:]
    assert re.search(
        r"accel-train: error: the weights became non-finite after step 1 .*no checkpoint was"
        r" written",
        proc.stderr,
    ), proc.stderr[-3000:]
    written = sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else []
    assert not written, written


class OneRank:
    """An accelerator of one process: the all-gather returns this rank's row."""

    device = torch.device("cpu")

    def gather(self, mine):
        return mine


def test_a_finite_weight_whose_norm_overflows_stops_the_run(tmp_path):
    # one real element at 1.6e32 (a wrong bf16 kernel's garbage reaches 6e35) is finite, but the
    # tensor's fp32 norm is inf; a check of elements only would export such weights (exit 0). A
    # finite tensor whose norm is not finite is absurd: every rank stops,
    # naming it (and the precision that can cause it)
    from accel_train.errors import Diverged
    from accel_train.training.divergence import NonFiniteWatch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, 2))
    watch = NonFiniteWatch(torch.device("cpu"), tmp_path, model, "bf16")
    watch.update(torch.tensor(1.0), 1, 0.1)
    watch.update_weights(1)
    watch.check(OneRank(), 1, model)  # sane weights pass
    with torch.no_grad():
        model[1].weight[1, 2] = 1.6e32
    # (the premise)
    assert torch.isfinite(model[1].weight).all() and not torch.isfinite(model[1].weight.norm())
    with pytest.raises(
        Diverged,
        match=r"^the weights of 1\.weight became absurd after step 1 \(lr 0\.1\): finite, "
        r"but their norm overflows; a wrong bf16 kernel does this too .*nothing "
        r"exported",
    ):
        watch.check(OneRank(), 1, model)
    with torch.no_grad():
        model[0].bias[0] = float("nan")  # a non-finite element is said as such
    with pytest.raises(Diverged, match=r"^the weights became non-finite after step 1"):
        watch.check(OneRank(), 1, model)
