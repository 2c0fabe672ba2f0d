"""The words and line breaks of the lines a user reads: a count in words, a final or error line on
a line of its own."""

from __future__ import annotations

import sys


def counted(n: int, noun: str) -> str:
    """'1 step', '3 steps', '1 class', '2 classes': a count in words, for the lines a user reads."""
    return (
        f"{n} {noun}"
        if n == 1
        else f"{n} {noun}{'es' if noun.endswith(('s', 'sh', 'ch', 'x')) else 's'}"
    )


def end_progress_line() -> bool:
    """A final or error line starts on a line of its own: an open progress bar (tqdm redraws its
    line after a carriage return and ends it only when closed) is closed first, which ends its line.
    True if one was open."""
    bars = list(getattr(getattr(sys.modules.get("tqdm.std"), "tqdm", None), "_instances", ()))
    for bar in bars:
        bar.close()
    return any(not bar.disable for bar in bars)
