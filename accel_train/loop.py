"""The training loop. Read this file first.

argv -> TrainConfig -> Accelerator -> data, model, optimizer, schedule -> accelerator.prepare
-> epochs of steps -> evaluation -> metrics -> checkpoint -> model.safetensors.

Nothing here asks which device it runs on: devices, DDP wrapping, sampler sharding, mixed precision
and the rendezvous come from the accelerate config the job was launched with.
"""

from __future__ import annotations

import hashlib
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
                              LoggerType, ProjectConfiguration, TorchDynamoPlugin, broadcast_object_list,
                              is_npu_available, set_seed, tqdm)
from timm.loss import LabelSmoothingCrossEntropy
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3

from . import __version__
from .checkpoint import (BEST_FILE, BestModel, TrainState, export_model, load_checkpoint, load_ema, read_history,
                         save_checkpoint)
from .config import ConfigError, Preempted, TrainConfig
from .data import Data, DataInfo, build_data, device_budget
from .evaluate import evaluate
from .hardware import DeviceFacts, channels_last_default, choose_precision, compile_problem, device_facts
from .metrics import CURVES_FILE, EpochMeter, MetricsLog, NonFiniteWatch, Pace, check_trackers, plot_curves
from .model import cifar_stem_fits, create_model, init_normalisation, init_stem, load_init_weights
from .preempt import AgreedChecks, StopRequest
from .resume import (Decision, batches_done, check_data, decide, on_every_rank, reconcile, said_once,
                     same_everywhere)

logger = get_logger("accel_train")


