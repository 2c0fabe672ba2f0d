"""Flip-TTA moves the evaluated numbers the expected way on a toy case built to show it (through
evaluate.evaluate and the device pipeline), the trainer's EMA is timm's EMA of its optimizer steps,
and the README's recipe (nesterov SGD, no weight decay on norm and bias parameters, label smoothing
0.1, the DDP bucket flags, model_best's choice, --device_data_mb's default) is what the trainer
builds."""

import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.nn as nn
from accelerate import Accelerator
from conftest import TINY, clean_env, launch, launcher_env
from safetensors.torch import load_file
from timm.utils import ModelEmaV3

from accel_train.config.train_config import TrainConfig
from accel_train.data import build_data
from accel_train.files import EMA_FILE
from accel_train.model.create import create_model
from accel_train.training.evaluate import evaluate


@pytest.fixture
def accelerator():
    return Accelerator(cpu=True)  # (per test: an in-process run resets Accelerate's state)


def evaluated_accuracy(accelerator, model, images, labels, tta=False):
    cfg = TrainConfig(batch_size=16)
    data = build_data(
        cfg, accelerator.device, splits={"train": (images, labels), "test": (images, labels)}
    )
    return evaluate(accelerator, model, data.test_loader, data, tta=tta).accuracy()


class PatchSide(nn.Module):
    """Confidently class 0 when the bright patch is on the left; weakly class 1 when it is on the
    right."""

    def forward(self, x):
        left, right = x[..., :16].mean((1, 2, 3)), x[..., 16:].mean((1, 2, 3))
        logits = torch.full((x.shape[0], 10), -20.0)
        logits[:, 0] = 10.0 * (left > right)
        logits[:, 1] = 1.0 * (right > left)
        return logits


def test_flip_tta_recovers_mirrored_images(accelerator):
    images = torch.zeros(32, 3, 32, 32, dtype=torch.uint8)
    images[:16, :, :, :16] = 255  # patch left
    images[16:, :, :, 16:] = 255  # patch right: the same object, mirrored
    labels = torch.zeros(32, dtype=torch.long)
    plain = evaluated_accuracy(accelerator, PatchSide(), images, labels)
    tta = evaluated_accuracy(accelerator, PatchSide(), images, labels, tta=True)
    assert plain == 0.5 and tta == 1.0


def test_a_long_evaluation_shows_a_progress_bar_on_the_main_process_only(
    accelerator, monkeypatch, capsys
):
    import accel_train.training.evaluate as module

    monkeypatch.setattr(module, "BAR_AFTER_S", 0.0)  # (an evaluation past the delay)
    images, labels = (
        torch.zeros(32, 3, 32, 32, dtype=torch.uint8),
        torch.zeros(32, dtype=torch.long),
    )
    data = build_data(
        TrainConfig(batch_size=8),
        accelerator.device,
        splits={"train": (images, labels), "test": (images, labels)},
    )
    evaluate(accelerator, PatchSide(), data.test_loader, data)
    # (its batches counted, then cleared)
    assert "evaluation:   0%|          | 0/4" in capsys.readouterr().err
    monkeypatch.setattr(type(accelerator), "is_main_process", property(lambda self: False))
    evaluate(accelerator, PatchSide(), data.test_loader, data)
    assert "evaluation" not in capsys.readouterr().err


def test_random_datas_default_test_set_is_no_larger_than_its_train_set():
    from accel_train.data import build_data as build

    assert build(TrainConfig(data="random", train_samples=96, batch_size=8), "cpu").test_size == 96
    assert (
        build(
            TrainConfig(data="random", train_samples=96, test_samples=40, batch_size=8), "cpu"
        ).test_size
        == 40
    )


class Ranked(nn.Module):
    """Class c's logit is 9 - c for a bright patch on the left, c for one on the right: every rank
    is known."""

    def forward(self, x):
        left = (x[..., :16].mean((1, 2, 3)) > x[..., 16:].mean((1, 2, 3)))[:, None]
        ranks = torch.arange(10.0).expand(x.shape[0], 10)
        return torch.where(left, 9 - ranks, ranks)


