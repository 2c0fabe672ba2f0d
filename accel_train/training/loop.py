"""The training loop. Read this file first.

argv -> TrainConfig -> setup (Accelerator, data, model, optimizer, schedule, accelerator.prepare, resume)
-> epochs of steps -> evaluation -> metrics -> checkpoint -> model.safetensors.

Nothing here asks which device it runs on: devices, DDP wrapping, sampler sharding, mixed precision
and the rendezvous come from the accelerate config the job was launched with.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch
from accelerate.logging import get_logger
from accelerate.utils import tqdm

from ..checkpoint.checkpointer import Checkpointer
from ..config.train_config import TrainConfig
from ..data import set_loader_epoch
from .divergence import NonFiniteWatch
from .evaluate import evaluate
from ..hang import PROGRESS, HangReport
from .metrics import EpochMeter, MetricsLog, Pace
from ..model.create import bare_model
from .exports import BestModel, finish, lr_of_step, model_config, record_epoch
from ..resilience.preempt import AgreedChecks, StopRequest
from .startup import Run, setup
from ..resilience.survivor import Survivor

logger = get_logger("accel_train")


def train(cfg: TrainConfig, given=None) -> dict:
    stop = StopRequest().install()  # SIGTERM / SIGUSR1 / Ctrl-C: every rank stops at one step and checkpoints it
    with HangReport(cfg, stop).start() as hang:  # no progress: where every rank waits (hang.py)
        run = setup(cfg, given)  # given: a script's own model and Datasets (api.train), else None
        accelerator, model, state = run.accelerator, run.model, run.state
        stop.check_start_up(accelerator, state.step)
        metrics = MetricsLog(cfg, accelerator.is_main_process, state, run.history, run.steps_per_epoch, run.done)
        best = BestModel(cfg.output_dir, metrics.rows, accelerator.is_main_process, run.whole_epochs)
        # A plain step makes no host sync and no collective beyond DDP's all-reduce: stop requests and non-finite losses
        # are agreed on at the steps `checks` picks (seconds apart), and where ranks meet anyway (logs, checkpoints).
        watch = NonFiniteWatch(accelerator.device, cfg.output_dir, bare_model(accelerator, model), run.precision)
        checks = AgreedChecks(stop, state.step, cfg.checkpoint_minutes)
        checkpoints = Checkpointer(accelerator, cfg.output_dir, run.run_math, run.decision, model, run.ema,
                                   cfg.keep_checkpoints, model_config(cfg, {}, run), watch, metrics.history)
        progress = tqdm(total=run.total_steps, initial=state.step, desc="train", dynamic_ncols=True)
        pace = Pace(cfg, state.step, run.total_steps, accelerator.is_main_process)  # says early if it takes hours
        run_start = time.perf_counter()
        with Survivor(run, cfg, checkpoints, metrics, stop, hang).guard() as survivor:  # a lost peer: step saved
            while not run.done:
                epoch, only_evaluation = state.epoch, state.batch_in_epoch >= run.batches_per_epoch  # (resumed so)
                model.train()
                meter = checkpoints.meter = epoch_meter(run, cfg, only_evaluation)
                window_loss = torch.zeros((), device=accelerator.device)  # sum of the micro-batch losses of this step
                tick = time.perf_counter()
                for batch in epoch_batches(run, epoch):
                    x, y = run.data.inputs(batch, train=True, epoch=epoch)
                    meter.data_time += time.perf_counter() - tick
                    lr = lr_of_step(run.scheduler, state.step + 1)  # (the classifier's, under --layer_decay)
                    loss, logits, grad_norm, y = train_step(run, x, y, cfg.clip_grad, survivor.lock)
                    meter.update(loss, logits, y)
                    watch.update(loss, state.step + 1, lr)
                    window_loss += loss.detach().float()
                    state.batch_in_epoch += 1
                    if accelerator.sync_gradients:  # an optimizer step happened (train_step took survivor.lock for it)
                        state.step += 1
                        watch.update_weights(state.step, grad_norm)  # (on the device, read at a check)
                        after_step(run, progress, pace)
                        survivor.step_done()  # the step is complete: weights, step, lr, EMA; collectives after
                        last = state.step >= run.total_steps or state.batch_in_epoch >= run.batches_per_epoch
                        if state.step % cfg.log_every == 0 or last:  # the step's loss (mean over micro-batches, ranks)
                            log_step(run, metrics, watch, survivor, window_loss / cfg.grad_accum, lr)
                        window_loss.zero_()
                        if last:
                            break  # --max_steps, or the end of the last whole accumulation window
                        if checks.due(state.step) and checks.agree(accelerator, state.step, watch, checkpoints):
                            raise stop.stopped(f"stopped by {stop.name} at step {state.step} (epoch {epoch + 1}); "
                                            f"checkpoint {checkpoints.save(state)}; continue with --resume auto")
                        if checks.checkpoint_due(state.step, cfg.checkpoint_every):
                            checkpoints.save(state)
                    tick = time.perf_counter()
                watch.check(accelerator, state.step, model)  # the weights too: before the row and export
                row = end_of_epoch(run, cfg, meter, epoch, stop, only_evaluation)
                if row is None:  # a signal during the evaluation: the epoch's steps are saved, its evaluation is redone
                    raise stop.stopped(f"stopped by {stop.name} while evaluating epoch {epoch + 1}; checkpoint "
                                    f"{checkpoints.save(state)}; continue with --resume auto")
                record_epoch(run, cfg, metrics, best, row)  # (none for {}: its training numbers were lost with a peer)
                next_epoch(run, epoch, survivor.lock)
                checkpoints.save(state)  # epoch end, or where --max_steps stopped
        progress.close()
        return finish(run, cfg, metrics, best, time.perf_counter() - run_start, stop)  # outputs; trackers, stop closed


def epoch_meter(run: Run, cfg: TrainConfig, only_evaluation: bool) -> EpochMeter:
    """The epoch's meter; resumed into the middle of the epoch, with the checkpoint's sums of the
    batches before it (TrainState.epoch_sums), or, where it keeps none, said partial in one line
    and in its row."""
    state = run.state
    resumed = 0 < state.batch_in_epoch and not only_evaluation
    partial = resumed and state.epoch_sums is None
    if partial:
        survivor = (run.decision.meta or {}).get("survivor")
        why = "a survivor's save after a lost peer" if survivor else "an earlier accel_train's"
        logger.warning(f"epoch {state.epoch + 1}'s row covers its batches from "
                       f"{state.batch_in_epoch + 1} on only (train_partial): the checkpoint "
                       f"({why}) keeps no training sums of the batches before",
                       main_process_only=not cfg.log_all_ranks)
    return EpochMeter(run.accelerator.device, state.epoch_sums if resumed else None, partial)


def next_epoch(run: Run, epoch: int, lock) -> None:
    """After an epoch's row: the next epoch starts, unless --max_steps stopped this one (epoch and batch change
    together: the survivor reads them under `lock`)."""
    with lock:
        run.state.epoch_train = run.state.epoch_sums = None  # (recorded in the row)
        if run.state.batch_in_epoch >= run.batches_per_epoch:
            run.state.epoch, run.state.batch_in_epoch = epoch + 1, 0


def epoch_batches(run: Run, epoch: int):
    """The epoch's batches in its data order, less those a resumed run already trained on (none at all when only
    the epoch's evaluation is left)."""
    set_loader_epoch(run.train_loader, epoch)  # its sampler's order and its dataset's augmentation
    done = run.state.batch_in_epoch
    if not done:
        return run.train_loader
    if done >= run.batches_per_epoch:
        return []
    # the rest of the epoch is a new loader, which Accelerate before 1.15 starts at epoch 0 (its `iteration`,
    # set on each iter: the resumed epoch would take the first epoch's order and augmentation): given it too
    rest = run.accelerator.skip_first_batches(run.train_loader, done)
    set_loader_epoch(rest, epoch)
    return rest


