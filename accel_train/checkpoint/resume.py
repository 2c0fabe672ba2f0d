"""One start-up decision per job, taken by every rank from the same gathered facts.

Every rank reports what it sees (its flags, the complete checkpoints on its own disk, which
machines' probe files are visible in its output directory); `accelerate.utils.gather_object` gives
every rank all the reports, and each rank computes the same answers from them:

- the flags agree on every machine (else one line naming the flag, before any collective can hang);
- who writes checkpoints: one process per storage (the main process for a shared --output_dir, each
  machine's local main process when every machine has its own disk);
- which checkpoint the job resumes from (`--resume auto`: the newest complete one that any machine
  holds, of the one run found there; with --overwrite, under launch.sh's relaunch, only of the run
  that --overwrite started), and that it belongs to the run in --output_dir;
- a machine whose disk lacks it receives its files from a machine that has it (transfer.py);
- whether the checkpoint's run math (global batch, model, seed, data) allows this resume, and the
  per-process batch on a different number of processes (elastic resume).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from accelerate.logging import get_logger
from accelerate.utils import gather_object

from ..config.defaults import BATCH_SIZE
from ..config.resolved import with_values
from ..config.train_config import TrainConfig
from ..errors import ConfigError
from ..files import (
    CKPT_DIR,
    MODEL_CONFIG_FILE,
    MODEL_FILE,
    STATE_FILE,
    checkpoint_dirs,
    complete,
    damage,
    nothing_to_resume,
    resumed_from,
    step_dir,
)
from ..model.own_model import same_callable
from ..platform.ranks import rank0s
from .changes import PER_MACHINE, check_changes
from .output_dir import AUTOMATIC, RUN_ID_ENV, RUN_MATH, others, refuse_fresh_run, unfinished_alike
from .transfer import send_checkpoint

PROBE = ".accel_train-probe-"
# the id a fresh run takes: launch.sh sets one per invocation, the same on each of its relaunches,
# so that a relaunch of an --overwrite run (--overwrite with --resume auto) resumes that run's
# checkpoints only, never the replaced run's


@dataclass
class Decision:
    writer: bool  # this process writes checkpoints to its disk
    shared: bool  # one --output_dir seen by every machine
    num_machines: int
    resume_from: Path | None  # a complete checkpoint on this process's own disk
    meta: dict | None  # its trainer_state.json
    run_id: str
    # --overwrite: an earlier run's checkpoints, to delete
    overwritten: list[Path] = field(default_factory=list)
    # newer steps of the branch a resume from an older one leaves
    abandoned: list[Path] = field(default_factory=list)
    # the checkpoint an explicit --resume PATH starts from (recorded for relaunches)
    origin: Path | None = None
    # the run's own settings this machine takes from another machine's record (share_the_record)
    adopted: dict = field(default_factory=dict)


def _report(accelerator, cfg: TrainConfig, out: Path, job: str, taken: dict | None = None) -> dict:
    listing = []
    for path in checkpoint_dirs(out):
        try:
            meta = json.loads((path / STATE_FILE).read_text())
            listing.append((int(meta["step"]), meta.get("run_id", "legacy")))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a checkpoint accel_train wrote
    # --resume PATH; for --resume auto, the one that started this run (files.resumed_from)
    explicit, given = None, None
    if cfg.resume:
        given = (
            Path(cfg.resume)
            if cfg.resume != "auto"
            else resumed_from(out, (os.environ.get(RUN_ID_ENV) or "") if cfg.overwrite else None)
        )
    if given is not None:
        p = given
        if complete(p) and (p / MODEL_FILE).is_file():
            try:
                meta = json.loads((p / STATE_FILE).read_text())
                explicit = (meta["step"], meta.get("run_id", "legacy"))
            except (OSError, ValueError, KeyError, TypeError):
                explicit = None
    probes = (
        sorted(int(p.name.rsplit("-", 1)[1]) for p in out.glob(f"{PROBE}{job}-*"))
        if accelerator.is_local_main_process
        else None
    )
    flags = {k: v for k, v in cfg.to_dict().items() if k not in PER_MACHINE}
    # the resume mode must agree (the path itself may be each machine's own), and so must
    # init_from's presence
    flags["resume"] = cfg.resume if cfg.resume in (None, "auto") else "a checkpoint path"
    flags["init_from"] = "a weights file" if cfg.init_from else None
    flags["pretrained_path"] = "a weights file" if cfg.pretrained_path else None
    # what this disk's checkpoints are, said by the machine that holds them (a fresh run is
    # refused with it)
    alike = unfinished_alike(cfg, out) if listing and not cfg.resume and not cfg.overwrite else None
    return {
        "rank": accelerator.process_index,
        "local_main": accelerator.is_local_main_process,
        "flags": flags,
        "listing": listing,
        "damaged": damaged(out),
        "explicit": explicit,
        "given": given and str(given),
        "probes": probes,
        "out": str(out),
        "alike": alike and (alike["step"], reached(alike), *([True] if alike["finished"] else [])),
        "launch": os.environ.get(RUN_ID_ENV) or None,
        # what this machine's command line took from the run's record (None: it read none)
        "from_run": (
            None if taken is None else {k: v for k, v in taken.items() if k not in PER_MACHINE}
        ),
    }


def reached(meta: dict) -> str:
    """Where a checkpoint's trainer_state.json stands, in words: its epoch (0-based) is the next one
    at an epoch's end."""
    epoch, batch = meta.get("epoch", 0), meta.get("batch_in_epoch", 0)
    return f"the end of epoch {epoch}" if batch == 0 and epoch > 0 else f"in epoch {epoch + 1}"