def test_evaluation_gives_each_samples_loss_and_top5_hit(accelerator):
    images = torch.zeros(32, 3, 32, 32, dtype=torch.uint8)
    images[:16, :, :, :16] = 255  # left: class 0 first, class 9 last
    images[16:, :, :, 16:] = 255  # right: class 9 first, class 0 last
    labels = torch.tensor([0] * 8 + [5] * 8 + [9] * 8 + [4] * 8)  # ranks 1, 6, 1, 6 (1-based)
    cfg = TrainConfig(batch_size=16)
    data = build_data(
        cfg, accelerator.device, splits={"train": (images, labels), "test": (images, labels)}
    )
    got = evaluate(accelerator, Ranked(), data.test_loader, data)
    log_p = torch.arange(9.0, -1.0, -1.0).log_softmax(0)  # by rank: the first's, the second's, ...
    expected = torch.cat([-log_p[r].expand(8) for r in (0, 5, 0, 5)])
    assert torch.allclose(got.losses, expected, rtol=1e-5)
    assert got.in_top_k.tolist() == [True] * 8 + [False] * 8 + [True] * 8 + [False] * 8
    row = got.metrics(10)
    assert row["test_loss"] == pytest.approx(expected.mean().item(), rel=1e-5)
    assert row["test_top5"] == 0.5 and row["test_acc"] == 0.5
    assert "test_top5" not in got.metrics(5)  # (5 classes or fewer: top-5 says nothing)
    # flip TTA: the mean of the two distributions; mirrored, every image is as likely left as right
    tta = evaluate(accelerator, Ranked(), data.test_loader, data, tta=True)
    both = torch.logaddexp(log_p, log_p.flip(0)) - torch.log(torch.tensor(2.0))
    assert torch.allclose(tta.losses[:8], -both[0].expand(8), rtol=1e-5)


@pytest.mark.launches
def test_trainers_ema_is_timms_ema_of_each_optimizer_steps_weights(tmp_path):
    """The trainer's own EMA, from a real run: after every optimizer step (not every micro-batch) it
    moves towards that step's weights by timm's warmup decay, and the exported EMA is the last
    one."""
    out = tmp_path / "out"
    launch(
        "cpu.yaml",
        [
            "--train_samples",
            "64",
            "--test_samples",
            "8",
            "--batch_size",
            "8",
            "--epochs",
            "1",
            "--grad_accum",
            "2",
            "--ema",
            "--ema_decay",
            "0.99",
            "--max_steps",
            "4",
            "--checkpoint_every",
            "1",
            "--keep_checkpoints",
            "10",
            "--output_dir",
            out,
        ],
    )
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert [int(p.name.split("_")[1]) for p in ckpts] == [1, 2, 3, 4]
    weights = [load_file(p / "model.safetensors") for p in ckpts]
    emas = [load_file(p / EMA_FILE) for p in ckpts]
    model, reference = create_model("resnet18", "cifar"), create_model("resnet18", "cifar")
    ema = ModelEmaV3(reference, decay=0.99, use_warmup=True)
    ema.module.load_state_dict(emas[0])
    for step in (2, 3, 4):
        model.load_state_dict(weights[step - 1])
        ema.update(model, step=step)
        worst = max(
            (ema.module.state_dict()[k].double() - emas[step - 1][k].double()).abs().max().item()
            for k in emas[step - 1]
        )
        assert worst < 1e-6, (step, worst)
        moved = max(
            (emas[step - 1][k] - weights[step - 1][k]).abs().max().item()
            for k in emas[step - 1]
            if emas[step - 1][k].is_floating_point()
        )
        assert moved > 1e-4, "the EMA is a copy of the weights, not an average"
    exported = load_file(out / "model_ema.safetensors")
    assert exported.keys() == emas[-1].keys() and all(
        torch.equal(exported[k], emas[-1][k]) for k in exported
    )


