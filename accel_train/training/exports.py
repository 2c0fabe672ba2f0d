"""What a run leaves: model.safetensors (+ model_config.json), model_ema.safetensors,
model_best.safetensors, the curves and config.yaml, each written by the main process only; and the
best epoch so far.

The exports are plain state dicts (no `module.` / `_orig_mod.` prefixes): timm.create_model +
load_state_dict takes them (docs/outputs_and_resume.md: Outputs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate.logging import get_logger

from .. import __version__
from ..checkpoint.checkpointer import _state_dict_cpu, save_safetensors
from ..config.train_config import TrainConfig
from ..files import (
    BEST_FILE,
    CKPT_DIR,
    CONFIG_FILE,
    CURVES_FILE,
    EMA_EXPORT_FILE,
    METRICS_FILE,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    STEPS_FILE,
    open_output,
)
from ..model.create import bare_model
from ..model.own_model import code_dir, is_import_path
from ..platform.ranks import main_process_writes
from .metrics import MetricsLog

if TYPE_CHECKING:
    from .startup import Run

logger = get_logger("accel_train")


def export_model(
    model: torch.nn.Module,
    output_dir,
    model_config: dict,
    filename: str = MODEL_FILE,
    extra: dict | None = None,
    write_config: bool = True,
) -> Path:
    """Plain state dict (no `module.` / `_orig_mod.` prefixes) as safetensors + model_config.json.
    The file's metadata also carries mean/std (what --init_from reads when the file travels without
    its model_config.json) and `extra` (the best model: its epoch, step and test_acc)."""
    path = Path(output_dir) / filename
    metadata = {
        "format": "pt",
        "architecture": model_config["architecture"] or "",
        "mean": json.dumps(model_config["mean"]),
        "std": json.dumps(model_config["std"]),
        **{k: json.dumps(v) for k, v in (extra or {}).items()},
    }
    save_safetensors(_state_dict_cpu(model), path, metadata=metadata)
    if write_config:
        with open_output(Path(output_dir) / MODEL_CONFIG_FILE) as f:
            json.dump(model_config, f, indent=1)
    return path


def best_row(rows: list[dict], whole_epochs: int | None = None) -> dict | None:
    """The epoch row with the highest test_acc (the first of equals), or None; of the first
    `whole_epochs` epochs only, if given (the row of an epoch --max_steps cut short is never
    exported)."""
    rows = [
        r
        for r in rows
        if r.get("test_acc") is not None and (whole_epochs is None or r["epoch"] <= whole_epochs)
    ]
    return max(rows, key=lambda r: r["test_acc"]) if rows else None


def exported_best(output_dir) -> dict | None:
    """{epoch, step, test_acc} of the model_best.safetensors in output_dir, or None when there is
    none."""
    from safetensors import safe_open

    path = Path(output_dir) / BEST_FILE
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
        return {k: json.loads(meta[k]) for k in ("epoch", "step", "test_acc")}
    except Exception:  # missing, partial or not ours
        return None


class BestModel:
    """Which epoch is the best so far (highest test_acc; the first of equals) and whether its
    weights are in <output_dir>/model_best.safetensors.

    The best so far comes from the metrics rows (a resumed run: the rows its checkpoint carries, so
    it survives a resume on any machine). The file is this machine's: a file that is not the rows'
    best (written by epochs after the checkpoint resumed from, or by another run) is deleted at
    start; a machine whose disk lacks the best's file (a resume on another machine's disk) writes
    one again only when a later epoch beats the best: checkpoints do not carry a second copy of the
    weights (see docs/outputs_and_resume.md: Outputs)."""

    def __init__(self, output_dir, rows: list[dict], writer: bool, whole_epochs: int | None = None):
        # (a resumed --max_steps stop keeps its cut-short row)
        self.row = best_row(rows, whole_epochs)
        found = exported_best(output_dir) if writer else None
        mine = (
            self.row is not None
            and found is not None
            and (found["epoch"], found["step"]) == (self.row["epoch"], self.row["step"])
        )
        if writer and not mine:
            (Path(output_dir) / BEST_FILE).unlink(missing_ok=True)
        self.on_disk = mine

    def improves(self, row: dict) -> bool:
        return row.get("test_acc") is not None and (
            self.row is None or row["test_acc"] > self.row["test_acc"]
        )

    def take(self, row: dict) -> None:
        if self.improves(row):
            self.row, self.on_disk = row, True

    def evaluations_since(self, rows: list[dict]) -> int:
        """How many evaluations came after the best one (the metrics rows, which checkpoints carry:
        a resumed run counts as the uninterrupted one)."""
        if self.row is None:
            return 0
        return sum(r.get("test_acc") is not None and r["epoch"] > self.row["epoch"] for r in rows)

    def out_of_patience(self, patience: int | None, rows: list[dict]) -> str | None:
        """--patience: the line that says why the run stops early, or None (go on). Every rank
        holds the same rows: every rank decides alike, with no collective."""
        since = self.evaluations_since(rows)
        if not patience or since < patience:
            return None
        return (
            f"--patience {patience}: the test accuracy has not improved for {since} "
            f"evaluation(s) since epoch {self.row['epoch']} ({self.row['test_acc']:.2%}); "
            f"training stops early after epoch {rows[-1]['epoch']}, the best model kept"
        )


def record_epoch(
    run: Run, output_dir, metrics: MetricsLog, best: BestModel, row: dict | None
) -> None:
    """The epoch's row to metrics.jsonl and the trackers; a new best test_acc of a whole epoch is
    exported (main process) as model_best.safetensors, with its epoch, step and test_acc in the
    file's metadata. The row of an epoch that --max_steps cut short is recorded but is not a
    candidate: a resume drops that row (its epoch is finished and evaluated again), and a best file
    written from it would replace the earlier best's. No row (None, loop.EpochEnd: the epoch's
    training numbers were lost with a peer) is not recorded, on every rank."""
    if row is None:
        return
    metrics.append(run.accelerator, row)
    whole = run.state.batch_in_epoch >= run.batches_per_epoch
    improves, facts = (
        whole and best.improves(row),
        {k: row[k] for k in ("epoch", "step", "test_acc")},
    )
    # every rank takes part (a collective), whatever its own rows say: the main process's rows
    # decide the export
    main_process_writes(
        run.accelerator,
        lambda: (
            improves
            and export_model(
                bare_model(run.accelerator, run.model),
                output_dir,
                model_config(run, facts),
                filename=BEST_FILE,
                extra=facts,
                write_config=False,
            )
        ),
        output_dir,
    )
    if whole:
        best.take(row)


def lr_of_step(scheduler, step: int) -> float:
    """The lr optimizer step `step` (1-based) trained with, from the schedule itself (a function of
    the step): the lr set after step - 1 steps (with timm's lr noise where --sched_kwargs asks for
    it; the first parameter group's before its --layer_decay lr_scale: the classifier's)."""
    return scheduler._add_noise(scheduler._get_lr(step - 1), step - 1)[0]


def lr_curve(
    scheduler, total_steps: int, logged: list[dict] = (), since: int = 0, points: int = 2000
) -> list[dict]:
    """The lr each step trained with: up to `since` (the step a resume started from, when the
    schedule may have been another: an extension, a new --lr) the lr steps.jsonl's rows logged;
    after it every step's from the schedule, which has not changed since (lr_of_step). At most
    `points` points of the schedule."""
    stride = max(1, (total_steps - since) // points)
    return [{"step": r["step"], "lr": r["lr"]} for r in logged if r["step"] <= since] + [
        {"step": k, "lr": lr_of_step(scheduler, k)}
        for k in range(since + 1, total_steps + 1, stride)
    ]


def compile_summary() -> str:
    """What torch.compile compiled in this process (dynamo's counters). Training drops incomplete
    batches and evaluation pads its last one, so there are two: training (train mode, gradients) and
    evaluation."""
    from torch._dynamo.utils import counters

    # (DDP's graph breaks add frames)
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["ok"]
    return (
        f"torch.compile compiled {graphs} graph(s) (train, eval) from {frames} traced frame(s)"
        + ("" if graphs <= 2 else "; more than expected: TORCH_LOGS=recompiles shows why")
    )


def model_config(run: Run, metrics: dict) -> dict:
    """What rebuilds the run's model: architecture, the timm name or import path that rebuilds it
    (Run.architecture; None if none does), the stem and kwargs start-up resolved, the data's facts;
    and `metrics`."""
    folder = code_dir(run.architecture)  # (your own code: where predict imports it from)
    return {
        "architecture": run.architecture,
        **({"code_dir": folder} if folder else {}),
        "stem": run.resolved.stem,
        **run.data.info.model_config(),
        "model_kwargs": run.config.model_kwargs_dict(),
        "metrics": metrics,
        "accel_train_version": __version__,
    }


def finish(
    run: Run, cfg: TrainConfig, metrics: MetricsLog, best: BestModel, seconds: float, stop
) -> dict:
    """Outputs, written once by the main process: model.safetensors, model_config.json, curves,
    config; then the trackers are closed (accelerator.end_training). The stop handlers (`stop`) are
    uninstalled only then: a stop signal after the last step (its default action would end the
    process mid-write, with no status) is too late to stop anything, and the finished run ends with
    status 0."""
    accelerator, model, ema, info = run.accelerator, run.model, run.ema, run.data.info
    accelerator.wait_for_everyone()
    if cfg.compile:
        logger.info(
            f"rank {accelerator.process_index}: {compile_summary()}",
            main_process_only=not cfg.log_all_ranks,
        )
    out = Path(cfg.output_dir)
    last = metrics.rows[-1] if metrics.rows else {}
    summary = {
        "final_test_acc": last.get("test_acc"),
        "best_test_acc": max((r["test_acc"] for r in metrics.rows), default=None),
        "epochs_run": len(metrics.rows),
        "step": last.get("step"),
        "wall_seconds": seconds,
        "images_per_sec": last.get("images_per_sec"),
    }
    if ema is not None:
        summary["final_test_acc_ema"] = last.get("test_acc_ema")
    if best.row is not None:
        summary["best_epoch"], summary["best_step"] = best.row["epoch"], best.row["step"]

    def write():
        path = export_model(bare_model(accelerator, model), out, model_config(run, summary))
        if ema is not None:
            export_model(ema.module, out, model_config(run, summary), filename=EMA_EXPORT_FILE)
        # (the precision used, not 'auto': Run.config's)
        cfg.save_yaml(out / CONFIG_FILE, run.resolved.asked, model=run.architecture)
        return path, cfg.plot and bool(metrics.rows) and plot_curves(
            metrics.rows,
            out / CURVES_FILE,
            metrics.steps(),
            run.steps_per_epoch,
            lr_steps=lr_curve(
                run.scheduler, metrics.rows[-1]["step"], metrics.steps(), run.state.schedule_since
            ),
        )

    written = main_process_writes(accelerator, write, out)
    if accelerator.is_main_process:
        path, curves = written
        logger.info(
            f"rank {accelerator.process_index}/{accelerator.num_processes} wrote {path}",
            main_process_only=False,
        )
        files = [MODEL_FILE, MODEL_CONFIG_FILE, METRICS_FILE, STEPS_FILE, CONFIG_FILE]
        files += (
            [CURVES_FILE] * bool(curves) + [EMA_EXPORT_FILE] * (ema is not None) + [f"{CKPT_DIR}/"]
        )
        files += [BEST_FILE] * bool(best.on_disk)
        if best.row is not None and not best.on_disk:
            logger.warning(
                f"the best epoch ({best.row['epoch']}, test acc "
                f"{best.row['test_acc']:.2%}) was trained before a resume and its "
                f"{BEST_FILE} is not on this disk: no later epoch beat it"
            )
        best_at = f" (epoch {summary['best_epoch']})" if "best_epoch" in summary else ""
        logger.info(
            f"done in {seconds:.0f}s: final test acc {summary['final_test_acc'] or 0:.2%}, "
            f"best {summary['best_test_acc'] or 0:.2%}{best_at}, "
            f"{summary['images_per_sec'] or 0:.0f} img/s | "
            f"outputs in {out}/: {', '.join(files)}"
            + (f" | tracker logs: {cfg.log_with}" if cfg.log_with else "")
        )
        logger.info(predict_command(out, run.architecture, info.mean is not None))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    stop.uninstall()
    return summary


def predict_command(out: Path, architecture: str | None, normalised: bool = True) -> str:
    """The line that says how to predict with the trained model (`normalised`: its model_config.json
    records the normalisation; a script's own Datasets may not)."""
    code = (
        " --trust_model_code"
        if is_import_path(architecture)
        else " --model module.path:callable"
        if architecture is None
        else ""
    )
    norm = "" if normalised else " --mean R,G,B --std R,G,B"
    return (
        f"predict with: accel-train predict --checkpoint {out}{code}{norm} IMAGE_OR_FOLDER ..."
        + (" (imports the model's code: trust it)" if is_import_path(architecture) else "")
        + (
            ""
            if normalised
            else " (--mean/--std: what your Dataset's transform applied to [0, 1] images)"
        )
    )


def plot_curves(
    rows: list[dict],
    path,
    steps: list[dict] = (),
    steps_per_epoch: int = 0,
    lr_steps: list[dict] | None = None,
) -> bool:
    """Loss, accuracies and lr against epoch in one PNG; False (and no file) without matplotlib.

    Per-step points (steps.jsonl) are drawn where they say more than the epoch points (some logged
    within an epoch, more of them than epochs; with --log_every at least an epoch's steps they are
    epoch-end points only): the loss faintly. The lr is drawn from `lr_steps` (the lr each step
    trained with, lr_curve: warmup and cosine decay even on a short run, and the jump where a resume
    changed the schedule), else from the logged points. The epoch axis starts at 0, its ticks whole
    numbers (a --max_steps run's part of one epoch got ticks 0.945-1.05).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return False
    epochs = [r["epoch"] for r in rows]
    at = [s["step"] / steps_per_epoch for s in steps] if steps and steps_per_epoch else []
    if not (len(at) > len(rows) and any(s["step"] % steps_per_epoch for s in steps)):
        at = []  # (epoch-end points only: the epoch means say it)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    if at:
        axes[0].plot(at, [s["loss"] for s in steps], "-", alpha=0.3, label="train loss (steps)")
    axes[0].plot(epochs, [r["train_loss"] for r in rows], "o-", label="train loss (epoch mean)")
    axes[0].set_title("training loss")
    axes[1].plot(epochs, [100 * r["train_acc"] for r in rows], "o-", label="train")
    axes[1].plot(epochs, [100 * r["test_acc"] for r in rows], "o-", label="test")
    if any("test_acc_ema" in r for r in rows):
        axes[1].plot(
            epochs,
            [100 * r.get("test_acc_ema", float("nan")) for r in rows],
            "o--",
            label="test (EMA)",
        )
    axes[1].set_title("accuracy (%)")
    if lr_steps and steps_per_epoch:
        axes[2].plot(
            [s["step"] / steps_per_epoch for s in lr_steps],
            [s["lr"] for s in lr_steps],
            "-",
            label="lr (per step)",
        )
    elif at:
        axes[2].plot(at, [s["lr"] for s in steps], "-", label="lr (per step)")
    else:
        axes[2].plot(epochs, [r["lr"] for r in rows], "o-", label="lr (end of epoch)")
    axes[2].set_title("learning rate")
    right = max(
        [*epochs, *at, *(s["step"] / steps_per_epoch for s in lr_steps or () if steps_per_epoch)]
    )
    for ax in axes:
        ax.set_xlim(0, max(right, 1) * 1.02)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    with open_output(path, "wb") as f:
        fig.savefig(f, dpi=100, format="png")
    plt.close(fig)
    return True