def damaged(out: Path) -> list[tuple[int, str]]:
    """(step, why) of each checkpoint folder in `out` that is not complete (a full disk, a truncated
    copy)."""
    root, found = out / CKPT_DIR, []
    for path in root.glob("step_*") if root.is_dir() else ():
        if path.name[5:].isdigit() and (why := damage(path)) is not None:
            found.append((int(path.name[5:]), why))
    return sorted(found)


def say_damaged(reports: list[dict], out: Path, step: int | None, log) -> None:
    """--resume auto takes the newest complete checkpoint: one line for each newer one it skips."""
    skipped = {(s, why) for r in reports for s, why in r["damaged"] if step is None or s > step}
    for s, why in sorted(skipped):
        then = (
            f"resuming from {step_dir(out, step).name}" if step is not None else "none is complete"
        )
        log(
            f"--resume auto: skipping checkpoint {step_dir(out, s)}: damaged ({why}); {then} (a "
            "save of that step replaces the folder)"
        )


def share_the_record(cfg: TrainConfig, reports: list[dict], rank: int, log) -> dict:
    """A resume on a machine whose disk lost the run's config.yaml (a machine replaced with an empty
    disk) takes what the other machines' command lines took from theirs: every machine then trains
    the same run (their command lines are the same; _check_flags). Returns the settings this
    machine takes ({}: none); the reports' flags say them for the check."""
    if not cfg.resume:
        return {}
    donor = next((r for r in reports if r.get("from_run") is not None), None)
    if donor is None:
        return {}
    for r in reports:
        if r.get("from_run") is None:
            r["flags"].update(donor["from_run"])
    if reports[rank].get("from_run") is None and donor["from_run"]:
        with_values(cfg, donor["from_run"])  # (validated: a value it refuses is refused here)
        log(
            f"resume: this machine has no record of the run; rank {donor['rank']}'s: "
            + " ".join(f"--{k} {v}" for k, v in donor["from_run"].items())
        )
        return dict(donor["from_run"])
    return {}


def _check_flags(reports: list[dict]) -> None:
    first = reports[0]["flags"]
    for r in reports[1:]:
        for key, value in r["flags"].items():
            if first.get(key) != value:
                raise ConfigError(
                    f"the machines were started with different flags: --{key} is "
                    f"{first.get(key)!r} on rank 0 but {value!r} on rank "
                    f"{r['rank']}; pass the same training flags on every machine"
                )