# ---------------------------------------------------------------------------------------------
# The README's promises about the recipe, checked on the objects the trainer
# builds: a Run from accel_train.training.startup.setup, in this process, with the environment
# `accelerate launch --config_file cpu.yaml` gives
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def built_run(tmp_path, *flags):
    from accelerate.state import AcceleratorState, GradientState

    from accel_train.cli import parse_train_args
    from accel_train.training.startup import setup

    cfg = parse_train_args(
        [
            *TINY,
            "--train_samples",
            "32",
            "--test_samples",
            "8",
            "--batch_size",
            "8",
            "--epochs",
            "2",
            "--output_dir",
            str(tmp_path / "out"),
            *map(str, flags),
        ]
    )
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        with mock.patch.dict(os.environ, launcher_env("cpu.yaml", clean_env()), clear=True):
            yield cfg, setup(cfg)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_sgd_is_nesterov_and_norm_and_bias_parameters_have_no_weight_decay(tmp_path):
    with built_run(tmp_path, "--ema") as (cfg, run):
        optimizer = (
            run.optimizer.optimizer if hasattr(run.optimizer, "optimizer") else run.optimizer
        )
        assert isinstance(optimizer, torch.optim.SGD)
        # docs/training.md
        assert all(g["nesterov"] and g["momentum"] == 0.9 for g in optimizer.param_groups)
        decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
        named = dict(bare(run.model).named_parameters())
        assert {id(p) for p in named.values()} == set(decay)  # every parameter trained, once
        norms = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
        norm_or_bias = {
            f"{name}.{pname}" if name else pname
            for name, m in bare(run.model).named_modules()
            for pname, _ in m.named_parameters(recurse=False)
            if isinstance(m, norms) or pname == "bias"
        }
        assert norm_or_bias and any(n.startswith("bn") or ".bn" in n for n in norm_or_bias)
        assert {n for n, p in named.items() if decay[id(p)] == 0.0} == norm_or_bias, norm_or_bias
        decayed = {decay[id(p)] for n, p in named.items() if n not in norm_or_bias}
        assert decayed == {cfg.optimizer_defaults()[1]} == {5e-4}  # (--opt sgd's default)


def bare(model):
    return getattr(model, "module", model)


def test_the_training_loss_is_label_smoothed_cross_entropy_with_0_1(tmp_path):
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.1, 0.2, 3.0]])
    target = torch.tensor([0, 1])
    logp = torch.log_softmax(logits, -1)
    # (1 - e) * NLL + e * the mean over classes of -log p, e = 0.1 (docs/training.md: label
    # smoothing 0.1)
    expected = (0.9 * -logp[torch.arange(2), target] + 0.1 * -logp.mean(-1)).mean()
    with built_run(tmp_path) as (cfg, run):
        assert cfg.label_smoothing == 0.1
        assert run.criterion(logits, target).item() == pytest.approx(expected.item(), rel=1e-6)
        assert expected.item() == pytest.approx(
            torch.nn.functional.cross_entropy(logits, target, label_smoothing=0.1).item(), rel=1e-6
        )
    with built_run(tmp_path, "--label_smoothing", "0") as (
        cfg,
        run,
    ):
        # off: the plain cross entropy
        assert run.criterion(logits, target).item() == pytest.approx(
            -logp[torch.arange(2), target].mean().item()
        )


def test_ddp_bucket_flags_reach_the_ddp_kwargs_accelerate_passes_to_ddp(tmp_path):
    # Accelerate's prepare_model wraps the model in DDP with accelerator.ddp_handler.to_kwargs()
    # (one process: no DDP) (to_kwargs: the values that differ from the handler's defaults,
    # bucket_cap_mb=25, gradient_as_bucket_view=False, which are DDP's own)
    with built_run(tmp_path) as (cfg, run):
        handler = run.accelerator.ddp_handler
        assert (handler.bucket_cap_mb, handler.gradient_as_bucket_view) == (25, True)
        assert handler.to_kwargs() == {"gradient_as_bucket_view": True}
    with built_run(tmp_path, "--ddp_bucket_cap_mb", "7", "--ddp_grad_as_bucket_view", "false") as (
        cfg,
        run,
    ):
        handler = run.accelerator.ddp_handler
        assert (handler.bucket_cap_mb, handler.gradient_as_bucket_view) == (7, False)
        assert handler.to_kwargs() == {"bucket_cap_mb": 7}


