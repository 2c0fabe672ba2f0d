"""Every user-facing flag on 1 process, on 2 processes and (those that touch outputs, checkpoints or
collectives) on two network hosts, combined into few tiny runs; each run checks what the flags do.

run A: --compile --channels_last --ema --tta under bf16 autocast (accelerate launch
       --mixed_precision bf16), over 2 epochs stopped one step into the second and resumed:
       torch.compile compiles one training and one evaluation graph in each launch (11 test
       samples: the last evaluation batch is padded, never recompiled)
run B: --log_with tensorboard --grad_accum 2 --clip_grad --pipeline cpu --num_workers 2
two hosts: --log_with tensorboard --ema --tta --grad_accum 2 --clip_grad --channels_last under
       bf16, --pipeline cpu with its default (persistent) workers
(torch.compile is left out there: it takes minutes per rank on this machine's shared cores)
"""

import json
import math
import re
from pathlib import Path

import pytest
import timm
from conftest import CONFIGS, TINY, check_best, launch, run_cli, wait_all
from safetensors.torch import load_file

from accel_train.cli import parse_train_args
from accel_train.files import BEST_FILE, EMA_FILE
from accel_train.model.create import create_model

SMALL = [
    *TINY,
    "--train_samples",
    "64",
    "--test_samples",
    "16",
    "--batch_size",
    "8",
    "--epochs",
    "1",
    "--log_every",
    "1",
]
# epoch 1's too (the stop at step 9 makes a third): check_best compares with it
RUN_A = [
    "--compile",
    "--channels_last",
    "--ema",
    "--tta",
    "--force_precision",  # bf16 whatever the CPU has
    "--epochs",
    "2",
    "--test_samples",
    "11",
    "--log_all_ranks",  # (the last --test_samples given wins)
    "--keep_checkpoints",
    "3",
]
# (GroupNorm: comparable with one process, below)
RUN_B = [
    "--log_with",
    "tensorboard",
    "--grad_accum",
    "2",
    "--clip_grad",
    "1.0",
    "--pipeline",
    "cpu",
    "--num_workers",
    "2",
    "--epochs",
    "2",  # two epochs: the cpu pipeline's augmentation must change between them
    "--model_kwargs",
    '{"norm_layer": "groupnorm1"}',
]
# unequal shards on the 2 ranks (the last --test_samples given wins)
HOSTS = [
    "--log_with",
    "tensorboard",
    "--ema",
    "--tta",
    "--grad_accum",
    "2",
    "--clip_grad",
    "1.0",
    "--channels_last",
    "--force_precision",  # bf16 whatever the CPU has
    "--pipeline",
    "cpu",  # with its default workers, on each host
    "--test_samples",
    "11",
]
TOPOLOGY = {1: "cpu.yaml", 2: "2proc_cpu.yaml"}


