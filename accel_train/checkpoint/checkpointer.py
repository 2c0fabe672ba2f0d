"""Checkpoints (accelerator.save_state, atomic, newest K of this run kept) and the safetensors
export.

A checkpoint is `<output_dir>/checkpoints/step_<global step>/`: Accelerate's model.safetensors,
optimizer.bin, scaler.pt (fp16 only), random_states_<rank>.pkl of EVERY rank, plus our
trainer_state.json (run id, epoch, global step, batches done in the epoch, the run's math: global
batch, processes, machines, epochs, seed, model, data size), ema.safetensors (--ema) and the metrics
rows so far. It is written as `.tmp-step_N/` and renamed into place once every rank has finished: a
directory named `step_N` is complete by construction, and one such directory is a whole checkpoint
that can be copied anywhere. Each machine with its own disk keeps a whole copy (written in parallel
by its local main process); a shared output directory holds one copy. Which checkpoint a job
resumes from, and copying it to machines that lack it, is `resume.py`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from accelerate.logging import get_logger
from accelerate.utils import broadcast, gather_object
from safetensors.torch import load_file, save

from ..errors import ConfigError
from ..files import (
    CKPT_DIR,
    EMA_FILE,
    HISTORY,
    MODEL_CONFIG_FILE,
    RNG_PREFIX,
    STATE_FILE,
    checkpoint_dirs,
    dumps,
    open_output,
    read_jsonl,
    seal,
    step_dir,
    swapped,
    sync_dir,
    write_output,
)
from ..hang import PROGRESS
from .changes import settings_from_flags
from .output_dir import delete_set_aside


@dataclass
class TrainState:
    epoch: int = 0  # 0-based epoch in progress (== epochs done when batch_in_epoch == 0)
    step: int = 0  # optimizer steps done
    batch_in_epoch: int = 0  # batches of `epoch` already consumed (on each rank)
    # the run this state belongs to (checkpoints of other runs are never touched)
    run_id: str = ""
    # the epoch's training numbers once reduced over ranks, until its row is recorded
    epoch_train: dict | None = None
    # the lr has followed this run's schedule since this step (before: steps.jsonl's lr)
    schedule_since: int = 0
    epoch_sums: dict | None = None  # mid-epoch: its training sums so far (EpochMeter.sums)


def _state_dict_cpu(module: torch.nn.Module) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """safetensors' own save_file creates its file 0600 whatever the umask (its writer's temporary
    file); write the same bytes the way every other output is written (mode from the umask),
    atomically."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    try:
        with open_output(tmp, "wb") as f:
            f.write(save(tensors, metadata=metadata))
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no half-written file left beside the outputs
        tmp.unlink(missing_ok=True)
        raise


