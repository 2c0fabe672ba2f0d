"""A checkpoint sent at start-up to the machines whose disk lacks it (resume.decide): the sender
reads its files, `broadcast_object_list` carries them, and each receiver writes a whole copy the way
a checkpoint is written (`.tmp-step_N`, then renamed), so that the machine can be lost again later.
A sender that cannot read its files or a receiver that cannot store them (a full disk) stops every
rank with the same one line, exit status 2, and leaves nothing partial behind, as a checkpoint that
cannot be written does."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from accelerate.utils import broadcast_object_list, gather_object

from ..errors import ConfigError
from ..files import write_output


def send_checkpoint(accelerator, source: int, here: Path, missing: list[int], final: Path) -> None:
    """Every rank calls this: rank `source` sends its checkpoint `here`; each rank in `missing`
    writes it to `final` (its own disk's path). A failure on either side: every rank raises the same
    ConfigError."""
    rank = accelerator.process_index
    sent = None
    if rank == source:
        try:
            sent = (_read_files(here), None, str(here))
        except OSError as e:
            sent = (None, _failure(e), str(here))
    files, error, there = broadcast_object_list([sent], from_process=source)[0]
    if error:
        raise ConfigError(
            f"rank {source} cannot read checkpoint {there} to send it to rank(s) "
            f"{missing}, whose disk lacks it ({error}); nothing was written; repair "
            "or remove that checkpoint (--resume auto then takes the newest one "
            "left) or pass --resume with another one"
        )
    tmp, error = final.parent / f".tmp-{final.name}", None
    if rank in missing:
        try:
            _write_copy(files, tmp, final)
        except OSError as e:
            error = _failure(e)
            shutil.rmtree(tmp, ignore_errors=True)
    del files
    failed = [
        (r, where, e)
        for r, (where, e) in enumerate(gather_object([(str(final.parent), error)]))
        if e
    ]
    accelerator.wait_for_everyone()  # (every partial copy is gone before anyone reports)
    if failed:
        r, where, error = failed[0]
        raise ConfigError(
            f"rank {r} cannot store the copy of checkpoint {final.name} it was sent "
            f"in {where} ({error}); the partial copy was removed; free space on that "
            "machine (or give it another --output_dir) and relaunch with "
            "--resume auto"
        )


def _failure(e: OSError) -> str:
    """An OSError in a few words: the file's name and the system's reason (ENOSPC: No space left on
    device)."""
    text = e.strerror or " ".join(str(e).split())[:160] or type(e).__name__
    return f"{Path(e.filename).name}: {text}" if e.filename else text


def _read_files(path: Path) -> dict[str, bytes]:
    files = {}
    for p in sorted(path.iterdir()):
        if p.is_file():
            try:
                files[p.name] = p.read_bytes()
            except OSError as e:  # (a failed read names no file)
                raise OSError(e.errno, e.strerror, str(p)) from None
    return files


def _write_copy(files: dict[str, bytes], tmp: Path, final: Path) -> None:
    """A received checkpoint, written the way save_checkpoint writes one: .tmp-, then rename."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, data in files.items():
        write_output(tmp / name, data)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
