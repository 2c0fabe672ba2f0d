"""The training loop. Read this file first.

argv -> TrainConfig -> startup (Accelerator, data, model, optimizer, schedule, prepare, resume) ->
epochs of steps -> evaluation -> metrics -> checkpoint -> model.safetensors.

Nothing here asks which device it runs on: devices, DDP wrapping, sampler sharding, mixed precision
and the rendezvous come from the accelerate config the job was launched with.

The loop's moments and who answers them: a micro-batch done (the epoch's meter, the divergence
watch's loss); a step applied (the weights, step, lr and EMA change under the survivor's lock, then
the divergence watch's weights, the pace); a step logged; an agreed check (a stop agreed, the
divergence watch read); a checkpoint due; an epoch's end (EpochEnd). A plain step makes no host
sync and no collective beyond DDP's all-reduce.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

import numpy as np
import torch
from accelerate.logging import get_logger
from accelerate.utils import tqdm

from ..checkpoint.checkpointer import Checkpointer
from ..config.resolved import NOTHING_TAKEN, Taken
from ..config.train_config import TrainConfig
from ..data import set_loader_epoch
from ..hang import PROGRESS, HangReport
from ..model.create import bare_model
from ..resilience.preempt import AgreedChecks, StopRequest
from ..resilience.survivor import Survivor
from .divergence import NonFiniteWatch
from .evaluate import evaluate
from .exports import BestModel, finish, lr_of_step, model_config, record_epoch
from .metrics import EpochMeter, MetricsLog, Pace
from .startup import Run, setup

logger = get_logger("accel_train")


def train(cfg: TrainConfig, given=None, taken: Taken = NOTHING_TAKEN) -> dict:
    """`cfg`: what was asked (only read); `given`: a script's own model and Datasets (api.train);
    `taken`: what the command line took from a resumed run's record (cli.py)."""
    stop = StopRequest().install()  # SIGTERM / SIGUSR1 / Ctrl-C: every rank stops at one step
    with HangReport(cfg, stop).start() as hang:  # no progress: where every rank waits (hang.py)
        # given: a script's own model and Datasets (api.train), else None
        run = setup(cfg, given, taken)
        cfg = run.config  # the run's settings: what was asked, with what start-up resolved
        stop.check_start_up(run.accelerator, run.state.step)
        parts = Parts.of(run, cfg, stop)
        started = time.perf_counter()
        with Survivor(run, cfg, parts.checkpoints, parts.metrics, stop, hang).guard() as survivor:
            while not run.done and not early_stop(cfg, parts):
                epoch = run.state.epoch
                # (resumed after the epoch's last batch: only its evaluation is left)
                only_evaluation = run.state.batch_in_epoch >= run.batches_per_epoch
                meter = parts.checkpoints.meter = epoch_meter(run, cfg, only_evaluation)
                train_epoch(run, cfg, parts, survivor, meter, epoch)
                parts.watch.check(run.accelerator, run.state.step, run.model)  # the weights too
                end = end_of_epoch(run, cfg, meter, epoch, stop, only_evaluation)
                if end.stopped:  # the epoch's steps are saved; its evaluation is done again
                    who, saved = stop.name, parts.checkpoints.save(run.state)  # (who: before)
                    raise stop.stopped(
                        f"stopped by {who} while evaluating epoch "
                        f"{epoch + 1}; checkpoint {saved}; continue with "
                        "--resume auto"
                    )
                record_epoch(run, cfg.output_dir, parts.metrics, parts.best, end.row)
                next_epoch(run, epoch, survivor.lock)
                parts.checkpoints.save(run.state)  # the epoch's end, or where --max_steps stopped
        parts.progress.close()
        return finish(run, cfg, parts.metrics, parts.best, time.perf_counter() - started, stop)


def early_stop(cfg: TrainConfig, parts: Parts) -> bool:
    """--patience spent: said once, and the run finishes as a whole one does (exit 0)."""
    said = parts.best.out_of_patience(cfg.patience, parts.metrics.rows)
    if said:
        logger.info(said, main_process_only=not cfg.log_all_ranks)
    return said is not None