def _storage(reports: list[dict], rank: int) -> tuple[bool, bool, int]:
    """(this process writes checkpoints, the output dir is shared, number of machines)."""
    mains = [r for r in reports if r["local_main"]]
    every = sorted(r["rank"] for r in mains)
    if all(r["probes"] == every for r in mains):
        shared = True
    elif all(r["probes"] == [r["rank"]] for r in mains):
        shared = False
    else:
        raise ConfigError(
            "--output_dir is shared by some machines but not all; give every machine "
            "its own directory or one that all of them share"
        )
    me = reports[rank]
    writer = rank == 0 if shared else me["local_main"]
    return writer, shared or len(mains) == 1, len(mains)


def _choose(
    resume: str | None, overwrite: bool, reports: list[dict]
) -> tuple[tuple[int, str] | None, set[str]]:
    """The (step, run_id) every rank resumes from (--resume `resume`, --overwrite `overwrite`), or
    None; and the runs found in the output dirs."""
    runs = {run for r in reports for _, run in r["listing"]}
    if not resume:
        return None, runs
    # launch.sh's relaunch of an --overwrite run: that run's only
    if resume == "auto" and overwrite:
        ours = {r["launch"] for r in reports} | {
            r["explicit"][1] for r in reports if r.get("explicit")
        }
        # (this launch's run id, or the run of the checkpoint its --resume PATH started from)
        ours -= {None}
        if not ours:
            raise ConfigError(
                "--overwrite true starts a new run (setting the checkpoints in "
                "--output_dir aside), --resume auto continues one: pass one of them "
                "(launch.sh --max_restarts relaunches an --overwrite run with both "
                "and resumes only that run's own checkpoints)"
            )
        found = [
            e for r in reports for e in [*r["listing"], r.get("explicit")] if e and e[1] in ours
        ]
        return (max(found) if found else None), runs
    if resume == "auto":
        if len(runs) > 1:
            raise ConfigError(
                f"--output_dir holds checkpoints of {len(runs)} different runs "
                f"({', '.join(sorted(runs))}); keep one run per output directory "
                "(move the others away)"
            )
        # (own, or its start)
        found = [entry for r in reports for entry in [*r["listing"], r.get("explicit")] if entry]
        return (max(found) if found else None), runs
    held = [r["explicit"] for r in reports if r["explicit"]]
    if not held:
        raise ConfigError(
            f"--resume {resume}: not a complete checkpoint on any machine (no "
            f"{STATE_FILE} / {MODEL_FILE}, or a file shorter than it recorded); pass "
            f"a {CKPT_DIR}/step_N directory or --resume auto"
        )
    return held[0], runs


