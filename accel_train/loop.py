"""The training loop. Read this file first.

argv -> TrainConfig -> Accelerator -> data, model, optimizer, schedule -> accelerator.prepare
-> epochs of steps -> evaluation -> metrics -> checkpoint -> model.safetensors.

Nothing here asks which device it runs on: devices, DDP wrapping, sampler sharding, mixed precision
and the rendezvous come from the accelerate config the job was launched with.
"""

from __future__ import annotations

import os
import tempfile
import time
from datetime import timedelta
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (DataLoaderConfiguration, DistributedDataParallelKwargs, InitProcessGroupKwargs,
                              LoggerType, ProjectConfiguration, TorchDynamoPlugin, is_npu_available, set_seed, tqdm)
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3

from . import __version__
from .checkpoint import TrainState, export_model, load_checkpoint, resolve_resume, save_checkpoint
from .config import CIFAR10_CLASSES, CIFAR10_MEAN, CIFAR10_STD, ConfigError, TrainConfig
from .data import Data, build_data
from .metrics import CURVES_FILE, EpochMeter, MetricsLog, NonFiniteWatch, check_trackers, plot_curves
from .model import NUM_CLASSES, create_model

logger = get_logger("accel_train")


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    trackers = [t.strip() for t in cfg.log_with.split(",")] if cfg.log_with else []
    unknown = [t for t in trackers if t not in LoggerType.list()]
    if unknown:
        raise ConfigError(f"--log_with {','.join(unknown)}: not an Accelerate tracker; use one of "
                          f"{', '.join(LoggerType.list())}")
    accelerator = Accelerator(
        # Ranks started on a host without an accelerator join one gloo group only if asked to run on cpu.
        cpu=not (torch.accelerator.is_available() or is_npu_available()),
        gradient_accumulation_steps=cfg.grad_accum,
        # --compile: Accelerate compiles in prepare(), after the DDP wrap (compile last, as it advises)
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=cfg.compile_mode) if cfg.compile else None,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        kwargs_handlers=[
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.timeout_s)),
            DistributedDataParallelKwargs(bucket_cap_mb=cfg.ddp_bucket_cap_mb,
                                          gradient_as_bucket_view=cfg.ddp_grad_as_bucket_view),
        ],
    )
    check_one_group(accelerator.num_processes, cfg)
    return accelerator


def check_one_group(num_processes: int, cfg: TrainConfig, env=os.environ) -> None:
    """Refuse silent duplicate training: N processes launched that each train alone."""
    launched = int(env.get("WORLD_SIZE", 1)) if "TORCHELASTIC_RUN_ID" in env else 1  # torchrun counts ranks
    if launched > 1 and num_processes != launched:
        raise ConfigError(f"the launcher started {launched} processes but they did not join one process group "
                          f"(each sees {num_processes}); on a CPU host set use_cpu: true in the accelerate config "
                          "or ACCELERATE_USE_CPU=1")
    if (cfg.world_size or 1) > 1 and num_processes == 1:
        raise ConfigError(f"--world_size {cfg.world_size} (nodes) but this is a single process: start the job "
                          "with launch.sh (or accelerate launch with a multi-node config), not python directly")


