"""The runs an output directory holds. Every checkpoint records its run's id (trainer_state.json): a
fresh run where another run's checkpoints are is refused in one line, said with the facts of the
machine that holds them; --overwrite sets the other runs' checkpoints aside, and so does a resume
from an older step with the newer steps of the branch it abandons (start_branch: one rule for every
way a step is written); a resume keeps the run's math."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from ..config.recipes import RECIPE_FLAGS
from ..config.train_config import TrainConfig
from ..errors import ConfigError
from ..files import (
    CKPT_DIR,
    LOCK_FILE,
    MODEL_FILE,
    ORIGIN_FILE,
    SET_ASIDE,
    STATE_FILE,
    checkpoint_dirs,
    link_refused,
    planted_links,
)

# the run's math: a resume that changes one of these is refused (the global batch has its own rule);
# the input size, normalisation and augmentation too. An automatic value (--stem auto, no
# --image_size/--mean/--std) takes the checkpoint's.
RUN_MATH = (
    "model",
    "stem",
    "model_kwargs",
    "seed",
    "data",
    "image_size",
    "mean",
    "std",
    "augment",
    "hflip",
    "freeze",
    "val_split",
    *RECIPE_FLAGS,
)
AUTOMATIC = (None, "auto")
RUN_ID_ENV = "ACCEL_TRAIN_RUN_ID"  # launch.sh's run id, the same for every attempt of one launch
# output dir -> (the open lock file of this process, whether this process made it)
HELD: dict[str, tuple] = {}


def others(out: Path, run_id: str) -> list[Path]:
    """--overwrite: the checkpoints on this disk that are not of the run `run_id`."""
    own = checkpoint_dirs(out, run_id)
    return [p for p in checkpoint_dirs(out) if p not in own]


def refuse_fresh_run(reports: list[dict], shared: bool) -> None:
    """A fresh run where a machine's --output_dir holds checkpoints: one line, said about the first
    machine that holds them (by that machine's facts: its folder, its checkpoints' run)."""
    holder = next(r for r in reports if r["listing"])
    where = f"{holder['out']}/{CKPT_DIR}"
    if not shared:
        where = f"on rank {holder['rank']}'s machine, {where}"
    # the user's own finished run, the same command run again
    if holder["alike"] and len(holder["alike"]) > 2:
        step, reached, _ = holder["alike"]
        raise ConfigError(
            f"{where} holds your finished run with these settings ({MODEL_FILE} "
            f"written, last checkpoint step {step}, {reached}); to train it longer "
            "pass --resume auto with a larger --epochs, to train it again from the "
            "start --overwrite true (or another --output_dir)"
        )
    # most often the user's own interrupted run, started again with the same command
    if holder["alike"]:
        step, reached = holder["alike"]
        raise ConfigError(
            f"{where} holds an unfinished run with these settings (newest "
            f"checkpoint: step {step}, {reached}); continue it with --resume auto "
            "(or start over: --overwrite true deletes its checkpoints, or another "
            "--output_dir)"
        )
    raise ConfigError(
        f"{where} already holds checkpoints of another run; pass --resume auto to "
        "continue it, another --output_dir, or --overwrite true to delete them"
    )


def unfinished_alike(cfg: TrainConfig, out: Path) -> dict | None:
    """The newest checkpoint's trainer_state.json if its run has the run math of these flags (what a
    resume would accept; an automatic value takes the checkpoint's), else None; "finished": whether
    it exported its model."""
    found = checkpoint_dirs(out)
    if not found:
        return None
    try:
        meta = json.loads((found[-1] / STATE_FILE).read_text())
        old = meta.get("run") or {}
        now = {
            key: cfg.model_kwargs_dict() if key == "model_kwargs" else getattr(cfg, key)
            for key in RUN_MATH
        }
        # (auto: whatever it was)
        alike = all(old.get(k, v) == v for k, v in now.items() if v not in AUTOMATIC)
        return (
            {**meta, "finished": (out / MODEL_FILE).is_file()} if alike and "step" in meta else None
        )
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def start_branch(output_dir, decision, keep_origin: bool) -> None:
    """At the end of start-up (every input checked), on each writer. The checkpoints no step of this
    run may follow are renamed out of every listing (`.overwritten-step_N`: neither resumed, nor
    taken for a step already saved, nor named by an error): --overwrite's earlier runs, and the
    newer steps of the branch that a resume from an older step abandons. They are deleted once this
    run has a complete checkpoint of its own (delete_set_aside); a run that fails before that leaves
    them aside, so a relaunch with --resume auto continues this branch (a survivor's save of the new
    branch is never skipped over for the abandoned branch's newer step). Where an explicit --resume
    PATH started the run, that checkpoint is recorded (ORIGIN_FILE, files.resumed_from): --resume
    auto continues from the newest complete step of the run, which is that checkpoint until the run
    saves its own (launch.sh's relaunch passes --resume auto). A fresh run drops an earlier
    record."""
    if not decision.writer:
        return
    set_aside(decision.overwritten, "--overwrite", "of an earlier run")
    set_aside(
        decision.abandoned,
        f"--resume {Path(str(decision.origin)).name}",
        "of the branch this resume from an older step abandons",
    )
    record = Path(output_dir) / CKPT_DIR / ORIGIN_FILE
    if decision.origin is not None:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(
            json.dumps(
                {"path": str(decision.origin.resolve()), "launch": os.environ.get(RUN_ID_ENV)}
            )
        )
    elif not keep_origin:
        record.unlink(missing_ok=True)


def set_aside(paths: list[Path], flag: str, why: str) -> None:
    for path in paths:
        logging.getLogger("accel_train").info(
            f"{flag}: setting {path} {why} aside; it is deleted "
            "once this run has saved a checkpoint"
        )
        aside = path.with_name(SET_ASIDE + path.name)
        try:
            # (one set aside before whose deletion did not happen)
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(path, aside)
        except OSError as e:
            raise ConfigError(
                f"cannot rename {path} ({e}) to set it aside; delete it by hand, or "
                "another --output_dir"
            ) from e


def delete_set_aside(root: Path) -> None:
    for path in sorted(root.glob(SET_ASIDE + "step_*")):
        logging.getLogger("accel_train").info(
            f"deleting {path}, set aside at the start of this run"
        )
        shutil.rmtree(path, ignore_errors=True)


def check_output_dir_free(out: Path) -> None:
    """Before the resume decision (whose refusals would otherwise speak first): a directory another
    job is writing is one line naming it. Rank 0 looks (another machine's own directory is held
    after the decision)."""
    hold_output_dir(out)
    release_output_dir(out, refused=True)  # (as it was: a lock file this look made is removed)


def hold_output_dir(out: Path) -> None:
    """Each writer of an --output_dir (rank 0 for a shared one, else each machine's local main
    process) holds an exclusive lock on it for the run: two jobs never write one output directory at
    once (a relaunch into the directory of a killed launcher's ranks, which trained on, had both
    delete each other's checkpoint writes). The second gets one line naming the holder.

    The lock is a POSIX record lock (fcntl.lockf) on LOCK_FILE: the kernel's, owned by this process
    alone, so it ends with the process however the process ends; the processes it forks (DataLoader
    workers, which outlive a killed trainer by seconds) hold nothing through the descriptor they
    inherit, as they would with flock. Any close of that file in this process drops such a lock:
    HELD keeps its one descriptor, and nothing else in accel_train opens the file. Only a lock on
    the file at the path counts: a release may delete the file a refused start made, so a lock taken
    on a file deleted meanwhile (opened before the delete) is let go and the path opened again."""
    key = str(out.resolve())
    if key in HELD:
        return
    if links := planted_links(out):
        raise ConfigError(
            f"--output_dir {out} holds {', '.join(links)}: accel_train never writes "
            "through a link it did not make; remove the link(s), or pass another "
            "--output_dir"
        )
    path = out / LOCK_FILE
    while True:
        fd, made = open_lock_file(path)
        if fd is None:  # (deleted between the looks: open again)
            continue
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            refuse(out, fd)
        if same_file(fd, path):
            break
        # (deleted by its holder after this open: the lock that counts is on the new one)
        os.close(fd)
    os.ftruncate(fd, 0)
    facts = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
    os.pwrite(fd, json.dumps(facts).encode(), 0)
    HELD[key] = fd, made


def refuse(out: Path, fd: int) -> None:
    """The one line naming the job that holds `out` (read from its lock file, open at `fd`)."""
    holder = {}
    for _ in range(20):  # (its holder writes who it is right after it locked)
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
            break
        except ValueError:
            time.sleep(0.05)
    os.close(fd)
    since = (
        "?"
        if "since" not in holder
        else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
    )
    raise ConfigError(
        f"--output_dir {out} is being written by another job (host "
        f"{holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {since}); "
        "wait for it to end or stop it, or pass another --output_dir"
    ) from None


def open_lock_file(path: Path) -> tuple[int | None, bool]:
    """(A descriptor of the lock file, whether this open made it); (None, False) where the file was
    deleted between the two looks."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644), True
    except FileExistsError:
        pass
    try:
        return os.open(path, os.O_RDWR | os.O_NOFOLLOW), False
    except FileNotFoundError:
        return None, False
    except OSError as e:  # (ELOOP: a link planted where the lock file goes)
        if e.errno != errno.ELOOP:
            raise
        raise link_refused(path) from None


def same_file(fd: int, path: Path) -> bool:
    """Whether `path` is still the file open at `fd` (not deleted, nor replaced by a new one)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def release_output_dir(out, refused: bool = False) -> None:
    """The end of a run in this process (a script may start another one in the same directory). A
    refused start leaves the directory as it was: the lock file removed if it made it (while still
    locked: a job waiting for it then finds the path gone and opens it again), else emptied as it
    was."""
    fd, made = HELD.pop(str(Path(out).resolve()), (None, False))
    if fd is not None:
        if refused and made:
            Path(out, LOCK_FILE).unlink(missing_ok=True)
        else:  # who held it is no longer true
            os.ftruncate(fd, 0)
        os.close(fd)