def decide(accelerator, cfg: TrainConfig, out: Path, log, taken: dict | None = None) -> Decision:
    """Every rank calls this once, right after the Accelerator is built and the output dir
    checked. `taken`: what this machine's command line took from the run's record (Taken.settings;
    None: it read none)."""
    rank = accelerator.process_index
    job = rank0s(uuid.uuid4().hex[:12] if rank == 0 else None)  # this job's probes only
    probe = out / f"{PROBE}{job}-{rank}"
    if accelerator.is_local_main_process:
        probe.touch()
    accelerator.wait_for_everyone()
    try:
        reports = gather_object([_report(accelerator, cfg, out, job, taken)])
        accelerator.wait_for_everyone()  # every machine has looked before the probes go
    finally:
        probe.unlink(missing_ok=True)
        for stale in out.glob(PROBE + "*"):  # left by a job killed here
            if not stale.name.startswith(f"{PROBE}{job}-"):
                stale.unlink(missing_ok=True)
    adopted = share_the_record(cfg, reports, rank, log)
    _check_flags(reports)
    writer, shared, machines = _storage(reports, rank)
    target, runs = _choose(cfg.resume, cfg.overwrite, reports)
    if cfg.resume == "auto":
        say_damaged(reports, out, target[0] if target else None, log)

    if target is None:
        # (an --overwrite relaunch: the earlier run's are set aside, said then)
        if cfg.resume == "auto" and not runs:  # (a mistyped --output_dir trains from scratch)
            get_logger("accel_train").warning(nothing_to_resume(out), main_process_only=True)
        if runs and not cfg.overwrite:
            refuse_fresh_run(reports, shared)
        run_id = reports[0]["launch"] or rank0s(uuid.uuid4().hex[:12] if rank == 0 else None)
        return Decision(
            writer,
            shared,
            machines,
            None,
            None,
            run_id,
            others(out, run_id) if runs and writer else [],
            adopted=adopted,
        )

    step, run_id = target
    # (launch.sh's relaunch: the other runs are set aside)
    replacing = cfg.overwrite and cfg.resume == "auto"
    if replacing:
        log(
            "--overwrite with --resume auto (launch.sh's relaunch): resuming the new run "
            f"{run_id}; the checkpoints of other runs are set aside"
        )
    elif runs - {run_id}:
        raise ConfigError(
            f"--resume {cfg.resume}: the checkpoint belongs to run {run_id} but "
            f"{out}/{CKPT_DIR} holds checkpoints of run(s) "
            f"{', '.join(sorted(runs - {run_id}))}; resume into that run's "
            "--output_dir or an empty one"
        )
    explicit = cfg.resume != "auto"
    newer = sorted({s for r in reports for s, run in r["listing"] if run == run_id and s > step})
    # (--resume auto takes the newest: only a checkpoint path can leave newer ones behind)
    if newer:
        log(
            f"--resume {cfg.resume}: this run's newer checkpoint(s) "
            f"{', '.join(step_dir(out, s).name for s in newer)} belong to the branch this resume "
            "abandons; they are set aside now and deleted when it saves its first checkpoint"
        )
    # a rank reads the checkpoint from --resume PATH (or the one that started the run) if its
    # machine has it, else from its output dir
    at_path = [r["explicit"] == target for r in reports]
    in_out = [target in r["listing"] for r in reports]
    needs = [not a and not o for a, o in zip(at_path, in_out)]
    local = (
        Path(reports[rank]["given"]) if at_path[rank] and not in_out[rank] else step_dir(out, step)
    )
    if shared:  # one storage: its writer (rank 0) writes the copy if any rank needs it there
        missing = [0] if any(needs) else []
    else:  # each machine's writer (its local main process) for its own ranks
        missing = [r["rank"] for r, need in zip(reports, needs) if need and r["local_main"]]
    if missing:
        source = next(r for r in range(len(reports)) if at_path[r] or in_out[r])
        log(f"resume: rank(s) {missing} lack checkpoint step {step}; rank {source} sends it")
        send_checkpoint(accelerator, source, local, missing, step_dir(out, step))
    meta = json.loads((local / STATE_FILE).read_text())
    abandoned = [p for p in map(partial(step_dir, out), newer) if p.is_dir()] if writer else []
    return Decision(
        writer,
        shared,
        machines,
        local,
        meta,
        run_id,
        others(out, run_id) if replacing and writer else [],
        abandoned,
        local if explicit else None,
        adopted,
    )


