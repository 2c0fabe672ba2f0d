import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, clean_env, launch, write_cifar
from safetensors.torch import load_file

from accel_train.errors import ConfigError
from accel_train.model.create import create_model
from accel_train.platform.accelerator import check_one_group
from accel_train.training.metrics import EpochMeter

FORBIDDEN = (
    r"\.cuda\(",
    r"torch\.distributed",
    r"DistributedSampler",
    r"DistributedDataParallel\(",
    r"init_process_group",
    r"LOCAL_RANK",
)


def test_package_has_no_device_or_distributed_code():
    hits = []
    for path in (ROOT / "accel_train").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            hits += [
                f"{path.name}:{n}: {line.strip()}" for pat in FORBIDDEN if re.search(pat, line)
            ]
    assert not hits, hits


def test_refuses_ranks_that_did_not_join_one_group():
    torchrun_env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}
    with pytest.raises(
        ConfigError, match="started 2 processes but they did not join one process group"
    ):
        check_one_group(1, None, env=torchrun_env)
    check_one_group(2, None, env=torchrun_env)
    # Volcano's pod count, not a launcher's ranks
    check_one_group(1, None, env={"WORLD_SIZE": "4"})
    with pytest.raises(ConfigError, match="start the job with launch.sh"):
        check_one_group(1, 2, env={})


def load_into_fresh_model(out: Path):
    cfg = json.loads((out / "model_config.json").read_text())
    state = load_file(out / "model.safetensors")
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)
    model = create_model(cfg["architecture"], cfg["stem"], num_classes=cfg["num_classes"])
    model.load_state_dict(state, strict=True)
    return model, cfg


