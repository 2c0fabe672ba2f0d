"""The run's files: every name accel_train writes in --output_dir and in a checkpoint, where
checkpoints are found, and the JSON-lines helpers. Nothing else in the package spells a file
name."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
from pathlib import Path

_FLAGS = {"w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND}


def open_output(path, mode: str = "w"):
    """A file of the run's outputs opened for writing (mode w, a, wb or ab), never through a link:
    a link planted in an output directory that someone else can write would redirect the write into
    a file of theirs choosing (O_NOFOLLOW). A link there is one line naming it."""
    flags = _FLAGS[mode[0]] | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise link_refused(path) from None
    return os.fdopen(fd, mode)


def link_refused(path):
    """The one-line error of an output path that is a link (os.open with O_NOFOLLOW: ELOOP)."""
    from .errors import ConfigError

    return ConfigError(
        f"{path} is a link (to {os.readlink(path)}): accel_train never writes "
        "through a link it did not make; remove it, or pass another --output_dir"
    )


def planted_links(out) -> list[str]:
    """Links in `out` where the run writes a file of its own ("name -> target"): the run makes none.
    A linked folder (checkpoints/ on another disk) is the user's and stays allowed."""
    names = {
        MODEL_FILE,
        MODEL_CONFIG_FILE,
        EMA_EXPORT_FILE,
        BEST_FILE,
        CONFIG_FILE,
        METRICS_FILE,
        STEPS_FILE,
        CURVES_FILE,
        LOCK_FILE,
    }
    try:
        entries = list(os.scandir(out))
    except OSError:
        return []
    return [
        f"{e.name} -> {os.readlink(e.path)}"
        for e in sorted(entries, key=lambda e: e.name)
        if e.is_symlink() and (e.name in names or e.name.startswith(".tmp-"))
    ]