def reconcile(meta: dict, cfg: TrainConfig, num_processes: int, log) -> dict:
    """Keep the checkpoint's math on resume: refuse what would change it, derive the per-process
    batch when the number of processes changed or --batch_size is left to its default (the
    checkpoint's global batch is kept, never re-derived from the data). Returns the settings the
    resume takes: {setting: the run's value} (the automatic ones the checkpoint's, the per-process
    batch); `cfg` is only read."""
    old = meta.get("run")
    if not old:  # a checkpoint of an older accel_train: only its process count was recorded
        if meta.get("num_processes", num_processes) != num_processes:
            raise ConfigError(
                "the checkpoint was written by an older accel_train on "
                f"{meta['num_processes']} processes and records no global batch; "
                f"resume it on {meta['num_processes']} processes"
            )
        return {"batch_size": cfg.batch_size or BATCH_SIZE}  # (its default then)
    if cfg.grad_accum != old["grad_accum"]:
        raise ConfigError(
            f"--grad_accum {cfg.grad_accum} differs from the checkpoint's "
            f"{old['grad_accum']}; resume with --grad_accum {old['grad_accum']} (the "
            "per-process batch follows the process count)"
        )
    kept = keep_run_math(old, cfg)
    check_changes(old.get("settings") or {}, with_values(cfg, kept))
    glob, batch = old["global_batch"], kept.get("batch_size", cfg.batch_size)
    if num_processes != old["num_processes"] or batch is None:
        per, rest = divmod(glob, num_processes * cfg.grad_accum)
        if rest or per < 1:
            works = [
                n for n in range(1, glob // cfg.grad_accum + 1) if (glob // cfg.grad_accum) % n == 0
            ][:12]
            raise ConfigError(
                f"the checkpoint's global batch {glob} cannot be split over "
                f"{num_processes} processes x --grad_accum {cfg.grad_accum}; resume "
                f"on one of {works} processes"
            )
        if num_processes != old["num_processes"] and per != batch:
            log(
                f"elastic resume: {old['num_processes']} -> {num_processes} processes; per-process "
                f"batch {batch or old['batch_size']} -> {per} keeps the checkpoint's "
                f"global batch {glob}"
            )
        kept["batch_size"] = per
    elif batch * num_processes * cfg.grad_accum != glob:
        raise ConfigError(
            f"--batch_size {batch} x {num_processes} processes x "
            f"--grad_accum {cfg.grad_accum} changes the checkpoint's global batch "
            f"{glob}; resume with --batch_size "
            f"{glob // (num_processes * cfg.grad_accum)} (or start a fresh run)"
        )
    if cfg.epochs != old["epochs"]:
        log(
            f"--epochs {old['epochs']} -> {cfg.epochs}: the lr schedule is rebuilt for "
            f"{cfg.epochs} epochs and continues from the current step on it"
        )
    return kept


def _flag_value(key: str, value):
    """A run-math value as a flag spells it (mean/std: 'R,G,B')."""
    return (
        ",".join(f"{v:g}" for v in value) if key in ("mean", "std") and value is not None else value
    )


def keep_run_math(old: dict, cfg: TrainConfig) -> dict:
    """Refuse a flag that changes the checkpoint's run math (one line naming it); automatic values
    take the checkpoint's (so a resume neither re-derives the image size nor recomputes mean/std):
    returns them, {setting: the checkpoint's value}; `cfg` is only read."""
    kept = {}
    mean_std = dict(zip(("mean", "std"), cfg.normalisation()))
    for key in RUN_MATH:
        if key not in old:  # a checkpoint of an older accel_train
            continue
        now = (
            cfg.model_kwargs_dict()
            if key == "model_kwargs"
            else mean_std[key]
            if key in mean_std
            else getattr(cfg, key)
        )
        then = tuple(old[key]) if key in mean_std and old[key] is not None else old[key]
        if now in AUTOMATIC:
            kept[key] = _flag_value(key, then)
        elif now != then and not (key == "model" and same_callable(now, then)):
            raise ConfigError(
                f"--{key} {_flag_value(key, now)!r} differs from the checkpoint's "
                f"{_flag_value(key, then)!r}: resuming would change the run; resume "
                + (
                    f"with --{key} {_flag_value(key, then)}"
                    if then is not None
                    else f"without --{key}"
                )
                + " or start a fresh run in another --output_dir"
            )
    return kept


def batches_done(meta: dict, batch_size: int, num_processes: int) -> int:
    """The checkpoint's batches done in the epoch (per rank), in this run's per-rank batches: the
    same samples."""
    old = meta.get("run")
    if not old:
        return meta["batch_in_epoch"]
    return (
        meta["batch_in_epoch"]
        * old["batch_size"]
        * old["num_processes"]
        // (batch_size * num_processes)
    )


def check_data(meta: dict, train_size: int, classes=None, checkpoint: Path | None = None) -> None:
    """The data's size and (where the checkpoint records them: its model_config.json) its classes
    are the run's."""
    old = (meta.get("run") or {}).get("train_size")
    if old is not None and old != train_size:
        raise ConfigError(
            f"the checkpoint was trained on {old} training samples, this data has "
            f"{train_size}; resume with the same data (--train_samples / --data_dir) "
            "or start a fresh run"
        )
    try:
        facts = json.loads((checkpoint / MODEL_CONFIG_FILE).read_text()) if checkpoint else {}
        then = facts["classes"]
    except (OSError, ValueError, KeyError, TypeError):
        then = None
    if classes is not None and then is not None and list(classes) != list(then):
        raise ConfigError(
            f"the data's classes ({', '.join(classes)}) differ from the "
            f"checkpoint's ({', '.join(then)}); resume with the run's --data_dir or "
            "start a fresh run"
        )