def _file_mode() -> int:
    """The mode open() gives a new file under this process's umask (read from /proc: os.umask would
    set it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return 0o666 & ~int(line.split()[1], 8)
    except OSError:
        pass
    return 0o644


class Checkpointer:
    """Where (--output_dir), who (the resume decision's writers: one process per storage), how many
    (--keep_checkpoints) and what (model, optimizer, EMA, every rank's RNG state, the run math, the
    model's facts and the metrics rows so far). Every rank calls `save(state)` at the same step.

    Never a checkpoint of non-finite weights: `watch` (divergence.NonFiniteWatch) checks them first
    and stops every rank if any is, so the newest checkpoint is the last finite one."""

    def __init__(
        self,
        accelerator,
        output_dir,
        run_math: dict,
        decision,
        model,
        ema,
        keep: int,
        facts: dict,
        watch,
        history,
    ):
        self.accelerator, self.output_dir, self.run_math, self.decision = (
            accelerator,
            output_dir,
            run_math,
            decision,
        )
        self.model, self.ema, self.keep, self.facts, self.watch, self.history = (
            model,
            ema,
            keep,
            facts,
            watch,
            history,
        )
        # (a checkpoint by time: preempt.AgreedChecks)
        self.saved_at, self.write_s = time.perf_counter(), None
        # a save in progress: the survivor's signal watch does not save beside it
        self.writing = False
        self.buffers_shared = None  # (step): every rank holds rank 0's buffers (survivor.py)
        self.meter = None  # the epoch's metrics.EpochMeter (the loop's)

    def save(self, state: TrainState) -> Path:
        self.watch.check(self.accelerator, state.step, self.model)
        # mid-epoch (its row not yet made): the epoch's training sums so far, reduced here, where
        # the ranks meet anyway, so that a resume's row of this epoch is the uninterrupted run's
        mid_epoch = (
            self.meter is not None and state.batch_in_epoch > 0 and state.epoch_train is None
        )
        state.epoch_sums = self.meter.sums(self.accelerator) if mid_epoch else None
        start = time.perf_counter()
        self.writing = True
        try:
            shared = share_buffers(self.accelerator, self.model, self.ema)
            if shared and self.buffers_shared is not None:
                self.buffers_shared(state.step)
            with PROGRESS.exempt("checkpoint write"):  # (a long write is no hang: hang.py)
                path = save_checkpoint(
                    self.accelerator,
                    self.output_dir,
                    state,
                    self.run_math,
                    self.decision.writer,
                    self.decision.shared,
                    model=self.model,
                    ema=self.ema,
                    history=self.history(),
                    keep=self.keep,
                    facts=self.facts,
                )
        finally:
            self.writing = False
        self.saved_at = time.perf_counter()
        self.write_s = self.saved_at - start
        return path


def share_buffers(accelerator, model, ema) -> bool:
    """Rank 0's buffers (BatchNorm's running statistics: the model's and the EMA's) on every rank;
    True if any were sent. Under DDP the ranks' weights are equal but their statistics are each
    rank's own until DDP broadcasts rank 0's at the next forward, and each rank's EMA follows its
    own. A checkpoint holds rank 0's: sent at the start of its write, every machine's copy is rank
    0's state, and a survivor of a peer lost during the write saves exactly that. The model's change
    no training (DDP's next forward sends the same values to the other ranks); each rank's EMA
    evaluates with rank 0's statistics from there on, as after a resume from the checkpoint."""
    if model is None or accelerator.num_processes < 2:
        return False
    tensors = [*model.buffers(), *(ema.module.buffers() if ema is not None else ())]
    for tensor in tensors:
        broadcast(tensor, from_process=0)
    return bool(tensors)


def save_checkpoint(
    accelerator,
    output_dir,
    state: TrainState,
    run_math: dict,
    writer: bool,
    shared: bool,
    model=None,
    ema=None,
    history: dict | None = None,
    keep: int = 2,
    facts: dict | None = None,
) -> Path:
    """Every rank calls this. Returns the final checkpoint path.

    `writer`: this process writes to its disk (the main process for a shared output dir, else each
    machine's local main process). Model and optimizer are the same on every rank (DDP; the buffers
    once share_buffers sent rank 0's), so each writer saves them from its own ranks; the RNG states
    of every rank are gathered so each copy is whole.
    """
    root = Path(output_dir) / CKPT_DIR
    final = step_dir(output_dir, state.step)
    tmp = root / f".tmp-{final.name}"
    # A write that fails (a full disk, a quota) fails on some ranks only: each part is attempted,
    # then every rank learns whether any rank failed (agree: one gather, also the barrier that was
    # here) and all stop alike.
    attempt = _Attempt(Path(output_dir))
    if writer:
        with attempt:
            # left by a run killed while saving: never complete
            for stale in root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
    agree = partial(
        _agree, accelerator, attempt, tmp if writer else None, final, output_dir, state.run_id
    )
    agree()
    accelerator.project_configuration.save_on_each_node = not shared
    with attempt:
        accelerator.save_state(str(tmp))
    agree()
    if not shared:  # every writer keeps every rank's RNG state
        own = tmp / f"{RNG_PREFIX}{accelerator.process_index}.pkl"
        with attempt:
            own_state = (own.name, own.read_bytes())
        states = gather_object([own_state if attempt.error is None else None])
        if writer:
            with attempt:
                for name, data in filter(None, states):
                    write_output(tmp / name, data)
    if writer:
        with attempt:
            # accelerate's save_state writes them 0600 (safetensors' save_file)
            for name in tmp.glob("*.safetensors"):
                os.chmod(name, _file_mode())
            if ema is not None:
                save_safetensors(_state_dict_cpu(ema.module), tmp / EMA_FILE)
            # the model's facts, so that evaluate/predict/--init_from take a checkpoint folder
            if facts is not None:
                write_output(
                    tmp / MODEL_CONFIG_FILE,
                    json.dumps({**facts, "metrics": {"step": state.step}}, indent=1),
                )
            for name, rows in (history or {}).items():
                # as the metrics files are
                write_output(tmp / name, "".join(dumps(r) + "\n" for r in rows))
            seal(
                tmp,
                {
                    **asdict(state),
                    "run": run_math,
                    "ema": ema is not None,
                    "num_processes": accelerator.num_processes,
                },
            )
    agree()  # every rank's files are in tmp
    if writer:
        if final.exists():  # same step saved twice (epoch end == step checkpoint): the new one wins
            shutil.rmtree(final)
        os.replace(tmp, final)
        sync_dir(root)
        # oldest first; newer ones: a resume from an older step abandoned their branch
        own = checkpoint_dirs(output_dir, state.run_id)
        newer = [p for p in own if int(p.name.split("_")[1]) > state.step]
        for old in newer + [p for p in own if p not in newer][:-keep]:
            if old in newer:
                logging.getLogger("accel_train").info(
                    f"deleting {old}: abandoned by the resume from an older step"
                )
            shutil.rmtree(old, ignore_errors=True)
        # --overwrite's earlier run, now that this run has a complete checkpoint
        delete_set_aside(root)
    accelerator.wait_for_everyone()
    return final


class CheckpointWriteError(ConfigError):
    """A checkpoint could not be written (full disk, quota, permissions): one line on every rank,
    exit 2."""


class _Attempt:
    """`with attempt:` keeps the first write failure of this rank (OSError, safetensors' error,
    torch.save's RuntimeError) instead of raising it, so that the rank still reaches the next
    collective."""

    def __init__(self, where: Path):
        self.where, self.error = where, None

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        # a write that failed: OSError, safetensors' error, or torch.save's RuntimeError about the
        # file (an out-of-memory or device error keeps its traceback)
        written = (
            isinstance(error, OSError)
            or type(error).__name__ == "SafetensorError"
            or (
                type(error) is RuntimeError
                and re.search(r"write|unexpected pos|No space|PytorchStreamWriter", str(error))
            )
        )
        if error is None or not written:
            return False
        if self.error is not None:
            return True
        text = " ".join(str(error).split())
        if isinstance(error, OSError) and error.strerror:
            text = error.strerror
        if "No space left on device" in text or "StorageFull" in text:
            text = "No space left on device"
        # torch.save says only "unexpected pos ..." or "file write failed" when the disk is full
        else:
            try:
                full = shutil.disk_usage(self.where).free < 2**20
            except OSError:
                full = False
            text = f"No space left on device: {text[:120]}" if full else text
        self.error = text[:160] or type(error).__name__
        return True


def _agree(
    accelerator, attempt: _Attempt, tmp: Path | None, final: Path, output_dir, run_id: str
) -> None:
    """Every rank: gather each rank's write failure; if any, the writers remove the partial
    checkpoint and every rank raises the same one-line error (printed by the main process)."""
    failed = [(rank, error) for rank, error in enumerate(gather_object([attempt.error])) if error]
    if not failed:
        return
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()  # the partial checkpoint is gone before anyone reports
    rank, error = failed[0]
    newest = checkpoint_dirs(output_dir, run_id)
    where = (
        f"the newest complete checkpoint is {newest[-1]}"
        if newest
        else "there is no complete checkpoint yet"
    )
    e = CheckpointWriteError(
        f"cannot write checkpoint {final.name} in {final.parent} (rank "
        f"{rank}: {error}); the partial checkpoint was removed and {where}; "
        "free space (or pass another --output_dir) and continue with "
        "--resume auto"
    )
    e.quiet = not accelerator.is_main_process
    raise e


def load_checkpoint(accelerator, path: Path) -> TrainState:
    """Every rank calls this, after accelerator.prepare. The lr schedule is not loaded: it is a
    function of the step and the current flags (see docs/outputs_and_resume.md: resume)."""
    meta = json.loads((path / STATE_FILE).read_text())
    if changed := swapped(path):
        raise ConfigError(
            f"checkpoint {path}: {', '.join(changed)} is not the file sealed at step "
            f"{meta['step']} of run {meta.get('run_id', '?')} (its SHA-256 differs "
            f"from {STATE_FILE}'s): it was replaced or changed since; resume from "
            "another checkpoint (--resume PATH) or start a fresh run"
        )
    rng = path / f"{RNG_PREFIX}{accelerator.process_index}.pkl"
    # said once, by the rank it concerns ([RANK n]), whatever --log_all_ranks says
    if not rng.is_file():
        get_logger("accel_train").info(
            f"{path} has no RNG state for rank {accelerator.process_index} (it was written by "
            f"{meta.get('num_processes', '?')} processes); harmless: training's random draws are a "
            "function of (seed, step, rank)",
            main_process_only=False,
        )
    try:
        # (the optimizers prepare() wrapped)
        with quiet_rng_load(), settings_from_flags(accelerator._optimizers):
            accelerator.load_state(str(path))
    except Exception as e:  # safetensors, pickle, torch and json each raise their own kinds
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"checkpoint {path} is corrupt or incompatible ({first}); pass another "
            "one to --resume or delete it"
        ) from None
    # load_state restored each rank's micro-step counter (none where a rank had no RNG file);
    # checkpoints are taken at optimizer steps, so every rank starts a new accumulation window:
    # count from 0 alike
    accelerator.step = 0
    return TrainState(
        epoch=meta["epoch"],
        step=meta["step"],
        batch_in_epoch=meta["batch_in_epoch"],
        run_id=meta.get("run_id", "legacy"),
        epoch_train=meta.get("epoch_train"),
        schedule_since=meta.get("schedule_since", meta["step"]),
        epoch_sums=meta.get("epoch_sums"),
    )


class _DropRngLoadNotice(logging.Filter):
    def filter(self, record):
        return "Could not load random states" not in record.getMessage()


@contextmanager
def quiet_rng_load():
    """load_state logs "Could not load random states" where a rank's file is missing or does not
    load (numpy 1.x/2.x pickles, another process count). Nothing depends on those files any more
    (loop.reseed): not said."""
    log, drop = logging.getLogger("accelerate.checkpointing"), _DropRngLoadNotice()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def read_history(path: Path) -> dict | None:
    """The metrics rows a checkpoint carries (metrics.jsonl, steps.jsonl), or None for an older
    checkpoint."""
    if not (path / HISTORY[0]).is_file():
        return None
    return {name: read_jsonl(path / name) for name in HISTORY}


def load_ema(ema, path: Path) -> bool:
    """EMA weights from a checkpoint, if it has them. Read on the host; load_state_dict copies them
    onto the EMA's own device (a CPU rank's accelerator.device is `cpu:0`, which safetensors does
    not take as a device)."""
    if not (path / EMA_FILE).is_file():
        return False
    try:
        ema.module.load_state_dict(load_file(path / EMA_FILE))
    except Exception as e:
        raise ConfigError(
            f"checkpoint {path}: {EMA_FILE} does not fit the model ({str(e).splitlines()[0][:160]})"
        ) from None
    return True