def asked_precision(cfg: TrainConfig, env=os.environ) -> tuple[str | None, str]:
    """The precision asked for and where: the trainer's flag, else the launcher's config, else nothing."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision, f"--mixed_precision {cfg.mixed_precision}"
    launched = env.get("ACCELERATE_MIXED_PRECISION")  # accelerate launch sets it from the config (or its flag)
    if launched:
        return launched.lower(), f"the accelerate config's mixed_precision: '{launched.lower()}'"
    return None, ""


def make_accelerator(cfg: TrainConfig, facts: DeviceFacts | None = None) -> Accelerator:
    if is_npu_available():
        hccl_timeouts(cfg.timeout_s)
    trackers = [t.strip() for t in cfg.log_with.split(",")] if cfg.log_with else []
    unknown = [t for t in trackers if t not in LoggerType.list()]
    if unknown:
        raise ConfigError(f"--log_with {','.join(unknown)}: not an Accelerate tracker; use one of "
                          f"{', '.join(LoggerType.list())}")
    # Ranks started on a host without an accelerator join one gloo group only if asked to run on cpu.
    cpu = not (torch.accelerator.is_available() or is_npu_available())
    facts = facts or device_facts(cpu=True if cpu else None)
    choice = choose_precision(facts, *asked_precision(cfg), force=cfg.force_precision)  # README: Precision
    refusal = choice.error or (compile_problem(facts.kind) if cfg.compile else None)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision="no" if refusal else choice.precision,
        gradient_accumulation_steps=cfg.grad_accum,
        # --compile: Accelerate compiles in prepare(), after the DDP wrap (compile last, as it advises)
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", mode=cfg.compile_mode) if cfg.compile else None,
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),  # (pinned batches)
        kwargs_handlers=[  # the collective timeout on every backend; no backend named (Accelerate forces hccl on
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.timeout_s)),  # NPU and refuses any other name)
            DistributedDataParallelKwargs(bucket_cap_mb=cfg.ddp_bucket_cap_mb,
                                          gradient_as_bucket_view=cfg.ddp_grad_as_bucket_view),
        ],
    )
    with said_once(accelerator):  # the same facts on every rank: one line
        if refusal:
            raise ConfigError(refusal)
    check_one_group(accelerator.num_processes, cfg)
    accelerator.device_facts = facts
    logger.info(choice.reason, main_process_only=not cfg.log_all_ranks)
    return accelerator


# HCCL's own timeouts (CANN environment variables HCCL_CONNECT_TIMEOUT, default 120 s, 120..7200, and
# HCCL_EXEC_TIMEOUT, default 1836 s, a multiple of 68 on 910A); torch_npu asks for a process-group timeout above
# both, else which timeout ends a job whose peer died is left to chance. Unset ones are set below --timeout_s,
# as launch.sh does (hccl_timeouts there: the same rule, tests/test_platform_faults.py checks they agree).
HCCL_TIMEOUTS = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")


def derived_hccl_timeouts(timeout_s: int) -> tuple[int, int]:
    """(connect, exec) for --timeout_s: three quarters of it, connect within 120..7200, exec a multiple of 68."""
    budget = timeout_s * 3 // 4
    return min(max(budget, 120), 7200), max(budget // 68 * 68, 68)


def hccl_timeouts(timeout_s: int, env=os.environ) -> None:
    """On NPU, before the process group exists: HCCL's timeouts below --timeout_s. Unset ones are set here (HCCL
    reads them when it builds its communicator, in this process); ones the user set must already be below."""
    for name, derived in zip(HCCL_TIMEOUTS, derived_hccl_timeouts(timeout_s)):
        text = env.get(name, "").strip()
        if text and not text.isdigit():
            raise ConfigError(f"{name}={text!r} is not a number of seconds; unset it (it is then set from "
                              "--timeout_s) or give an integer below --timeout_s")
        value = int(text) if text else derived
        if value >= timeout_s:
            source = f"set to {text}" if text else "its least value"
            raise ConfigError(f"--timeout_s {timeout_s} must be above {name} ({value} s, {source}): a dead peer "
                              f"would be found by HCCL's timeout or not at all; raise --timeout_s above {value}"
                              + (f" or set {name} below {timeout_s}" if text else ""))
        env[name] = str(value)


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
    decision: Decision           # who writes checkpoints, where training resumed from
    math: dict                   # the run's math, recorded in every checkpoint (elastic resume checks it)
    history: dict | None         # metrics rows of the checkpoint resumed from
    best: BestModel | None = None  # the best epoch so far and whether its weights are in model_best.safetensors

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
    """The wrapping order prepare() produced, e.g. "OptimizedModule(DDP wrapper(ResNet))"."""
    inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
    return f"{type(model).__name__}({wrappers(inner)})" if isinstance(inner, torch.nn.Module) else type(model).__name__


def setup(cfg: TrainConfig) -> Run:
    """Check every input before writing anything, agree on one resume decision, then build, prepare, resume."""
    accelerator = make_accelerator(cfg)
    log = partial(logger.info, main_process_only=not cfg.log_all_ranks)
    if cfg.channels_last is None:  # the memory format where it is measured faster (hardware.channels_last_default)
        cfg.channels_last, why = channels_last_default(accelerator.device_facts.kind)  # (in place: the run's value)
        log(f"memory format {why}")
    out = on_every_rank(accelerator, prepare_output_dir, cfg.output_dir)
    with said_once(accelerator):
        decision = decide(accelerator, cfg, out, log)  # flags agree, who writes, which checkpoint (copied if needed)
        if decision.meta:
            reconcile(decision.meta, cfg, accelerator.num_processes, log)  # may derive the per-process batch
    set_seed(cfg.seed)  # before prepare: the seedable sampler takes its seed from here
    budget = broadcast_object_list([device_budget(cfg, accelerator.device)])[0]  # rank 0's: one pipeline choice
    if cfg.init_from and (cfg.mean is None or cfg.std is None):  # fine-tuning keeps the weights' normalisation
        mean, std, source = on_every_rank(accelerator, init_normalisation, cfg.init_from, cfg.model)
        if mean is not None:
            cfg.mean, cfg.std = cfg.mean or ",".join(map(str, mean)), cfg.std or ",".join(map(str, std))
            log(f"--init_from: mean/std {cfg.mean} / {cfg.std} from {source} (pass --mean/--std to override)")
    data = on_every_rank(accelerator, build_data, cfg, accelerator.device, budget=budget)
    if cfg.stem == "auto" and cfg.init_from and init_stem(cfg.init_from):  # fine-tuning keeps the weights' stem
        cfg.stem = init_stem(cfg.init_from)
        log(f"--init_from: stem {cfg.stem}, as the weights were trained (pass --stem to override)")
    resolved = cfg.resolve(data.info, data.pipeline, cifar_stem_fits(cfg.model))  # image size, stem, mean/std, ...
    same_everywhere(accelerator, "the data (training / test samples, classes)",
                    (data.train_size, data.test_size, data.info.classes))
    with said_once(accelerator):
        if decision.meta:
            check_data(decision.meta, data.train_size)
        if data.train_size < cfg.batch_size * accelerator.num_processes:
            raise ConfigError(f"{data.train_size} training samples cannot fill one batch of {cfg.batch_size} on each "
                              f"of {accelerator.num_processes} processes; lower --batch_size or add data")
        batches = data.train_size // (cfg.batch_size * accelerator.num_processes)  # per process and epoch
        if batches < cfg.grad_accum:
            raise ConfigError(f"--grad_accum {cfg.grad_accum} needs {cfg.grad_accum} batches per process and epoch, "
                              f"but there are {batches}; lower --grad_accum or --batch_size, or add data")
        model = create_model(cfg.model, cfg.stem, num_classes=data.info.num_classes, **cfg.model_kwargs_dict())
    loaded = on_every_rank(accelerator, load_init_weights, model, cfg.init_from) if cfg.init_from else None
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = create_optimizer_v2(model, "sgd", lr=cfg.peak_lr(accelerator.num_processes),
                                    weight_decay=cfg.weight_decay, momentum=cfg.momentum)  # nesterov
    model, optimizer, train_loader, test_loader = accelerator.prepare(  # (--compile happens here, last)
        model, optimizer, data.train_loader, data.test_loader)

    # An epoch is a whole number of accumulation windows: a partial window at the end would take an
    # optimizer step on fewer micro-batches at the same 1/grad_accum scale, so its micro-batches are
    # dropped (as drop_last drops an incomplete batch).
    steps_per_epoch = len(train_loader) // cfg.grad_accum
    # The lr is a function of the global optimizer step and the current flags, set with step_update(step):
    # no scheduler object is stepped per process, so num_processes never changes the schedule.
    peak = cfg.peak_lr(accelerator.num_processes)
    scheduler, _ = create_scheduler_v2(optimizer, "cosine", num_epochs=cfg.epochs, warmup_epochs=cfg.warmup_epochs,
                                       min_lr=cfg.min_lr, warmup_lr=peak / 100, step_on_epochs=False,
                                       updates_per_epoch=steps_per_epoch)
    state, history = TrainState(run_id=decision.run_id), None
    if decision.resume_from:
        state = load_checkpoint(accelerator, decision.resume_from)
        state.batch_in_epoch = batches_done(decision.meta, cfg.batch_size, accelerator.num_processes)
        history = read_history(decision.resume_from)
    scheduler.step_update(state.step)
    # the EMA starts from the weights training continues from, then takes the checkpoint's EMA if it has one
    ema = ModelEmaV3(bare_model(accelerator, model), decay=cfg.ema_decay, use_warmup=True) if cfg.ema else None
    if ema is not None and decision.resume_from and not load_ema(ema, decision.resume_from, accelerator.device):
        log(f"{decision.resume_from} has no EMA weights: the EMA starts from the resumed weights")
    criterion = LabelSmoothingCrossEntropy(cfg.label_smoothing) if cfg.label_smoothing else torch.nn.CrossEntropyLoss()
    total_steps = min(cfg.max_steps or steps_per_epoch * cfg.epochs, steps_per_epoch * cfg.epochs)
    glob = cfg.batch_size * accelerator.num_processes * cfg.grad_accum
    math_ = dict(global_batch=glob, batch_size=cfg.batch_size, num_processes=accelerator.num_processes,
                 num_machines=decision.num_machines, grad_accum=cfg.grad_accum, epochs=cfg.epochs, seed=cfg.seed,
                 model=cfg.model, stem=cfg.stem, model_kwargs=cfg.model_kwargs_dict(), data=cfg.data,
                 train_size=data.train_size, image_size=cfg.image_size, mean=list(data.info.mean),
                 std=list(data.info.std), augment=cfg.augment, hflip=cfg.hflip)

    if decision.resume_from:
        log(f"resumed from {decision.resume_from}: epoch {state.epoch + 1}, step {state.step}, "
            f"{state.batch_in_epoch} batches into the epoch")
    log(f"accel_train {__version__}: {cfg.model} ({cfg.stem} stem) on {cfg.data}, {data.train_size} train / "
        f"{data.test_size} test samples, {accelerator.num_processes} process(es) [{accelerator.distributed_type}, "
        f"{accelerator.mixed_precision}] on {decision.num_machines} machine(s), global batch {glob}, peak lr "
        f"{peak:.4g}, {steps_per_epoch} steps/epoch, model {wrappers(model)}; checkpoints: "
        + ("one copy in the shared output dir" if decision.shared else "a whole copy on each machine's disk"))
    log(data.describe())
    log(resolved)
    if loaded:
        log(loaded)
    if cfg.log_with:  # after every input check: a failed start leaves no new files behind
        trackers = [t.strip() for t in cfg.log_with.split(",")]
        accelerator.init_trackers("accel_train", config=tracker_config(cfg))  # on the main process only
        check_trackers(accelerator, trackers)  # checked there, the verdict sent to every rank
    return Run(accelerator, data, model, optimizer, scheduler, train_loader, test_loader, criterion, ema, state,
               steps_per_epoch, total_steps, decision, math_, history)


def train(cfg: TrainConfig) -> dict:
    stop = StopRequest().install()  # SIGTERM / SIGUSR1 / Ctrl-C: every rank stops at one step and checkpoints it
    run = setup(cfg)
    accelerator, model, optimizer, state, ema = run.accelerator, run.model, run.optimizer, run.state, run.ema
    if stop.should_stop(accelerator):  # during start-up: nothing new to save
        raise Preempted(f"stopped by {stop.name} during start-up, before step {state.step + 1}")
    metrics = MetricsLog(cfg.output_dir, accelerator.is_main_process, resume_at=state, history=run.history)
    run.best = BestModel(cfg.output_dir, metrics.rows, accelerator.is_main_process)
    save = partial(save_checkpoint, accelerator, cfg.output_dir, run=run.math, writer=run.decision.writer,
                   shared=run.decision.shared, model=model, ema=ema, keep=cfg.keep_checkpoints,
                   facts=model_config(cfg, {}, run.data.info))
    # A plain step makes no host sync and no collective (beyond DDP's gradient all-reduce). Stop requests and
    # non-finite losses (noted on the device every micro-batch) are agreed on at the steps `checks` picks (every
    # few seconds of work), and the watch is also read where ranks meet anyway (logging, epoch end, checkpoints).
    watch = NonFiniteWatch(accelerator.device, cfg.output_dir)
    checks = AgreedChecks(stop, state.step)

    def checkpoint(state):  # never a checkpoint of non-finite weights: the last finite one stays newest
        watch.check(accelerator, state.step, model)
        return save(state, history=metrics.history())

    progress = tqdm(total=run.total_steps, initial=state.step, desc="train", dynamic_ncols=True)
    pace = Pace(cfg, state.step, run.total_steps, accelerator.is_main_process)  # says early if it takes hours
    run_start = time.perf_counter()
    window_loss = torch.zeros((), device=accelerator.device)  # sum of the micro-batch losses of this step
    # (an epoch whose steps are all done but whose evaluation was interrupted is finished first)
    while state.epoch < cfg.epochs and (state.step < run.total_steps
                                        or state.batch_in_epoch >= run.batches_per_epoch):
        epoch = state.epoch
        model.train()
        run.train_loader.set_epoch(epoch)  # the epoch's data order; then skip what a resumed run already did
        loader = run.train_loader
        if state.batch_in_epoch:  # (all of the epoch's steps, when only its evaluation is left)
            loader = accelerator.skip_first_batches(loader, state.batch_in_epoch) \
                if state.batch_in_epoch < run.batches_per_epoch else []
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
                last = state.step >= run.total_steps or state.batch_in_epoch >= run.batches_per_epoch
                if state.step % cfg.log_every == 0 or last:  # the step's loss (mean over micro-batches and ranks)
                    watch.check(accelerator, state.step)
                    metrics.log_step(accelerator, state.step, window_loss / cfg.grad_accum, lr)
                window_loss.zero_()
                run.scheduler.step_update(state.step)
                if ema is not None:
                    ema.update(bare_model(accelerator, model), step=state.step)
                progress.update(1)
                pace.step_done(state.step)
                if last:
                    break  # --max_steps, or the end of the last whole accumulation window
                if checks.due(state.step) and checks.agree(accelerator, state.step, watch):
                    raise Preempted(f"stopped by {stop.name} at step {state.step} (epoch {epoch + 1}); checkpoint "
                                    f"{checkpoint(state)}; continue with --resume auto")
                if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                    checkpoint(state)
            tick = time.perf_counter()

        watch.check(accelerator, state.step)
        row = end_of_epoch(run, cfg, meter, epoch, stop)
        if row is None:  # a signal during the evaluation: the epoch's steps are saved, its evaluation is redone
            raise Preempted(f"stopped by {stop.name} while evaluating epoch {epoch + 1}; checkpoint "
                            f"{checkpoint(state)}; continue with --resume auto")
        record_epoch(run, cfg, metrics, row)
        if state.batch_in_epoch >= run.batches_per_epoch:
            state.epoch, state.batch_in_epoch = epoch + 1, 0
        checkpoint(state)  # epoch end, or where --max_steps stopped
    progress.close()
    stop.uninstall()

    summary = finish(accelerator, cfg, model, ema, metrics, time.perf_counter() - run_start, run.steps_per_epoch,
                     run.data.info, run=run)
    accelerator.end_training()
    return summary


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, clip_grad: float | None = None):
    """Forward, backward and (on the last micro-batch of an accumulation) the optimizer step."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    reseed(run)
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