def write_output(path, data: str | bytes) -> None:
    """Path.write_text / write_bytes, never through a link (open_output)."""
    with open_output(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


# --output_dir
MODEL_FILE = "model.safetensors"  # the trained model (main process only)
MODEL_CONFIG_FILE = "model_config.json"  # timm name, stem, the data's description, final metrics
EMA_EXPORT_FILE = "model_ema.safetensors"  # --ema: the EMA weights
BEST_FILE = "model_best.safetensors"  # the weights of the epoch with the best test_acc so far
CONFIG_FILE = "config.yaml"  # the run's flags: --config config.yaml reproduces it
METRICS_FILE = "metrics.jsonl"  # one row per epoch
STEPS_FILE = "steps.jsonl"  # one row per logged step
CURVES_FILE = "training_curves.png"
CKPT_DIR = "checkpoints"  # step_<global step>/ each
# in --output_dir: locked (lockf) by its writer, until that process ends
LOCK_FILE = ".accel_train.lock"
# --overwrite: an earlier run's checkpoint until this run has one
SET_ASIDE = ".overwritten-"
# in CKPT_DIR: the checkpoint a --resume PATH started the run from
ORIGIN_FILE = "resumed_from.json"
# in a checkpoint, beside Accelerate's own files (model.safetensors, optimizer.bin,
# random_states_<rank>.pkl)
STATE_FILE = "trainer_state.json"
EMA_FILE = "ema.safetensors"
RNG_PREFIX = "random_states_"
HISTORY = (METRICS_FILE, STEPS_FILE)  # the run's rows so far, carried by every checkpoint


def step_dir(output_dir, step: int) -> Path:
    return Path(output_dir) / CKPT_DIR / f"step_{step:08d}"


def checkpoint_dirs(output_dir, run_id: str | None = None) -> list[Path]:
    """Complete checkpoints (of one run, if given), oldest first."""
    root = Path(output_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if complete(p)]
    if run_id is not None:
        found = [p for p in found if _run_of(p) == run_id]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def resumed_from(output_dir, launch: str | None = None) -> Path | None:
    """The checkpoint an explicit --resume PATH started this output dir's run from, while it is
    complete: a relaunch's --resume auto continues from it until the run has saved its own.
    `launch`: only if recorded by that launch (launch.sh's ACCEL_TRAIN_RUN_ID: an --overwrite
    relaunch takes its own start, never an older one)."""
    try:
        record = json.loads((Path(output_dir) / CKPT_DIR / ORIGIN_FILE).read_text())
        path = Path(record["path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if launch is not None and record.get("launch") != launch:
        return None
    return path if complete(path) and (path / MODEL_FILE).is_file() else None


def seal(folder: Path, meta: dict) -> None:
    """A checkpoint's last write: every file in it flushed to the disk (fsync), their sizes and
    SHA-256 digests recorded in its trainer_state.json (beside the run's id and the step), which is
    written and flushed last: after a crash of the machine a "complete" step never holds data the
    disk did not get, and a file swapped in from another run or step is found on resume."""
    sizes, digests = {}, {}
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name != STATE_FILE:
            with open(p, "rb") as f:
                digest = sha256_of(f)
                os.fsync(f.fileno())
            # (optional: a resume does without them, docs/outputs_and_resume.md)
            if not p.name.startswith(RNG_PREFIX):
                sizes[p.name], digests[p.name] = p.stat().st_size, digest
    with open_output(folder / STATE_FILE) as f:
        json.dump({**meta, "files": sizes, "digests": digests}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def sync_dir(folder: Path) -> None:
    """A rename into `folder` made durable (the directory's entry flushed); where a file system
    cannot, nothing."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(f) -> str:
    """The SHA-256 of an open binary file, read in 1 MiB blocks (hashlib.file_digest is 3.11's)."""
    digest = hashlib.sha256()
    while block := f.read(1 << 20):
        digest.update(block)
    return digest.hexdigest()


def swapped(path: Path) -> list[str]:
    """The files of a checkpoint whose SHA-256 is not the one its seal recorded (replaced by another
    run's or step's, or changed on disk); none for a checkpoint of an older accel_train, which
    records no digests."""
    meta = json.loads((Path(path) / STATE_FILE).read_text())
    found = []
    for name, digest in (meta.get("digests") or {}).items():
        with open(Path(path) / name, "rb") as f:
            if sha256_of(f) != digest:
                found.append(name)
    return found


def complete(path: Path) -> bool:
    """A checkpoint is complete when its trainer_state.json reads and every file it lists has the
    size it recorded (one of an older accel_train lists none: the file alone)."""
    try:
        meta = json.loads((Path(path) / STATE_FILE).read_text())
        files = meta.get("files", {})
        return all((Path(path) / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def damage(path: Path) -> str | None:
    """Why the checkpoint folder `path` is not complete (None: it is)."""
    try:
        meta = json.loads((Path(path) / STATE_FILE).read_text())
        files = meta.get("files", {})
    except (OSError, ValueError) as e:
        return f"its {STATE_FILE} does not read ({getattr(e, 'strerror', None) or e})"
    if not isinstance(files, dict):
        return f"its {STATE_FILE} lists no files"
    for name, size in files.items():
        try:
            found = (Path(path) / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if found != size:
            return f"{name} has {found} bytes, {size} when it was written"
    return None


def _run_of(path: Path) -> str | None:
    try:
        return json.loads((path / STATE_FILE).read_text()).get("run_id", "legacy")
    except (OSError, ValueError):
        return None


def dumps(row: dict) -> str:
    """One JSON line; a non-finite float becomes null (json.dumps would write NaN, which is not
    JSON)."""
    return json.dumps(
        {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()},
        allow_nan=False,
    )


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def nothing_to_resume(output_dir) -> str:
    """The start-up line of a --resume auto that found no complete checkpoint, with the steps an
    earlier run logged (a run killed before its first checkpoint): they are lost, and trained
    again."""
    out, steps = Path(output_dir), []
    try:
        for line in (out / STEPS_FILE).read_text().splitlines():
            try:
                steps.append(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # (a line cut short by the kill)
    except OSError:
        pass
    lost = (
        f"; the steps up to step {max(steps)} that an earlier run logged in {STEPS_FILE} are "
        "lost: it stopped before its first checkpoint (--checkpoint_every N saves one every "
        "N steps)"
        if steps
        else ""
    )
    return (
        f"--resume auto: nothing to resume (no complete checkpoint in {out / CKPT_DIR}): "
        f"training starts at step 1{lost}"
    )


def cache_dir(name: str) -> Path | None:
    """~/.cache/accel_train/<name> ($XDG_CACHE_HOME): what a start remembers for the next
    (accel_config: configs that loaded; precision/: its verdicts). None where there is no home:
    nothing is remembered."""
    try:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (RuntimeError, KeyError):
        return None
    return root / "accel_train" / name


def missing_dirs(path) -> list[Path]:
    """The directories of `path` that do not exist yet, deepest first: what this run would
    create."""
    out, missing = Path(path).absolute(), []
    while not out.exists() and out != out.parent:
        missing.append(out)
        out = out.parent
    return missing


def remove_if_empty(dirs: list[Path]) -> None:
    """A refused run leaves no empty --output_dir behind: remove the directories it created, deepest
    first, as long as they are empty (rmdir never removes content, whoever wrote it)."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def publish(tmp: Path, final: Path) -> bool:
    """`tmp` renamed to `final` (then made durable); False where another survivor on the same
    storage renamed its complete copy first. An incomplete directory under the name (never a
    complete step: a crash's leftover) is replaced, not taken for another survivor's copy
    (os.replace onto a non-empty directory fails: the complete save would be discarded)."""
    for _ in range(2):
        try:
            os.replace(tmp, final)
            sync_dir(final.parent)
            return True
        except OSError:
            if complete(final):
                break
            shutil.rmtree(final, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return False
