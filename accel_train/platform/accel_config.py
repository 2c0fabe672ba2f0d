"""`python -m accel_train.platform.accel_config FILE`: launch.sh's check that an accelerate config
loads with accelerate's own loader (an unknown key, a bad `distributed_type` is an error) before
anything starts; prints the one-line reason and exits 1 where it does not, 3 (with the interpreter's
path) where this Python cannot import accelerate.

Importing accelerate costs ~2 s of CPU (torch comes with it), on every launch.sh start and relaunch
loop. A file that loaded is remembered by its contents and the accelerate and PyYAML versions that
read it (an empty marker file under ~/.cache/accel_train/, or $XDG_CACHE_HOME): the same file under
the same versions is not read again. Nothing else is cached, and a cache that cannot be written or
read only means the check runs every time.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from ..files import cache_dir


def marker(path: str) -> Path | None:
    """Where a successful check of this file's contents under these versions is remembered (None:
    not cacheable). The loader reads a name ending in .json as JSON, so that is part of the key
    too."""
    from importlib.metadata import version

    try:
        digest = hashlib.sha256(Path(path).read_bytes())
        digest.update(
            f"\0json {path.endswith('.json')}\0accelerate {version('accelerate')}"
            f"\0pyyaml {version('pyyaml')}".encode()
        )
    except Exception:
        return None
    root = cache_dir("valid_accelerate_configs")
    return root / digest.hexdigest() if root is not None else None


class CannotCheck(Exception):
    """The interpreter that runs the check cannot import accelerate: the config is not the
    problem."""


def problem(path: str) -> str | None:
    """None where accelerate's loader takes the file, else its reason in one line."""
    try:
        from accelerate.commands.config.config_args import load_config_from_file
    except ImportError as e:  # (the interpreter is named, not the config: it would load elsewhere)
        raise CannotCheck(
            f"{sys.executable} cannot import {e.name or 'accelerate'} ({e}): "
            "activate the environment accel_train is installed in, or set "
            "PYTHON=/path/to/its/python"
        ) from None
    try:
        load_config_from_file(path)
    except Exception as e:
        text = str(e).strip()
        return text.splitlines()[-1] if text else type(e).__name__
    return None


def main(argv: list[str] | None = None) -> int:
    (path,) = sys.argv[1:] if argv is None else argv
    seen = marker(path)
    try:
        if seen is not None and seen.is_file():
            return 0
    except OSError:
        seen = None
    try:
        why = problem(path)
    except CannotCheck as e:
        print(e)
        return 3
    if why is not None:
        print(why)
        return 1
    # (the file did not change while accelerate read it)
    if seen is not None and marker(path) == seen:
        try:
            seen.parent.mkdir(parents=True, exist_ok=True)
            seen.touch()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
