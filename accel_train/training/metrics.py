"""Metrics: the epoch meter (every rank), metrics.jsonl / steps.jsonl and the trackers (written by
the main process), the tracker check, and the early warning that a run will take hours."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..errors import ConfigError
from ..files import METRICS_FILE, STEPS_FILE, dumps, open_output, read_jsonl, write_output
from ..platform.ranks import rank0s


class EpochMeter:
    """Sums that stay on the device during an epoch (no sync per step) and step timing.

    `resumed`: a resume into the middle of the epoch: the sums of its batches before the checkpoint
    (TrainState.epoch_sums, reduced over the ranks that trained them, whatever their number), so
    that the epoch's row is the uninterrupted run's; None where the checkpoint keeps none (a
    survivor's save, an older accel_train): the row then covers the batches since the resume and
    says so (`partial`)."""

    def __init__(self, device, resumed: dict | None = None, partial: bool = False):
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.correct = torch.zeros((), device=device, dtype=torch.long)
        self.samples = 0
        self.data_time = 0.0
        self.start = time.perf_counter()
        self.before = resumed or {}  # all ranks' sums of the epoch's batches before this start
        self.partial = partial
        self.reduced = None  # (the global sums at `samples` local samples, once reduced)

    def update(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """`labels`: class indices, or --mixup/--cutmix's soft targets, whose largest share is the
        label counted (the class that covers most of the mixed image; docs/fine-tuning.md)."""
        labels = labels.argmax(1) if labels.dim() == 2 else labels
        n = labels.shape[0]
        self.loss_sum += loss.detach().double() * n
        self.correct += (logits.detach().argmax(1) == labels).sum()
        self.samples += n
        self.reduced = None  # (every rank updates alike: the ranks reduce again together)

    def sums(self, accelerator) -> dict:
        """The epoch's sums so far over every rank, the resumed part's included (a collective:
        every rank calls it at the same batch; a checkpoint, where the ranks meet anyway); JSON
        numbers, what a checkpoint keeps."""
        if self.reduced is None or self.reduced[0] != self.samples:
            count = torch.tensor(
                float(self.samples), device=self.loss_sum.device, dtype=torch.float64
            )
            sums = torch.stack([self.loss_sum, self.correct.double(), count])
            loss_sum, correct, samples = accelerator.reduce(sums, reduction="sum").tolist()
            self.reduced = self.samples, (loss_sum, correct, samples)
        loss_sum, correct, samples = self.reduced[1]
        before = self.before
        return {
            "loss_sum": before.get("loss_sum", 0.0) + loss_sum,
            "correct": int(before.get("correct", 0) + correct),
            "samples": int(before.get("samples", 0) + samples),
            "process_samples": before.get("process_samples", 0) + self.samples,
            "seconds": before.get("seconds", 0.0) + max(time.perf_counter() - self.start, 1e-9),
            "data_time": before.get("data_time", 0.0) + self.data_time,
        }

    def result(self, accelerator) -> dict:
        """Reduce over ranks (a collective: every rank calls it) and read back once."""
        total = self.sums(accelerator)
        samples, seconds = total["samples"], total["seconds"]
        data_share = total["data_time"] / seconds  # both on one clock over the same epoch: <= 1
        return {
            "train_loss": total["loss_sum"] / max(samples, 1),
            "train_acc": total["correct"] / max(samples, 1),
            "train_samples": samples,
            **({"train_partial": True} if self.partial else {}),
            "images_per_sec": samples / seconds,
            "images_per_sec_per_process": total["process_samples"] / seconds,
            "data_wait_frac": data_share,
            "compute_frac": 1.0 - data_share,
            "epoch_seconds": seconds,
        }


# a run whose training steps alone are estimated to take longer is told so, with flags that help
SLOW_RUN_S = 3600


def slow_run_warning(
    image_size: int | None, stem: str, seconds_per_step: float, steps_left: int
) -> str | None:
    """One line when `steps_left` steps at `seconds_per_step` take longer than SLOW_RUN_S: the
    estimate and the flags that would shorten it at this --image_size and --stem; None otherwise."""
    eta = seconds_per_step * steps_left
    if eta <= SLOW_RUN_S:
        return None
    size, hints = image_size or 32, []
    if stem == "cifar" and size > 32:
        hints.append(
            f"--stem imagenet (timm's stem: ~16x less compute than the cifar stem at {size} px)"
        )
    if size > 64:
        hints.append(f"--image_size {max(32, size // 2)} (4x fewer pixels)")
    hints += ["--epochs / --max_steps (a shorter run)", "--train_samples N (a subset)"]
    return (
        f"this run will take about {eta / 3600:.1f} h ({steps_left} steps at "
        f"{seconds_per_step:.2f} s/step, evaluation not counted); faster: " + ", ".join(hints)
    )


class Pace:
    """Says early (once, main process) when the run will take hours. Timed on the host clock over
    steps first+1 .. first+1+K (the first step, with its warm-up, is left out), with no host sync:
    on an accelerator the host runs ahead of the device until its queue fills (a few steps), so the
    estimate can only be low."""

    K = 3

    def __init__(self, cfg, first_step: int, total_steps: int, enabled: bool):
        self.cfg, self.first, self.total, self.enabled = cfg, first_step, total_steps, enabled
        self.start = None

    def step_done(self, step: int, now: float | None = None) -> str | None:
        if not self.enabled or step > self.first + 1 + self.K:
            return None
        now = time.perf_counter() if now is None else now
        if step == self.first + 1:
            self.start = now
            return None
        if step < self.first + 1 + self.K or self.start is None:
            return None
        line = slow_run_warning(
            self.cfg.image_size, self.cfg.stem, (now - self.start) / self.K, self.total - step
        )
        if line:
            import logging

            logging.getLogger("accel_train").warning(line)
        return line


class MetricsLog:
    """metrics.jsonl (a row per epoch) and steps.jsonl (a row every --log_every steps, at each
    epoch's last step and where --max_steps stops), plus the trackers.

    Every rank holds the rows (their values are reduced over ranks, so they are the same everywhere,
    and every checkpoint writer stores them); only the main process writes the files. A resumed run
    starts from the rows its checkpoint carries (older checkpoints: the files, cut at the
    checkpoint's step), so a replayed stretch is not counted twice and a machine with an empty disk
    still has the whole history.
    """

    def __init__(
        self,
        cfg,
        enabled: bool,
        resume_at=None,
        history: dict | None = None,
        steps_per_epoch: int = 1,
        done: bool = False,
    ):
        """`done`: the resumed run has nothing left to train (its checkpoint is where --max_steps
        stops): its rows are kept whole (cut, they emptied metrics.jsonl and the final metrics of a
        rerun command)."""
        self.path, self.steps_path = (
            Path(cfg.output_dir) / METRICS_FILE,
            Path(cfg.output_dir) / STEPS_FILE,
        )
        self.enabled = enabled
        self.rows, self.step_rows = [], []
        if resume_at is not None and resume_at.step > 0:
            if history is None:  # an older checkpoint: the files of this machine
                history = {
                    METRICS_FILE: read_jsonl(self.path),
                    STEPS_FILE: read_jsonl(self.steps_path),
                }
            # rows of whole epochs only (a --max_steps stop mid-epoch wrote a row its resumed epoch
            # rewrites)
            self.rows = [
                r for r in history.get(METRICS_FILE, []) if r["epoch"] <= resume_at.epoch or done
            ]
            self.step_rows = [r for r in history.get(STEPS_FILE, []) if r["step"] <= resume_at.step]
            # the row where --max_steps stopped (mid-epoch, off --log_every): one the uninterrupted
            # run has not
            step = resume_at.step
            if (
                self.step_rows
                and self.step_rows[-1]["step"] == step
                and step % cfg.log_every
                and step % steps_per_epoch
                and not done
            ):
                self.step_rows.pop()
        if enabled:
            write_output(self.path, "".join(dumps(r) + "\n" for r in self.rows))
            write_output(self.steps_path, "".join(dumps(r) + "\n" for r in self.step_rows))

    def history(self) -> dict:
        return {METRICS_FILE: list(self.rows), STEPS_FILE: list(self.step_rows)}

    def append(self, accelerator, row: dict) -> None:
        accelerator.log({f"epoch/{k}": v for k, v in row.items() if k != "epoch"}, step=row["step"])
        self.rows.append(row)
        if self.enabled:
            with open_output(self.path, "a") as f:
                f.write(dumps(row) + "\n")

    def steps(self) -> list[dict]:
        return self.step_rows

    def log_step(self, accelerator, step: int, loss: torch.Tensor, lr: float) -> None:
        """Every rank calls this (the loss is averaged over ranks)."""
        loss = accelerator.reduce(loss.detach().float(), reduction="mean").item()
        accelerator.log({"step/train_loss": loss, "step/lr": lr}, step=step)
        row = {"step": step, "loss": loss, "lr": lr}
        self.step_rows.append(row)
        if self.enabled:
            with open_output(self.steps_path, "a") as f:
                f.write(dumps(row) + "\n")


def tracker_init_kwargs(requested: list[str], step: int, run_name: str | None = None) -> dict:
    """Start arguments per tracker (Accelerator.init_trackers' init_kwargs). TensorBoard:
    purge_step, the first step this run logs (the resumed step + 1; 1 for a fresh start), so
    TensorBoard hides what an earlier attempt logged from there on (SummaryWriter writes a
    SessionLog START at that step), as steps.jsonl is cut back to the checkpoint: after a crash and
    --resume auto the curves go on from the checkpoint instead of going backwards. wandb: --run_name
    as wandb.init's name."""
    wanted = set(requested)
    kwargs = {"tensorboard": {"purge_step": step + 1}} if {"tensorboard", "all"} & wanted else {}
    return (
        {**kwargs, "wandb": {"name": run_name}}
        if run_name and {"wandb", "all"} & wanted
        else kwargs
    )


def check_trackers(accelerator, requested: list[str]) -> None:
    """Accelerate drops a tracker whose package is missing with only a warning: make that an error.

    Trackers run on the main process only, so it is checked there and its verdict sent to every
    rank: all ranks stop together with the same one-line error (or none does)."""
    missing = []
    if accelerator.is_main_process:
        active = {getattr(t, "name", type(t).__name__).lower() for t in accelerator.trackers}
        missing = [name for name in requested if name.lower() not in active]
    if accelerator.num_processes > 1:
        missing = rank0s(missing)
    if missing:
        raise ConfigError(
            f"tracker(s) {', '.join(missing)} did not start (package missing?); "
            "install its package (tensorboard: pip install "
            "'accel_train[tensorboard]'), or drop --log_with"
        )