@dataclass
class Parts:
    """What the loop's moments call, built once the run is set up."""

    stop: StopRequest
    metrics: MetricsLog
    best: BestModel
    watch: NonFiniteWatch  # the divergence watch: read at the agreed checks and logged steps
    checks: AgreedChecks  # the steps, seconds apart, at which the ranks agree on a stop
    checkpoints: Checkpointer
    progress: object  # accelerate's tqdm bar
    pace: Pace  # says early if the run takes hours

    @classmethod
    def of(cls, run: Run, cfg: TrainConfig, stop: StopRequest) -> Parts:
        acc, state = run.accelerator, run.state
        metrics = MetricsLog(
            cfg, acc.is_main_process, state, run.history, run.steps_per_epoch, run.done
        )
        best = BestModel(cfg.output_dir, metrics.rows, acc.is_main_process, run.whole_epochs)
        watch = NonFiniteWatch(
            acc.device, cfg.output_dir, bare_model(acc, run.model), run.precision
        )
        checkpoints = Checkpointer(
            acc,
            cfg.output_dir,
            run.run_math,
            run.decision,
            run.model,
            run.ema,
            cfg.keep_checkpoints,
            model_config(run, {}),
            watch,
            metrics.history,
        )
        progress = tqdm(total=run.total_steps, initial=state.step, desc="train", dynamic_ncols=True)
        checks = AgreedChecks(stop, state.step, cfg.checkpoint_minutes)
        pace = Pace(cfg, state.step, run.total_steps, acc.is_main_process)
        return cls(stop, metrics, best, watch, checks, checkpoints, progress, pace)


@dataclass(frozen=True)
class EpochEnd:
    """What an epoch's end came to: its row; no row (None: its training numbers were lost with a
    peer, never a row of zeros); or stopped (a stop signal during its evaluation)."""

    row: dict | None = None
    stopped: bool = False


def train_epoch(
    run: Run, cfg: TrainConfig, parts: Parts, survivor: Survivor, meter: EpochMeter, epoch: int
) -> None:
    """The epoch's optimizer steps, those a resumed run has left of it: each micro-batch's forward
    and backward, then, where it ends an accumulation window, the step applied and its moments."""
    acc, state = run.accelerator, run.state
    run.model.train()
    window_loss = torch.zeros((), device=acc.device)  # the micro-batch losses of this step, summed
    tick = time.perf_counter()
    for batch in epoch_batches(run, epoch):
        x, y = run.data.inputs(batch, train=True, epoch=epoch)
        meter.data_time += time.perf_counter() - tick
        lr = lr_of_step(run.scheduler, state.step + 1)  # (the classifier's, under --layer_decay)
        loss, logits, grad_norm, y = train_step(run, x, y, cfg.clip_grad)
        meter.update(loss, logits, y)
        parts.watch.update(loss, state.step + 1, lr)
        window_loss += loss.detach().float()
        with survivor.updating(acc.sync_gradients):  # a survivor save sees all of a step or none
            apply_step(run, parts, grad_norm)
        if acc.sync_gradients and step_done(run, cfg, parts, survivor, window_loss, lr, epoch):
            break
        tick = time.perf_counter()