def prepare_output_dir(path) -> Path:
    """Every rank checks it can write there before any work starts."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create output directory {out} ({e.strerror}); pass a writable --output_dir") \
            from None
    try:
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise ConfigError(f"output directory {out} is not writable ({e.strerror}); pass a writable --output_dir") \
            from None
    return out


def tracker_config(cfg: TrainConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))}


@dataclass
class Run:
    """Everything the loop needs, built and prepared; `state` is where training resumes."""
    accelerator: Accelerator
    data: Data
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_loader: object
    test_loader: object
    criterion: torch.nn.Module
    ema: ModelEmaV3 | None
    state: TrainState
    steps_per_epoch: int
    total_steps: int

    @property
    def batches_per_epoch(self) -> int:
        """Micro-batches per rank and epoch: whole accumulation windows only (the rest is dropped)."""
        return self.steps_per_epoch * self.accelerator.gradient_accumulation_steps


def bare_model(accelerator, model) -> torch.nn.Module:
    """The user's module: without torch.compile's wrapper (outermost: compiled last) and without DDP's.

    The compiled wrapper is taken off first: `unwrap_model` given a compiled model re-points its
    `_orig_mod` at the unwrapped module (keep_torch_compile=True, the default), which would silently
    take DDP out of the training model."""
    return accelerator.unwrap_model(getattr(model, "_orig_mod", model))


def wrappers(model) -> str:
    """The wrapping order prepare() produced, e.g. OptimizedModule(DistributedDataParallel(ResNet))."""
    inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
    return f"{type(model).__name__}({wrappers(inner)})" if isinstance(inner, torch.nn.Module) else type(model).__name__


def setup(cfg: TrainConfig) -> Run:
    """Check every input before writing anything, then build, prepare and (maybe) resume."""
    accelerator = make_accelerator(cfg)
    set_seed(cfg.seed)  # before prepare: the seedable sampler takes its seed from here
    out = prepare_output_dir(cfg.output_dir)
    resume_from = resolve_resume(cfg.resume, out)
    data = build_data(cfg, accelerator.device)
    if data.train_size < cfg.batch_size * accelerator.num_processes:
        raise ConfigError(f"{data.train_size} training samples cannot fill one batch of {cfg.batch_size} on each of "
                          f"{accelerator.num_processes} processes; lower --batch_size or add data")
    batches = data.train_size // (cfg.batch_size * accelerator.num_processes)  # per process and epoch
    if batches < cfg.grad_accum:
        raise ConfigError(f"--grad_accum {cfg.grad_accum} needs {cfg.grad_accum} batches per process and epoch, but "
                          f"there are {batches}; lower --grad_accum or --batch_size, or add data")
    model = create_model(cfg.model, cfg.stem, **cfg.model_kwargs_dict())
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = create_optimizer_v2(model, "sgd", lr=cfg.peak_lr(accelerator.num_processes),
                                    weight_decay=cfg.weight_decay, momentum=cfg.momentum)  # nesterov
    model, optimizer, train_loader, test_loader = accelerator.prepare(  # (--compile happens here, last)
        model, optimizer, data.train_loader, data.test_loader)
    ema = ModelEmaV3(bare_model(accelerator, model), decay=cfg.ema_decay, use_warmup=True) if cfg.ema else None

    # An epoch is a whole number of accumulation windows: a partial window at the end would take an
    # optimizer step on fewer micro-batches at the same 1/grad_accum scale, so its micro-batches are
    # dropped (as drop_last drops an incomplete batch).
    steps_per_epoch = len(train_loader) // cfg.grad_accum
    # The lr is a function of the global optimizer step, set with step_update(step): no scheduler
    # object is stepped per process, so num_processes never changes the schedule.
    peak = cfg.peak_lr(accelerator.num_processes)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs,
                                       min_lr=cfg.min_lr, warmup_lr=peak / 100, step_on_epochs=False,
                                       updates_per_epoch=steps_per_epoch)
    state = load_checkpoint(accelerator, resume_from, scheduler, ema) if resume_from else TrainState()
    scheduler.step_update(state.step)
    criterion = LabelSmoothingCrossEntropy(cfg.label_smoothing) if cfg.label_smoothing else torch.nn.CrossEntropyLoss()
    total_steps = min(cfg.max_steps or steps_per_epoch * cfg.epochs, steps_per_epoch * cfg.epochs)

    log = partial(logger.info, main_process_only=not cfg.log_all_ranks)
    if resume_from:
        log(f"resumed from {resume_from}: epoch {state.epoch + 1}, step {state.step}, "
            f"{state.batch_in_epoch} batches into the epoch")
    log(f"accel_train {__version__}: {cfg.model} ({cfg.stem} stem) on {cfg.data}, {data.train_size} train / "
        f"{data.test_size} test samples, {accelerator.num_processes} process(es) [{accelerator.distributed_type}, "
        f"{accelerator.mixed_precision}], global batch {cfg.batch_size * accelerator.num_processes * cfg.grad_accum}"
        f", peak lr {peak:.4g}, {steps_per_epoch} steps/epoch, model {wrappers(model)}")
    if cfg.log_with:  # after every input check: a failed start leaves no new files behind
        trackers = [t.strip() for t in cfg.log_with.split(",")]
        accelerator.init_trackers("accel_train", config=tracker_config(cfg))  # on the main process only
        check_trackers(accelerator, trackers)  # checked there, the verdict sent to every rank
    return Run(accelerator, data, model, optimizer, scheduler, train_loader, test_loader, criterion, ema, state,
               steps_per_epoch, total_steps)


def train(cfg: TrainConfig) -> dict:
    run = setup(cfg)
    accelerator, model, optimizer, state, ema = run.accelerator, run.model, run.optimizer, run.state, run.ema
    metrics = MetricsLog(cfg.output_dir, accelerator.is_main_process, resume_at=state)
    save = partial(save_checkpoint, accelerator, cfg.output_dir, scheduler=run.scheduler, ema=ema,
                   keep=cfg.keep_checkpoints)
    # Non-finite losses are noted on the device every micro-batch and read back only where ranks
    # meet anyway (every --log_every steps, the epoch end, a checkpoint): no host sync per step.
    watch = NonFiniteWatch(accelerator.device, cfg.output_dir)

    def checkpoint(state):  # never a checkpoint of non-finite weights: the last finite one stays newest
        watch.check(accelerator, state.step, model)
        save(state)

    progress = tqdm(total=run.total_steps, initial=state.step, desc="train", dynamic_ncols=True)
    run_start = time.perf_counter()
    window_loss = torch.zeros((), device=accelerator.device)  # sum of the micro-batch losses of this step
    while state.epoch < cfg.epochs and state.step < run.total_steps:
        epoch = state.epoch
        model.train()
        run.train_loader.set_epoch(epoch)  # the epoch's data order; then skip what a resumed run already did
        loader = accelerator.skip_first_batches(run.train_loader, state.batch_in_epoch) if state.batch_in_epoch \
            else run.train_loader
        meter = EpochMeter(accelerator.device)
        tick = time.perf_counter()
        for batch in loader:
            x, y = run.data.inputs(batch, train=True, epoch=epoch)
            meter.data_time += time.perf_counter() - tick
            lr = optimizer.param_groups[0]["lr"]
            loss, logits = train_step(run, x, y, cfg.clip_grad)
            meter.update(loss, logits, y)
            watch.update(loss, state.step + 1, lr)
            window_loss += loss.detach().float()
            state.batch_in_epoch += 1
            if accelerator.sync_gradients:  # an optimizer step happened
                state.step += 1
                if state.step % cfg.log_every == 0:  # the step's loss (mean over its micro-batches and ranks)
                    watch.check(accelerator, state.step)
                    metrics.log_step(accelerator, state.step, window_loss / cfg.grad_accum, lr)
                window_loss.zero_()
                run.scheduler.step_update(state.step)
                if ema is not None:
                    ema.update(bare_model(accelerator, model), step=state.step)
                progress.update(1)
                if state.step >= run.total_steps or state.batch_in_epoch >= run.batches_per_epoch:
                    break  # --max_steps, or the end of the last whole accumulation window
                if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                    checkpoint(state)
            tick = time.perf_counter()

        watch.check(accelerator, state.step)
        row = end_of_epoch(run, cfg, meter, epoch)
        metrics.append(accelerator, row)
        if state.batch_in_epoch >= run.batches_per_epoch:
            state.epoch, state.batch_in_epoch = epoch + 1, 0
        checkpoint(state)  # epoch end, or where --max_steps stopped (a later run can continue from it)
    progress.close()

    summary = finish(accelerator, cfg, model, ema, metrics, time.perf_counter() - run_start, run.steps_per_epoch)
    accelerator.end_training()
    return summary


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, clip_grad: float | None = None):
    """Forward, backward and (on the last micro-batch of an accumulation) the optimizer step."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    with accelerator.accumulate(model):
        with accelerator.autocast():
            logits = model(x)
            loss = run.criterion(logits, y)
        accelerator.backward(loss)
        if clip_grad and accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss, logits


