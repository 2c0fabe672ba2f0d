"""Checks across ranks. A fact that can differ between ranks (a machine's own disk, data or
directory) becomes the same one-line error on every rank, said once, instead of some ranks raising
and the others waiting in the next collective until --timeout_s; a choice that must be one for all
is rank 0's."""

from __future__ import annotations

from contextlib import contextmanager

from accelerate.utils import broadcast_object_list, gather_object

from ..errors import ConfigError


@contextmanager
def said_once(accelerator):
    """Errors raised inside are raised alike on every rank (they come from gathered facts): print
    once."""
    try:
        yield
    except ConfigError as e:
        e.quiet = not accelerator.is_main_process
        raise


def on_every_rank(accelerator, check, *args, **kwargs):
    """Run a check that can fail on some ranks only on every rank; if it fails anywhere, every rank
    raises the same one-line error."""
    try:
        result, error = check(*args, **kwargs), None
    except ConfigError as e:
        result, error = None, str(e)
    failed = [
        (rank, msg) for rank, msg in gather_object([(accelerator.process_index, error)]) if msg
    ]
    if failed:
        rank, msg = failed[0]
        e = ConfigError(msg if len(failed) == accelerator.num_processes else f"rank {rank}: {msg}")
        e.quiet = not accelerator.is_main_process
        raise e
    return result


def same_everywhere(accelerator, what: str, value) -> None:
    """A fact every rank must share (e.g. the size of each machine's own copy of the data): one line
    if not."""
    values = gather_object([value])
    if any(v != values[0] for v in values):
        e = ConfigError(
            f"the machines disagree on {what}: rank 0 has {values[0]!r}, rank "
            f"{next(i for i, v in enumerate(values) if v != values[0])} has "
            f"{next(v for v in values if v != values[0])!r}; give every machine the "
            "same data"
        )
        e.quiet = not accelerator.is_main_process
        raise e


def rank0s(value):
    """Rank 0's value on every rank: one choice for all (a run id, the pipeline's device budget)."""
    return broadcast_object_list([value])[0]


def main_process_writes(accelerator, write, out):
    """`write()` on the main process; a write that fails there (a full disk, permissions) is one
    line on every rank (exit 2), not a traceback on one rank while the others wait. Returns
    write()'s value on the main process, None elsewhere."""

    def attempt():
        if not accelerator.is_main_process:
            return None
        try:
            return write()
        except OSError as e:
            raise ConfigError(
                f"cannot write the run's outputs in {out} ({e.strerror or e}); free "
                "space or fix the permissions, then run the same command with "
                "--resume auto: it continues from the newest checkpoint and writes "
                "them"
            ) from None

    return on_every_rank(accelerator, attempt)