def step_done(
    run: Run,
    cfg: TrainConfig,
    parts: Parts,
    survivor: Survivor,
    window_loss: torch.Tensor,
    lr: float,
    epoch: int,
) -> bool:
    """After an optimizer step, every rank alike (collectives): its row when one is due, a stop the
    ranks agree on (its checkpoint, then Stopped), a checkpoint due. True: the epoch's last step
    (--max_steps, or the end of its last whole accumulation window)."""
    acc, state, stop = run.accelerator, run.state, parts.stop
    last = state.step >= run.total_steps or state.batch_in_epoch >= run.batches_per_epoch
    if state.step % cfg.log_every == 0 or last:  # the step's loss: mean over micro-batches, ranks
        log_step(run, parts.metrics, parts.watch, survivor, window_loss / cfg.grad_accum, lr)
    window_loss.zero_()
    if last:
        return True
    if parts.checks.due(state.step) and parts.checks.agree(
        acc, state.step, parts.watch, parts.checkpoints
    ):
        who = stop.name  # (what stopped the ranks, before a signal during the save can change it)
        saved = parts.checkpoints.save(state)
        raise stop.stopped(
            f"stopped by {who} at step {state.step} (epoch {epoch + 1}); "
            f"checkpoint {saved}; continue with --resume auto"
        )
    if parts.checks.checkpoint_due(state.step, cfg.checkpoint_every):
        parts.checkpoints.save(state)
    return False


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
        logger.warning(
            f"epoch {state.epoch + 1}'s row covers its batches from "
            f"{state.batch_in_epoch + 1} on only (train_partial): the checkpoint "
            f"({why}) keeps no training sums of the batches before",
            main_process_only=not cfg.log_all_ranks,
        )
    return EpochMeter(run.accelerator.device, state.epoch_sums if resumed else None, partial)


def next_epoch(run: Run, epoch: int, lock) -> None:
    """After an epoch's row: the next epoch starts, unless --max_steps stopped this one (epoch and
    batch change together: the survivor reads them under `lock`)."""
    with lock:
        run.state.epoch_train = run.state.epoch_sums = None  # (recorded in the row)
        if run.state.batch_in_epoch >= run.batches_per_epoch:
            run.state.epoch, run.state.batch_in_epoch = epoch + 1, 0


def epoch_batches(run: Run, epoch: int):
    """The epoch's batches in its data order, less those a resumed run already trained on (none at
    all when only the epoch's evaluation is left)."""
    set_loader_epoch(run.train_loader, epoch)  # its sampler's order and its dataset's augmentation
    done = run.state.batch_in_epoch
    if not done:
        return run.train_loader
    if done >= run.batches_per_epoch:
        return []
    # the rest of the epoch is a new loader, which Accelerate before 1.15 starts at epoch 0 (its
    # `iteration`, set on each iter: the resumed epoch would take the first epoch's order and
    # augmentation): given it too
    rest = run.accelerator.skip_first_batches(run.train_loader, done)
    set_loader_epoch(rest, epoch)
    return rest


def apply_step(run: Run, parts: Parts, grad_norm: torch.Tensor | None) -> None:
    """The optimizer step (a no-op inside an accumulation window, as Accelerate's optimizer skips
    it), the data position, and, where a step ends, the step counter, the lr of the next step (a
    function of the global step), the EMA, the divergence watch's weights and the progress. No
    collective: a lost peer finds the step whole or not begun (survivor.py)."""
    acc, state = run.accelerator, run.state
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    state.batch_in_epoch += 1
    if acc.sync_gradients:
        state.step += 1
        parts.watch.update_weights(state.step, grad_norm)  # (on the device, read at a check)
        run.scheduler.step_update(state.step)
        if run.ema is not None:
            run.ema.update(bare_model(acc, run.model), step=state.step)
        parts.progress.update(1)
        parts.pace.step_done(state.step)
    PROGRESS.mark("training", state.step)  # (the micro-batch is done: hang.py)


def log_step(run: Run, metrics, watch, survivor, loss: torch.Tensor, lr: float) -> None:
    """A logged step (every rank: collectives): the divergence watch is read, the loss averaged over
    ranks, its row written; a lost peer on the way leaves the survivor this rank's loss for it."""
    survivor.note_row(run.state.step, loss, lr)
    watch.check(run.accelerator, run.state.step)
    metrics.log_step(run.accelerator, run.state.step, loss, lr)