def draw_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """A 63-bit seed that depends on (seed, optimizer step, micro-batch in its window, rank) and nothing else."""
    digest = hashlib.blake2b(f"{seed}:{step}:{micro_batch}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed(run: Run) -> None:
    """Every random draw of a micro-batch (dropout, drop path) is a function of (seed, step, rank): resume is
    exact without Accelerate's random-state files (which hold no NPU state and do not load across numpy majors).
    torch.manual_seed seeds the CPU generator, every CUDA device and the privateuse1 device (torch_npu's npu) on
    the host, without a device sync."""
    state, accelerator = run.state, run.accelerator
    micro = state.batch_in_epoch % accelerator.gradient_accumulation_steps
    torch.manual_seed(draw_seed(run.math["seed"], state.step, micro, accelerator.process_index))


def end_of_epoch(run: Run, cfg: TrainConfig, meter: EpochMeter, epoch: int, stop=None) -> dict | None:
    """Reduce the epoch's training sums, evaluate on the whole test split, log one line (None: stopped by a
    signal during the evaluation)."""
    train_stats = meter.result(run.accelerator)
    evaluated = evaluate(run.accelerator, run.model, run.test_loader, run.data, cfg.tta, stop)
    if evaluated is None:
        return None
    preds, labels = evaluated
    row = {"epoch": epoch + 1, "step": run.state.step, **train_stats,
           "test_acc": (preds == labels).float().mean().item(), "test_samples": labels.numel(),
           "lr": run.optimizer.param_groups[0]["lr"]}
    if run.ema is not None:
        ema_evaluated = evaluate(run.accelerator, run.ema, run.test_loader, run.data, cfg.tta, stop)
        if ema_evaluated is None:
            return None
        row["test_acc_ema"] = (ema_evaluated[0] == labels).float().mean().item()
    logger.info(f"epoch {epoch + 1}/{cfg.epochs} step {row['step']}: train loss {row['train_loss']:.4f} "
                f"acc {row['train_acc']:.2%} | test acc {row['test_acc']:.2%} ({row['test_samples']} samples)"
                + (f" ema {row['test_acc_ema']:.2%}" if run.ema is not None else "")
                + f" | {row['images_per_sec']:.0f} img/s ({row['images_per_sec_per_process']:.0f}/process, "
                f"data wait {row['data_wait_frac']:.0%})", main_process_only=not cfg.log_all_ranks)
    return row


def record_epoch(run: Run, cfg: TrainConfig, metrics: MetricsLog, row: dict) -> None:
    """The epoch's row to metrics.jsonl and the trackers; a new best test_acc is exported (main process) as
    model_best.safetensors, with its epoch, step and test_acc in the file's metadata."""
    metrics.append(run.accelerator, row)
    if run.best.improves(row) and run.accelerator.is_main_process:
        best = {k: row[k] for k in ("epoch", "step", "test_acc")}
        export_model(bare_model(run.accelerator, run.model), cfg.output_dir, model_config(cfg, best, run.data.info),
                     filename=BEST_FILE, extra=best, write_config=False)
    run.best.take(row)


def lr_curve(scheduler, total_steps: int, points: int = 2000) -> list[dict]:
    """The lr each step trained with, from the schedule itself (a function of the step): step k used the lr set
    after k - 1 steps. At most `points` points."""
    stride = max(1, total_steps // points)
    return [{"step": k, "lr": scheduler._get_lr(k - 1)[0]} for k in range(1, total_steps + 1, stride)]


def compile_summary() -> str:
    """What torch.compile compiled in this process (dynamo's counters). Training drops incomplete batches and
    evaluation pads its last one, so there are two: training (train mode, gradients) and evaluation."""
    from torch._dynamo.utils import counters
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["ok"]  # (DDP's graph breaks add frames)
    return (f"torch.compile compiled {graphs} graph(s) (train, eval) from {frames} traced frame(s)"
            + ("" if graphs <= 2 else "; more than expected: TORCH_LOGS=recompiles shows why"))


def model_config(cfg: TrainConfig, metrics: dict, info: DataInfo) -> dict:
    return {"architecture": cfg.model, "stem": cfg.stem, **info.model_config(), "model_kwargs": cfg.model_kwargs_dict(),
            "metrics": metrics, "accel_train_version": __version__}


def finish(accelerator, cfg, model, ema, metrics, seconds, steps_per_epoch, info: DataInfo, run: Run = None) -> dict:
    """Outputs, written once by the main process: model.safetensors, model_config.json, curves, config."""
    accelerator.wait_for_everyone()
    if cfg.compile:
        logger.info(f"rank {accelerator.process_index}: {compile_summary()}", main_process_only=not cfg.log_all_ranks)
    out = Path(cfg.output_dir)
    last = metrics.rows[-1] if metrics.rows else {}
    summary = {"final_test_acc": last.get("test_acc"), "best_test_acc": max((r["test_acc"] for r in metrics.rows),
                                                                            default=None),
               "epochs_run": len(metrics.rows), "step": last.get("step"), "wall_seconds": seconds,
               "images_per_sec": last.get("images_per_sec")}
    if ema is not None:
        summary["final_test_acc_ema"] = last.get("test_acc_ema")
    best = run.best if run is not None else None
    if best is not None and best.row is not None:
        summary["best_epoch"], summary["best_step"] = best.row["epoch"], best.row["step"]
    if accelerator.is_main_process:
        path = export_model(bare_model(accelerator, model), out, model_config(cfg, summary, info))
        if ema is not None:
            export_model(ema.module, out, model_config(cfg, summary, info), filename="model_ema.safetensors")
        cfg.save_yaml(out / "config.yaml")
        curves = cfg.plot and bool(metrics.rows) and plot_curves(
            metrics.rows, out / CURVES_FILE, metrics.steps(), steps_per_epoch,
            lr_steps=lr_curve(run.scheduler, metrics.rows[-1]["step"]) if run is not None else None)
        logger.info(f"rank {accelerator.process_index}/{accelerator.num_processes} wrote {path}",
                    main_process_only=False)
        files = ["model.safetensors", "model_config.json", "metrics.jsonl", "steps.jsonl", "config.yaml"]
        files += [CURVES_FILE] * bool(curves) + ["model_ema.safetensors"] * (ema is not None) + ["checkpoints/"]
        files += [BEST_FILE] * bool(best is not None and best.on_disk)
        if best is not None and best.row is not None and not best.on_disk:
            logger.warning(f"the best epoch ({best.row['epoch']}, test acc {best.row['test_acc']:.2%}) was trained "
                           f"before a resume and its {BEST_FILE} is not on this disk: no later epoch beat it")
        best_at = f" (epoch {summary['best_epoch']})" if "best_epoch" in summary else ""
        logger.info(f"done in {seconds:.0f}s: final test acc {summary['final_test_acc'] or 0:.2%}, best "
                    f"{summary['best_test_acc'] or 0:.2%}{best_at}, {summary['images_per_sec'] or 0:.0f} img/s | "
                    f"outputs in "
                    f"{out}/: {', '.join(files)}" + (f" | tracker logs: {cfg.log_with}" if cfg.log_with else "")
                    + f" | model {wrappers(model)}")
    accelerator.wait_for_everyone()
    return summary