def end_of_epoch(run: Run, cfg: TrainConfig, meter: EpochMeter, epoch: int) -> dict:
    """Reduce the epoch's training sums, evaluate on the whole test split, log one line."""
    train_stats = meter.result(run.accelerator)
    preds, labels = evaluate(run.accelerator, run.model, run.test_loader, run.data, cfg.tta)
    row = {"epoch": epoch + 1, "step": run.state.step, **train_stats,
           "test_acc": (preds == labels).float().mean().item(), "test_samples": labels.numel(),
           "lr": run.optimizer.param_groups[0]["lr"]}
    if run.ema is not None:
        ema_preds, _ = evaluate(run.accelerator, run.ema, run.test_loader, run.data, cfg.tta)
        row["test_acc_ema"] = (ema_preds == labels).float().mean().item()
    logger.info(f"epoch {epoch + 1}/{cfg.epochs} step {row['step']}: train loss {row['train_loss']:.4f} "
                f"acc {row['train_acc']:.2%} | test acc {row['test_acc']:.2%} ({row['test_samples']} samples)"
                + (f" ema {row['test_acc_ema']:.2%}" if run.ema is not None else "")
                + f" | {row['images_per_sec']:.0f} img/s ({row['images_per_sec_per_process']:.0f}/process, "
                f"data wait {row['data_wait_frac']:.0%})", main_process_only=not cfg.log_all_ranks)
    return row