def after_step(run: Run, progress, pace) -> None:
    """After an optimizer step, before any collective (a lost peer then finds the step whole: survivor.py): the lr of
    the next step (a function of the global step), the EMA, progress."""
    step = run.state.step
    run.scheduler.step_update(step)
    if run.ema is not None:
        run.ema.update(bare_model(run.accelerator, run.model), step=step)
    progress.update(1)
    pace.step_done(step)


def log_step(run: Run, metrics, watch, survivor, loss: torch.Tensor, lr: float) -> None:
    """A logged step (every rank: collectives): the divergence watch is read, the loss averaged over ranks, its row
    written; a lost peer on the way leaves the survivor this rank's loss for the row."""
    survivor.note_row(run.state.step, loss, lr)
    watch.check(run.accelerator, run.state.step)
    metrics.log_step(run.accelerator, run.state.step, loss, lr)


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, clip_grad: float | None = None, lock=None):
    """Forward, backward and (on the last micro-batch of an accumulation) the optimizer step; (loss, logits, the
    gradient's norm before clipping or None, the targets: --mixup/--cutmix's soft ones, else `y`). `lock`
    (survivor.Survivor.lock) is taken before the optimizer step and left held: the loop releases it once the step is
    complete."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    reseed(run)
    if run.mixup is not None:
        x, y = run.mixup(x, y)  # (numpy's draws: reseeded)
    grad_norm = None  # with --clip_grad: the total norm before clipping (the divergence watch reads it)
    with accelerator.accumulate(model):
        with accelerator.autocast():
            logits = model(x)
            loss = run.criterion(logits, y)
        accelerator.backward(loss)
        if clip_grad and accelerator.sync_gradients:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_grad)
        if lock is not None and accelerator.sync_gradients:
            lock.acquire()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    PROGRESS.mark("training", run.state.step + accelerator.sync_gradients)  # (the micro-batch is done: hang.py)
    return loss, logits, grad_norm, y


def draw_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """A 63-bit seed that depends on (seed, optimizer step, micro-batch in its window, rank) and nothing else."""
    digest = hashlib.blake2b(f"{seed}:{step}:{micro_batch}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed(run: Run) -> None:
    """Every random draw of a micro-batch (dropout, drop path; mixup's and cutmix's, which timm draws from numpy's
    global generator) is a function of (seed, step, rank): resume is
    exact without Accelerate's random-state files (which hold no NPU state and do not load across numpy majors).
    torch.manual_seed seeds the CPU generator, every CUDA device and the privateuse1 device (torch_npu's npu) on
    the host, without a device sync."""
    state, accelerator = run.state, run.accelerator
    micro = state.batch_in_epoch % accelerator.gradient_accumulation_steps
    seed = draw_seed(run.run_math["seed"], state.step, micro, accelerator.process_index)
    torch.manual_seed(seed)
    np.random.seed(seed % 2 ** 32)


def end_of_epoch(run: Run, cfg: TrainConfig, meter: EpochMeter, epoch: int, stop=None, only_evaluation=False
                 ) -> dict | None:
    """Reduce the epoch's training sums, evaluate on the whole test split, log one line (None: stopped by a
    signal during the evaluation). `only_evaluation` (resumed after the epoch's last batch): the training numbers are
    the ones the checkpoint kept (TrainState.epoch_train); without them ({}: a peer was lost in their reduce) the
    epoch has no row, never one of zeros."""
    PROGRESS.mark("epoch end", run.state.step)
    if not only_evaluation:
        run.state.epoch_train = meter.result(run.accelerator)  # (kept by every checkpoint until the row is recorded)
    elif run.state.epoch_train is None:
        logger.warning(f"epoch {epoch + 1}'s training numbers are not in the checkpoint (a peer was lost in their "
                       "reduce, or an older accel_train wrote it): no row for it",
                       main_process_only=not cfg.log_all_ranks)
        return {}
    train_stats = run.state.epoch_train
    evaluated = evaluate(run.accelerator, run.model, run.test_loader, run.data, cfg.tta, stop)
    if evaluated is None:
        return None
    preds, labels = evaluated
    row = {"epoch": epoch + 1, "step": run.state.step, **train_stats,
           "test_acc": (preds == labels).float().mean().item(), "test_samples": labels.numel(),
           "lr": lr_of_step(run.scheduler, run.state.step)}  # the lr of the epoch's last step
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
