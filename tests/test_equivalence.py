"""Two ranks with per-rank batch B follow the same trajectory as one rank with batch 2B.

BatchNorm normalises with per-rank batch statistics, so with BN the two runs legitimately differ.
The check therefore runs the real trainer with timm's GroupNorm in place of BatchNorm
(`--model_kwargs '{"norm_layer": "groupnorm1"}'`, on timm's small test ResNet): every other part -
data order, sharding, augmentation, DDP gradient averaging, lr schedule, optimizer, label smoothing
- is the product's.
"""

import json

import pytest
from accelerate.utils import set_seed
from conftest import TINY_GN, launch
from safetensors.torch import load_file

from accel_train.model.create import create_model


def steps_and_weights(out):
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return steps, load_file(out / "model.safetensors")


def run(out, config, batch, *extra, samples="192", max_steps="8"):
    launch(
        config,
        [
            *TINY_GN,
            "--train_samples",
            samples,
            "--test_samples",
            "40",
            "--epochs",
            "2",
            "--batch_size",
            batch,
            "--log_every",
            "1",
            "--output_dir",
            out,
            "--max_steps",
            max_steps,
            *extra,
        ],
    )
    return steps_and_weights(out)


@pytest.mark.core
def test_two_ranks_batch_b_equal_one_rank_batch_2b(one_process_reference, two_rank_reference):
    # the session's reference runs (conftest.reference_args): 1 rank x 32 and 2 ranks x 16, the same
    # flags
    steps1, w1 = steps_and_weights(one_process_reference[0])
    steps2, w2 = steps_and_weights(two_rank_reference[0])
    assert [s["step"] for s in steps1] == [s["step"] for s in steps2] == list(range(1, 25))
    for a, b in zip(steps1, steps2):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    worst = max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)
    assert worst < 1e-5, worst
    # the evaluation's numbers are the same on either world size (each sample counted once)
    rows = [
        [json.loads(r) for r in (ref[0] / "metrics.jsonl").read_text().splitlines()]
        for ref in (one_process_reference, two_rank_reference)
    ]
    assert len(rows[0]) == len(rows[1]) == 3
    for a, b in zip(*rows):
        assert a["test_samples"] == b["test_samples"] == 40, (a, b)
        assert (a["test_acc"], a["test_top5"]) == pytest.approx(
            (b["test_acc"], b["test_top5"]), abs=1e-9
        ), (a, b)
        assert a["test_loss"] == pytest.approx(b["test_loss"], abs=1e-4) and a["test_loss"] > 0, (
            a,
            b,
        )
    # and the tolerance means something: training moved the weights far more than 1e-5
    set_seed(42)  # the trainer's default seed, set before it builds the model
    init = create_model(TINY_GN[1], "imagenet", norm_layer="groupnorm1").state_dict()
    assert max((w1[k].double() - init[k].double()).abs().max().item() for k in w1) > 1e-3
    assert abs(steps1[0]["loss"] - steps1[-1]["loss"]) > 1e-3


@pytest.mark.launches
def test_two_ranks_batch_b_grad_accum_2_equal_one_rank_batch_4b(tmp_path):
    # 224 samples: 1 rank x 64 takes 3 steps an epoch; 2 ranks x 16 have 7 micro-batches each, i.e.
    # 3 whole accumulation windows and one left over, which is dropped (a partial window would weigh
    # less).
    steps1, w1 = run(tmp_path / "one", "cpu.yaml", "64", samples="224", max_steps="6")
    steps2, w2 = run(
        tmp_path / "two", "2proc_cpu.yaml", "16", "--grad_accum", "2", samples="224", max_steps="6"
    )
    # two epochs of 3
    assert [s["step"] for s in steps1] == [s["step"] for s in steps2] == list(range(1, 7))
    for a, b in zip(steps1, steps2):  # the step's loss: mean over its micro-batches and ranks
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
    worst = max((w1[k].double() - w2[k].double()).abs().max().item() for k in w1)
    assert worst < 1e-5, worst
    assert abs(steps1[0]["loss"] - steps1[-1]["loss"]) > 1e-3