def bf16_config(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"bf16_{name}"
    path.write_text((CONFIGS / name).read_text() + "mixed_precision: 'bf16'\n")  # (ours state none)
    return str(path)


def strict_jsonl(path: Path) -> list[dict]:
    def refuse(token):
        raise AssertionError(f"{path} holds {token}, which is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def tensorboard_scalars(out: Path) -> tuple[dict, set]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags, writers = {}, set()
    for events in out.rglob("events.out.tfevents.*"):
        writers.add(events.name.split(".")[-2])  # events.out.tfevents.<time>.<host>.<pid>.<n>
        acc = EventAccumulator(str(events.parent))
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            tags[tag] = [e.value for e in acc.Scalars(tag)]
    return tags, writers


def load_clean(path: Path):
    state = load_file(path)
    assert state and not any(
        k.startswith(("module.", "_orig_mod.")) or "._orig_mod." in k for k in state
    ), [k for k in state][:5]
    meta = json.loads((path.parent / "model_config.json").read_text())
    model = create_model(meta["architecture"], meta["stem"], **meta.get("model_kwargs", {}))
    model.load_state_dict(state, strict=True)
    return state


def check_run(
    out: Path,
    *,
    ranks: int,
    grad_accum: int = 1,
    ema: bool = False,
    tracker: bool = False,
    epochs: int = 1,
    test_samples: int = 16,
) -> dict:
    """What every finished run must leave, whatever the flags and the topology (the last epoch's
    row)."""
    per_epoch = 64 // (8 * ranks) // grad_accum
    steps = strict_jsonl(out / "steps.jsonl")
    assert [s["step"] for s in steps] == list(range(1, per_epoch * epochs + 1))
    assert all(math.isfinite(s["loss"]) and s["lr"] > 0 for s in steps)
    rows = strict_jsonl(out / "metrics.jsonl")
    # the evaluation's padding not counted
    assert [(r["epoch"], r["step"], r["test_samples"]) for r in rows] == [
        (e, per_epoch * e, test_samples) for e in range(1, epochs + 1)
    ]
    # (a resumed epoch counts what it trained)
    assert rows[0]["train_samples"] == per_epoch * 8 * ranks * grad_accum
    for row in rows:
        assert 0 < row["data_wait_frac"] < 1  # measured, not clamped
        assert row["images_per_sec"] == pytest.approx(
            row["train_samples"] / row["epoch_seconds"], rel=1e-6
        )
        assert ("test_acc_ema" in row) == ema
    row = rows[-1]
    load_clean(out / "model.safetensors")
    load_clean(out / BEST_FILE)
    # the best epoch's finite weights, its checkpoint's (the model's, not the EMA's)
    check_best(out)
    meta = json.loads((out / "model_config.json").read_text())
    assert meta["metrics"]["final_test_acc"] == row["test_acc"]
    if ema:
        exported = load_clean(out / "model_ema.safetensors")
        ckpts = sorted((out / "checkpoints").glob("step_*"))
        names = [c.name for c in ckpts]
        # every epoch's end (a stop's in between where a run stopped); the newest the run's end;
        # one epoch: only that
        ends = [f"step_{per_epoch * e:08d}" for e in range(1, epochs + 1)]
        assert set(ends) <= set(names) and names[-1] == ends[-1], names
        assert len(names) == 1 or epochs > 1, names
        ckpt = ckpts[-1]
        saved = load_file(ckpt / EMA_FILE)
        assert exported.keys() == saved.keys() and all(
            (exported[k] == saved[k]).all() for k in saved
        )
        # timm's own model takes it (the cifar stem's export: tests/test_outputs.py)
        timm.create_model(TINY[1], num_classes=10).load_state_dict(exported, strict=True)
    else:
        assert not (out / "model_ema.safetensors").exists()
    if tracker:
        tags, writers = tensorboard_scalars(out)
        assert len(writers) == 1, f"trackers run on the main process only, found writers {writers}"
        assert tags["step/train_loss"] == pytest.approx([s["loss"] for s in steps], rel=1e-6)
        assert tags["epoch/test_acc"] == pytest.approx([r["test_acc"] for r in rows])
    else:
        assert not list(out.rglob("events.out.tfevents.*"))
    return row


def evaluated(stdout: str, ranks: int, samples: int = 16) -> float:
    m = re.search(rf"test accuracy ([\d.]+)% on {samples} samples \((\d) process", stdout)
    assert m and int(m.group(2)) == ranks, stdout
    return float(m.group(1)) / 100


EVALUATE = ["evaluate", "--data", "random", "--test_samples", "16", "--batch_size", "8"]


COMPILED = re.compile(r"rank (\d+): torch.compile compiled (\d+) graph\(s\) \(train, eval\)")


@pytest.mark.launches
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("ranks", [1, 2])
def test_run_a_compile_bf16_channels_last_ema_tta(tmp_path, ranks):
    config = bf16_config(tmp_path, TOPOLOGY[ranks])
    out = tmp_path / "out"
    stop_at = 64 // (8 * ranks) + 1  # one step into epoch 2, after epoch 1's evaluation
    first = launch(
        config, [*SMALL, *RUN_A, "--output_dir", out, "--max_steps", stop_at], timeout=900
    )
    resumed = launch(config, [*SMALL, *RUN_A, "--output_dir", out, "--resume", "auto"], timeout=900)
    assert f"step {stop_at}, 1 batches into the epoch" in resumed.stderr, resumed.stderr[-3000:]
    for proc in (first, resumed):
        assert f"{ranks} process(es)" in proc.stderr and ", bf16]" in proc.stderr
        # torch.compile wraps what prepare() made (DDP with 2 ranks), as Accelerate advises (every
        # rank's start line; the done line does not name the wrappers)
        chain = "OptimizedModule(" + (
            "DistributedDataParallel(ResNet))" if ranks > 1 else "ResNet)"
        )
        models = re.findall(r"\bmodel (\w+(?:\(\w+)*\)*)", proc.stderr)
        assert len(models) == ranks and set(models) == {chain}, models
        # a bounded, known set of graphs on every rank: one for training, one for evaluation (flip
        # TTA and the padded last batch included), in the run that stopped and in the resumed one
        compiled = {int(r): int(g) for r, g in COMPILED.findall(proc.stderr)}
        assert compiled == dict.fromkeys(range(ranks), 2), proc.stderr[-3000:]
    row = check_run(out, ranks=ranks, ema=True, epochs=2, test_samples=11)
    assert parse_train_args(["--config", str(out / "config.yaml")]).compile is True
    # evaluate (same topology, bf16, flip TTA as trained) reproduces the run's numbers, EMA
    # included, within one of the 11 samples: evaluate runs eager, the run's evaluation compiled,
    # and bf16 rounds the two kernels' sums differently (an untrained model's near-tied logits can
    # flip) (2 ranks: the plain weights' evaluate is run B's, the EMA's with TTA on 11 samples the
    # two-host run's)
    if ranks == 1:
        evaluate = [*EVALUATE, "--test_samples", "11", "--checkpoint", out, "--tta"]
        plain = launch(config, evaluate)
        assert evaluated(plain.stdout, ranks, 11) == pytest.approx(
            row["test_acc"], abs=1 / 11 + 1e-4
        )
        ema = launch(config, [*evaluate, "--ema"])
        assert "[EMA] [flip TTA]" in ema.stdout
        assert evaluated(ema.stdout, ranks, 11) == pytest.approx(
            row["test_acc_ema"], abs=1 / 11 + 1e-4
        )


@pytest.mark.launches
@pytest.mark.parametrize("ranks", [1, 2])
def test_run_b_tensorboard_grad_accum_clip_cpu_pipeline(tmp_path, ranks):
    out = tmp_path / "out"
    launch(TOPOLOGY[ranks], [*SMALL, *RUN_B, "--output_dir", out])
    row = check_run(out, ranks=ranks, grad_accum=2, tracker=True, epochs=2)
    # an independent reference: one process, the device pipeline (its augmentation a hash of (seed,
    # epoch, index) on the device, no workers, no sharding), the same global batch: the same weights
    # (a cpu pipeline that augmented epoch 2 like epoch 1 on 2 ranks would end 5e-3 away)
    ref = tmp_path / "ref"
    run_cli(
        [
            *SMALL,
            *RUN_B,
            "--pipeline",
            "device",
            "--num_workers",
            "0",
            "--log_with",
            "",
            "--batch_size",
            str(8 * ranks),
            "--mixed_precision",
            "no",
            "--output_dir",
            ref,
        ]
    )
    a, b = load_file(out / "model.safetensors"), load_file(ref / "model.safetensors")
    assert max((a[k].float() - b[k].float()).abs().max().item() for k in a) <= 1e-4
    cfg = parse_train_args(["--config", str(out / "config.yaml")])
    assert (cfg.grad_accum, cfg.clip_grad, cfg.pipeline, cfg.num_workers) == (2, 1.0, "cpu", 2)
    proc = launch(TOPOLOGY[ranks], [*EVALUATE, "--checkpoint", out])
    assert evaluated(proc.stdout, ranks) == pytest.approx(row["test_acc"], abs=1e-4)
    # no EMA was trained: asking for it is one line
    bad = run_cli([*EVALUATE, "--checkpoint", out, "--ema"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "trained with --ema"
    )


@pytest.mark.hosts
def test_two_hosts_tensorboard_ema_tta_grad_accum_clip_channels_last_bf16(two_hosts, tmp_path):
    config = bf16_config(tmp_path, "2node_cpu.yaml")
    out = tmp_path / "shared_out"
    procs, paths = two_hosts.launch_plain(
        ["--accel_config", config, *SMALL, *HOSTS, "--output_dir", out], tmp_path
    )
    codes = wait_all(procs, timeout=400)
    text = [p.read_text() for p in paths]
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    assert "2 process(es) [DistributedType.MULTI_CPU, bf16]" in text[0]
    assert re.search(r"pipeline cpu: .*\d+ workers? per process: \d+ cores", text[0]), text[0][
        -3000:
    ]
    row = check_run(out, ranks=2, grad_accum=2, ema=True, tracker=True, test_samples=11)
    # evaluate across the two hosts gives the run's own numbers: the EMA, flip TTA, 11 samples on 2
    # ranks
    (tmp_path / "eval").mkdir()
    procs, paths = two_hosts.launch_plain(
        [
            "--accel_config",
            config,
            *EVALUATE,
            "--test_samples",
            "11",
            "--checkpoint",
            out,
            "--tta",
            "--ema",
        ],
        tmp_path / "eval",
    )
    codes = wait_all(procs, timeout=300)
    text = [p.read_text() for p in paths]
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    assert "[EMA] [flip TTA]" in text[0]
    assert evaluated(text[0], 2, 11) == pytest.approx(row["test_acc_ema"], abs=1e-4)


# ---- combinations that are not supported: one line, exit 2, nothing trained ----------------------


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--pipeline", "device", "--num_workers", "2"], "--num_workers 2 needs --pipeline cpu"),
        (
            ["--grad_accum", "16"],
            "--grad_accum 16 needs 16 batches per process and epoch, but there are 8",
        ),
        (["--compile_mode", "fast"], "invalid choice"),
    ],
)
def test_unsupported_combinations_are_one_line(tmp_path, args, fragment):
    proc = run_cli([*SMALL, *args, "--output_dir", tmp_path / "out"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-2000:]
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.launches
def test_missing_tracker_on_two_ranks_is_the_same_line_on_every_rank(tmp_path):
    proc = launch(
        "2proc_cpu.yaml",
        [*SMALL, "--log_with", "wandb", "--output_dir", tmp_path / "out"],
        check=False,
    )
    assert proc.returncode != 0
    errors = {line.strip() for line in proc.stderr.splitlines() if "accel-train: error" in line}
    assert len(errors) == 1 and "tracker(s) wandb did not start" in errors.pop(), proc.stderr[
        -3000:
    ]
    assert "lost contact" not in proc.stderr