def test_model_best_is_the_first_of_equals_and_the_models_not_the_emas(tmp_path):
    from accel_train.files import BEST_FILE
    from accel_train.training.exports import BestModel, exported_best, record_epoch
    from accel_train.training.metrics import MetricsLog

    with built_run(tmp_path, "--ema") as (cfg, run):
        metrics = MetricsLog(cfg, True, run.state, run.history, steps_per_epoch=run.steps_per_epoch)
        best = BestModel(cfg.output_dir, metrics.rows, True)
        model = bare(run.model)
        run.state.batch_in_epoch = run.batches_per_epoch  # a whole epoch
        with torch.no_grad():
            # "trained": the model moved away from the EMA, which still holds the initial weights
            for p in model.parameters():
                p.mul_(0.5)
        first = {k: v.clone() for k, v in model.state_dict().items()}
        row = {
            "epoch": 1,
            "step": 4,
            "test_acc": 0.5,
            "train_loss": 1.0,
            "train_acc": 0.5,
            "lr": 0.1,
        }
        record_epoch(run, cfg.output_dir, metrics, best, row)
        with torch.no_grad():  # epoch 2: other weights, the same test_acc
            for p in model.parameters():
                p.add_(1.0)
        record_epoch(run, cfg.output_dir, metrics, best, {**row, "epoch": 2, "step": 8})
        # the first of equals
        assert exported_best(cfg.output_dir) == {
            "epoch": 1,
            "step": 4,
            "test_acc": 0.5,
        }
        saved = load_file(tmp_path / "out" / BEST_FILE)
        assert all(torch.equal(saved[k], first[k]) for k in saved)
        ema = run.ema.module.state_dict()
        assert any(not torch.equal(saved[k], ema[k]) for k in saved if saved[k].is_floating_point())


def test_device_data_mb_defaults_to_a_quarter_of_the_free_memory():
    from accel_train.data.load import device_budget

    assert TrainConfig().device_data_mb is None  # automatic by default
    page = os.sysconf("SC_PAGE_SIZE")
    real = os.sysconf

    def sysconf(name):
        return 1000 if name == "SC_AVPHYS_PAGES" else real(name)

    with mock.patch("os.sysconf", sysconf):  # a CPU device: the available physical memory
        assert device_budget(None, "cpu") == 1000 * page // 4
    with mock.patch(
        "torch.accelerator.get_memory_info", create=True, return_value=(8 * 2**30, 80 * 2**30)
    ) as info:
        # an accelerator: a quarter of its free memory
        assert device_budget(None, "cuda:0") == 2 * 2**30
        assert info.call_args.args[0] == torch.device("cuda:0")
    assert device_budget(3, "cpu") == 3 * 2**20  # given: as given


def test_device_budget_without_torch_accelerator_memory_info(monkeypatch):
    """Where torch.accelerator.get_memory_info is missing (older torch within torch>=2.6) or not
    implemented, the budget is not 2**64 bytes (--pipeline auto would decode a whole folder into
    each device): the backend's own mem_get_info answers instead; where nothing measures,
    nothing counts as fitting."""
    from accel_train.data.load import choose_pipeline, device_budget

    monkeypatch.delattr(torch.accelerator, "get_memory_info", raising=False)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    assert device_budget(None, "cuda:0") == 2 * 2**30
    monkeypatch.setattr(
        torch.accelerator,
        "get_memory_info",
        mock.Mock(side_effect=NotImplementedError),
        raising=False,
    )
    assert device_budget(None, "cuda:0") == 2 * 2**30  # (an allocator without it)

    def unknown(device=None):
        raise RuntimeError("no memory info")

    monkeypatch.setattr(torch.cuda, "mem_get_info", unknown)
    assert device_budget(None, "cuda:0") == 0
    pipeline, why = choose_pipeline(TrainConfig(), 3 * 2**20, "cuda:0")
    assert pipeline == "cpu" and "torch cannot measure its free memory here" in why, why
