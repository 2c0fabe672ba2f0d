import json
import re
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from accel_train.config import ConfigError, TrainConfig
from accel_train.loop import check_one_group
from accel_train.metrics import EpochMeter
from accel_train.model import create_model
from conftest import ROOT, launch, write_cifar

FORBIDDEN = (r"\.cuda\(", r"torch\.distributed", r"DistributedSampler", r"DistributedDataParallel\(",
             r"init_process_group", r"LOCAL_RANK")


def test_package_has_no_device_or_distributed_code():
    hits = []
    for path in (ROOT / "accel_train").rglob("*.py"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            hits += [f"{path.name}:{n}: {line.strip()}" for pat in FORBIDDEN if re.search(pat, line)]
    assert not hits, hits


def test_refuses_ranks_that_did_not_join_one_group():
    torchrun_env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}
    with pytest.raises(ConfigError, match="started 2 processes but they did not join one process group"):
        check_one_group(1, TrainConfig(), env=torchrun_env)
    check_one_group(2, TrainConfig(), env=torchrun_env)
    check_one_group(1, TrainConfig(), env={"WORLD_SIZE": "4"})  # Volcano's pod count, not a launcher's ranks
    with pytest.raises(ConfigError, match="start the job with launch.sh"):
        check_one_group(1, TrainConfig(world_size=2), env={})


def load_into_fresh_model(out: Path):
    cfg = json.loads((out / "model_config.json").read_text())
    state = load_file(out / "model.safetensors")
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state)
    model = create_model(cfg["architecture"], cfg["stem"], num_classes=cfg["num_classes"])
    model.load_state_dict(state, strict=True)
    return model, cfg


@pytest.mark.slow
@pytest.mark.parametrize("config,ranks", [("cpu.yaml", 1), ("2proc_cpu.yaml", 2)])
def test_end_to_end_through_accelerate_launch(tmp_path, config, ranks):
    data = write_cifar(tmp_path / "in", rows=(20, 20, 20, 20, 20), test_rows=101)
    out = tmp_path / "out"
    proc = launch(config, ["--data", "cifar10", "--data_dir", data, "--output_dir", out, "--epochs", "2",
                           "--batch_size", "16", "--log_all_ranks"])
    log = proc.stdout + proc.stderr
    assert f"{ranks} process(es)" in log
    assert len(re.findall(r"rank \d+/\d+ wrote .*model\.safetensors", log)) == 1
    assert f"rank 0/{ranks} wrote" in log
    model, cfg = load_into_fresh_model(out)
    assert cfg["stem"] == "cifar" and len(cfg["mean"]) == 3 and len(cfg["std"]) == 3
    assert cfg["metrics"]["final_test_acc"] is not None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert {"epoch", "step", "train_loss", "train_acc", "test_acc", "lr", "images_per_sec"} <= set(r)
        assert r["test_samples"] == 101  # not a multiple of the world size, nothing dropped or doubled
        assert r["train_samples"] == (100 // (16 * ranks)) * 16 * ranks
    assert rows[-1]["step"] == 2 * (100 // (16 * ranks))
    with torch.no_grad():
        assert model.eval()(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.slow
def test_two_ranks_learn_a_learnable_dataset(tmp_path):
    data = write_cifar(tmp_path / "in", rows=(160,) * 5, test_rows=201, learnable=True, seed=3)
    out = tmp_path / "out"
    launch("2proc_cpu.yaml", ["--data", "cifar10", "--data_dir", data, "--output_dir", out, "--epochs", "4",
                              "--batch_size", "32", "--warmup_epochs", "0.5"], timeout=300)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["test_acc"] >= 0.8, rows
    assert rows[-1]["test_samples"] == 201


@pytest.mark.slow
@pytest.mark.parametrize("knobs,precision", [
    (["--pipeline", "cpu", "--num_workers", "2"], "no"),
    (["--channels_last", "--force_precision"], "bf16"),  # bf16 whatever the CPU has  # --compile with bf16, 1 and 2 processes: tests/test_matrix.py
])
def test_speed_knobs_train_and_export_clean_weights(tmp_path, knobs, precision):
    config = tmp_path / "cpu_precision.yaml"
    text = (ROOT / "accelerate_configs" / "cpu.yaml").read_text()
    config.write_text(text.replace("mixed_precision: 'no'", f"mixed_precision: '{precision}'"))
    out = tmp_path / "out"
    proc = launch(str(config), ["--train_samples", "64", "--test_samples", "19", "--batch_size", "16", "--epochs", "1",
                                "--output_dir", out, *knobs])
    assert f"[DistributedType.NO, {precision}]" in proc.stderr
    model, _ = load_into_fresh_model(out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["test_samples"] == 19
    # measured, not clamped: some time goes to the data, most to compute
    assert 0 < rows[0]["data_wait_frac"] < 0.9, rows[0]
    assert rows[0]["images_per_sec"] == pytest.approx(rows[0]["train_samples"] / rows[0]["epoch_seconds"], rel=1e-6)


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
    assert row["data_wait_frac"] == pytest.approx(0.75, abs=0.12) and row["compute_frac"] == pytest.approx(0.25, abs=0.12)
    assert (row["train_samples"], row["train_loss"], row["train_acc"]) == (12, 2.0, 0.5)
    meter.data_time = 2 * row["epoch_seconds"] + 10  # a wrong measurement shows, it is not hidden at 1
    assert meter.result(OneRank())["data_wait_frac"] > 1