def train_step(run: Run, x: torch.Tensor, y: torch.Tensor, clip_grad: float | None = None):
    """A micro-batch's forward and backward, and, where it ends an accumulation window, the
    gradient clipped -> (loss, logits, the gradient's norm before clipping or None, the targets:
    --mixup/--cutmix's soft ones, else `y`). The optimizer step is apply_step's."""
    accelerator, model = run.accelerator, run.model
    reseed(run)
    if run.mixup is not None:
        x, y = run.mixup(x, y)  # (numpy's draws: reseeded)
    grad_norm = None  # with --clip_grad: the total norm before clipping (the divergence watch's)
    with accelerator.accumulate(model):
        with accelerator.autocast():
            logits = model(x)
            loss = run.criterion(logits, y)
        accelerator.backward(loss)
        if clip_grad and accelerator.sync_gradients:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_grad)
    return loss, logits, grad_norm, y


def draw_seed(seed: int, step: int, micro_batch: int, rank: int) -> int:
    """A 63-bit seed that depends on (seed, optimizer step, micro-batch in its window, rank) and
    nothing else."""
    digest = hashlib.blake2b(f"{seed}:{step}:{micro_batch}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def reseed(run: Run) -> None:
    """Every random draw of a micro-batch (dropout, drop path; mixup's and cutmix's, which timm
    draws from numpy's global generator) is a function of (seed, step, rank): resume is exact
    without Accelerate's random-state files (which hold no NPU state and do not load across numpy
    majors). torch.manual_seed seeds the CPU generator, every CUDA device and the privateuse1 device
    (torch_npu's npu) on the host, without a device sync."""
    state, accelerator = run.state, run.accelerator
    micro = state.batch_in_epoch % accelerator.gradient_accumulation_steps
    seed = draw_seed(run.run_math["seed"], state.step, micro, accelerator.process_index)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def end_of_epoch(
    run: Run, cfg: TrainConfig, meter: EpochMeter, epoch: int, stop=None, only_evaluation=False
) -> EpochEnd:
    """Reduce the epoch's training sums, evaluate on the whole test split, log one line; stopped: a
    stop signal during the evaluation. `only_evaluation` (resumed after the epoch's last batch): the
    training numbers are the ones the checkpoint kept (TrainState.epoch_train); without them (a peer
    was lost in their reduce) the epoch has no row, never one of zeros."""
    PROGRESS.mark("epoch end", run.state.step)
    if not only_evaluation:
        run.state.epoch_train = meter.result(run.accelerator)  # (checkpoints keep it till the row)
    elif run.state.epoch_train is None:
        logger.warning(
            f"epoch {epoch + 1}'s training numbers are not in the checkpoint (a peer "
            "was lost in their reduce, or an older accel_train wrote it): no row for it",
            main_process_only=not cfg.log_all_ranks,
        )
        return EpochEnd()
    train_stats = run.state.epoch_train
    evaluated = evaluate(run.accelerator, run.model, run.test_loader, run.data, cfg.tta, stop)
    if evaluated is None:
        return EpochEnd(stopped=True)
    classes = run.data.info.num_classes
    # the lr of the epoch's last step
    row = {
        "epoch": epoch + 1,
        "step": run.state.step,
        **train_stats,
        **evaluated.metrics(classes),
        "test_samples": evaluated.labels.numel(),
        "lr": lr_of_step(run.scheduler, run.state.step),
    }
    if run.ema is not None:
        ema_evaluated = evaluate(run.accelerator, run.ema, run.test_loader, run.data, cfg.tta, stop)
        if ema_evaluated is None:
            return EpochEnd(stopped=True)
        row["test_acc_ema"] = ema_evaluated.accuracy()
    top = f" top-5 {row['test_top5']:.2%}" if "test_top5" in row else ""
    logger.info(
        f"epoch {epoch + 1}/{cfg.epochs} step {row['step']}: "
        f"train loss {row['train_loss']:.4f} acc {row['train_acc']:.2%} | "
        f"test loss {row['test_loss']:.4f} acc {row['test_acc']:.2%}{top} "
        f"({row['test_samples']} samples)"
        + (f" ema {row['test_acc_ema']:.2%}" if run.ema is not None else "")
        + f" | {row['images_per_sec']:.0f} img/s "
        f"({row['images_per_sec_per_process']:.0f}/process, "
        f"data wait {row['data_wait_frac']:.0%})",
        main_process_only=not cfg.log_all_ranks,
    )
    return EpochEnd(row)