@pytest.mark.core
def test_two_ranks_learn_cifar_files_end_to_end(tmp_path):
    # CIFAR-10 files through `accelerate launch` on 2 ranks; 201 test rows: not a multiple of the
    # world size. The flags one at a time on 1 and 2 ranks: tests/test_matrix.py.
    data = write_cifar(tmp_path / "in", rows=(160,) * 5, test_rows=201, learnable=True, seed=3)
    out = tmp_path / "out"
    proc = launch(
        "2proc_cpu.yaml",
        [
            *TINY,
            "--data",
            "cifar10",
            "--data_dir",
            data,
            "--output_dir",
            out,
            "--epochs",
            "4",
            "--batch_size",
            "32",
            "--warmup_epochs",
            "0.5",
            "--log_all_ranks",
        ],
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert "2 process(es)" in log
    assert re.findall(r"rank \d+/\d+ wrote .*model\.safetensors", log) == [
        f"rank 0/2 wrote {out}/model.safetensors"
    ]
    model, cfg = load_into_fresh_model(out)
    assert (
        len(cfg["mean"]) == 3
        and len(cfg["std"]) == 3
        and cfg["metrics"]["final_test_acc"] is not None
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and rows[-1]["step"] == 4 * (800 // 64)
    for r in rows:
        assert {
            "epoch",
            "step",
            "train_loss",
            "train_acc",
            "test_acc",
            "lr",
            "images_per_sec",
        } <= set(r)
        assert r["test_samples"] == 201  # nothing dropped or doubled
        assert r["train_samples"] == (800 // 64) * 64
    assert rows[-1]["test_acc"] >= 0.8, rows  # it learns
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)


class OneRank:
    def reduce(self, tensor, reduction="sum"):
        return tensor


def test_epoch_meter_data_share_is_measured_not_clamped():
    meter = EpochMeter("cpu")
    for _ in range(3):
        tick = time.perf_counter()
        time.sleep(0.03)  # waiting for data
        meter.data_time += time.perf_counter() - tick
        time.sleep(0.01)  # computing
        meter.update(torch.tensor(2.0), torch.eye(10)[:4], torch.tensor([0, 1, 5, 5]))
    row = meter.result(OneRank())
    assert row["data_wait_frac"] == pytest.approx(0.75, abs=0.12) and row[
        "compute_frac"
    ] == pytest.approx(0.25, abs=0.12)
    assert (row["train_samples"], row["train_loss"], row["train_acc"]) == (12, 2.0, 0.5)
    # a wrong measurement shows, it is not hidden at 1
    meter.data_time = 2 * row["epoch_seconds"] + 10
    assert meter.result(OneRank())["data_wait_frac"] > 1


def test_each_rank_draws_its_own_dropout_masks_and_a_resume_draws_the_same_again():
    """The promise (docs/outputs_and_resume.md, exact resume): every random draw of a step is a
    function of (seed, step, micro-batch, rank). Ranks that drew the same dropout masks would train
    correlated noise (as a reseed with rank 0 on every rank would)."""
    from types import SimpleNamespace

    from accel_train.training.loop import reseed

    def masks(rank, step=7, batch_in_epoch=3, accum=2):
        run = SimpleNamespace(
            state=SimpleNamespace(step=step, batch_in_epoch=batch_in_epoch),
            run_math={"seed": 42},
            accelerator=SimpleNamespace(process_index=rank, gradient_accumulation_steps=accum),
        )
        reseed(run)
        return torch.nn.functional.dropout(torch.ones(4096), 0.5)

    rank0, rank1 = masks(0), masks(1)
    assert not torch.equal(rank0, rank1), "rank 0 and rank 1 drew the same dropout mask"
    # a function of its inputs: resume is exact
    assert torch.equal(rank0, masks(0)) and torch.equal(rank1, masks(1))
    assert not torch.equal(rank0, masks(0, step=8)) and not torch.equal(
        rank0, masks(0, batch_in_epoch=4)
    )


def test_accelerate_launch_num_processes_2_with_a_one_process_config_is_refused_naming_the_config(
    tmp_path,
):
    """`accelerate config default` + `accelerate launch --num_processes 2` trains one process
    (distributed_type NO), never silently: the trainer reads what its launcher was asked for and
    names the config to use.
    """
    from accel_train.platform.accelerator import asked_processes

    launched = {"ACCELERATE_MIXED_PRECISION": "no"}
    cmd = b"\0".join(
        [
            b"python",
            b"-m",
            b"accelerate.commands.launch",
            b"--num_processes",
            b"2",
            b"-m",
            b"accel_train",
        ]
    )
    assert asked_processes(launched, cmd) == 2
    assert (
        asked_processes(launched, cmd.replace(b"--num_processes\x002", b"--num_processes=4")) == 4
    )
    assert (
        asked_processes({}, cmd) == 1 and asked_processes(launched, b"python\0-m\0accel_train") == 1
    )
    # end to end: Accelerate's default config (distributed_type NO) in a home of its own
    home = tmp_path / "home"
    config = home / ".cache" / "huggingface" / "accelerate" / "default_config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nnum_processes: 1\nuse_cpu:"
        " true\nmixed_precision: 'no'\nnum_machines: 1\nmachine_rank: 0\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--num_processes",
            "2",
            "-m",
            "accel_train",
            *TINY,
            "--epochs",
            "1",
            "--train_samples",
            "64",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=clean_env(HOME=str(home)),
    )
    lines = [line for line in proc.stderr.splitlines() if line.startswith("accel-train: error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert "--num_processes 2 started one process" in lines[0] and "2proc_cpu.yaml" in lines[0], (
        lines
    )
    assert not out.exists()


def test_patience_stops_after_n_evaluations_without_a_better_test_accuracy(tmp_path):
    from accel_train.training.exports import BestModel

    rows = [
        {"epoch": e, "step": 4 * e, "test_acc": acc}
        for e, acc in enumerate((0.3, 0.5, 0.5, 0.4, 0.6), 1)
    ]
    best = BestModel(tmp_path, [], writer=False)
    said = []
    for row in rows:
        best.take(row)
        said.append(best.out_of_patience(2, rows[: row["epoch"]]))
    # the best is epoch 2 (an equal one is no improvement); epochs 3 and 4 do not beat it: stop
    # after epoch 4
    assert said[:3] == [None, None, None] and said[3].startswith(
        "--patience 2: the test accuracy has not improved for 2 evaluation(s) since epoch 2"
        " (50.00%)"
    )
    assert "after epoch 4" in said[3]
    assert (
        best.out_of_patience(None, rows[:4]) is None and best.out_of_patience(3, rows[:4]) is None
    )
    # a resumed run reads the rows its checkpoint carries: the count is the uninterrupted run's
    assert BestModel(tmp_path, rows[:4], writer=False).out_of_patience(2, rows[:4]) == said[3]


@pytest.mark.launches
def test_patience_on_two_ranks_stops_early_and_a_resume_counts_as_the_uninterrupted_run(tmp_path):
    # an lr too small to move the test accuracy: epoch 1 stays the best, epochs 2 and 3 do not beat
    # it
    out = tmp_path / "out"
    args = [
        *TINY,
        "--train_samples",
        "128",
        "--test_samples",
        "32",
        "--batch_size",
        "16",
        "--epochs",
        "10",
        "--lr",
        "1e-9",
        "--patience",
        "2",
        "--output_dir",
        out,
    ]
    # (4 steps an epoch: stopped after epoch 2)
    launch("2proc_cpu.yaml", [*args, "--max_steps", "8"])
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # the rest of the run, as it was
    proc = launch("2proc_cpu.yaml", ["--output_dir", out, "--resume", "auto"])
    said = [line for line in proc.stderr.splitlines() if "--patience 2:" in line]
    assert len(said) == 1 and "since epoch 1" in said[0] and "after epoch 3" in said[0], (
        proc.stderr[-3000:]
    )
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3] and rows[0]["test_acc"] >= max(
        r["test_acc"] for r in rows
    )
    from accel_train.training.exports import exported_best

    assert exported_best(out)["epoch"] == 1 and (out / "model.safetensors").is_file()
    # a further resume trains nothing more
    launch("2proc_cpu.yaml", ["--output_dir", out, "--resume", "auto"])
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