@torch.no_grad()
def evaluate(accelerator, model, loader, data, tta: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions and labels for the whole test split, gathered over ranks, padding removed."""
    model.eval()
    all_preds, all_labels = [], []
    for batch in loader:
        x, y = data.inputs(batch, train=False)
        with accelerator.autocast():
            scores = model(x).float().softmax(1)
            if tta:
                scores = scores + model(x.flip(3)).float().softmax(1)
        preds, y = accelerator.gather_for_metrics((scores.argmax(1), y))
        all_preds.append(preds)
        all_labels.append(y)
    return torch.cat(all_preds).cpu(), torch.cat(all_labels).cpu()


def model_config(cfg: TrainConfig, metrics: dict) -> dict:
    return {"architecture": cfg.model, "stem": cfg.stem, "num_classes": NUM_CLASSES, "input_size": [3, 32, 32],
            "mean": list(CIFAR10_MEAN), "std": list(CIFAR10_STD), "classes": list(CIFAR10_CLASSES),
            "model_kwargs": cfg.model_kwargs_dict(), "metrics": metrics, "accel_train_version": __version__}


def finish(accelerator, cfg, model, ema, metrics, seconds, steps_per_epoch) -> dict:
    """Outputs, written once by the main process: model.safetensors, model_config.json, curves, config."""
    accelerator.wait_for_everyone()
    out = Path(cfg.output_dir)
    last = metrics.rows[-1] if metrics.rows else {}
    summary = {"final_test_acc": last.get("test_acc"), "best_test_acc": max((r["test_acc"] for r in metrics.rows),
                                                                            default=None),
               "epochs_run": len(metrics.rows), "step": last.get("step"), "wall_seconds": seconds,
               "images_per_sec": last.get("images_per_sec")}
    if ema is not None:
        summary["final_test_acc_ema"] = last.get("test_acc_ema")
    if accelerator.is_main_process:
        path = export_model(bare_model(accelerator, model), out, model_config(cfg, summary))
        if ema is not None:
            export_model(ema.module, out, model_config(cfg, summary), filename="model_ema.safetensors")
        cfg.save_yaml(out / "config.yaml")
        curves = cfg.plot and bool(metrics.rows) and plot_curves(metrics.rows, out / CURVES_FILE, metrics.steps(),
                                                                 steps_per_epoch)
        logger.info(f"rank {accelerator.process_index}/{accelerator.num_processes} wrote {path}",
                    main_process_only=False)
        files = ["model.safetensors", "model_config.json", "metrics.jsonl", "steps.jsonl", "config.yaml"]
        files += [CURVES_FILE] * bool(curves) + ["model_ema.safetensors"] * (ema is not None) + ["checkpoints/"]
        logger.info(f"done in {seconds:.0f}s: final test acc {summary['final_test_acc'] or 0:.2%}, best "
                    f"{summary['best_test_acc'] or 0:.2%}, {summary['images_per_sec'] or 0:.0f} img/s | outputs in "
                    f"{out}/: {', '.join(files)}" + (f" | tracker logs: {cfg.log_with}" if cfg.log_with else "")
                    + f" | model {wrappers(model)}")
    accelerator.wait_for_everyone()
    return summary
