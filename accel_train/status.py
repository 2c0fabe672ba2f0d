"""What a run raised -> one line and the exit status (docs/failures.md: Exit statuses): one place
for the command line (cli.main) and for a script that calls train() (api.main)."""

from __future__ import annotations

import sys
import traceback

from .errors import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    ConfigError,
    Diverged,
    Preempted,
    WorkerDidNotStart,
    report_status,
)
from .exits import process_group, says_shared_errors
from .lines import end_progress_line


def status_of(call) -> int:
    """call() -> its status (0 if it returns none); what it raised -> the line it says and its
    status."""
    try:
        try:
            code = call() or 0
        finally:
            end_progress_line()  # every final or error line below starts a line of its own
    except ConfigError as e:
        if not e.quiet and says_shared_errors():
            print(f"accel-train: error: {e}", file=sys.stderr, flush=True)
        code = EXIT_BAD_INPUT
    except Preempted as e:  # every rank stopped at the same step: the main process says it
        group = process_group()
        # (3: a launcher is gone, preempt.watch_launcher)
        code = getattr(e, "status", EXIT_PREEMPTED)
        # (--log_all_ranks)
        if group is None or group.is_main_process or getattr(e, "every_rank", False):
            from .resilience.preempt import launcher_status

            said = launcher_status(getattr(e, "signal", None), code)  # (130 from accelerate launch)
            print(
                f"accel-train: {'preempted' if code == EXIT_PREEMPTED else 'error'}: {e}{said}",
                file=sys.stderr,
                flush=True,
            )
    except Diverged as e:  # every rank stopped at the same step; the main process says why
        group = process_group()
        if group is None or group.is_main_process:
            print(f"accel-train: error: {e}", file=sys.stderr, flush=True)
        if group is not None:
            # the line is out before any rank exits (torchrun then stops the rest)
            group.wait_for_everyone()
        code = EXIT_DIVERGED
    # Ctrl-C outside the training loop's handler (imports, the final export)
    except KeyboardInterrupt:
        print(
            "\naccel-train: interrupted (Ctrl-C); a training run continues from its newest "
            "complete checkpoint with --resume auto",
            file=sys.stderr,
            flush=True,
        )
        code = EXIT_INTERRUPTED
    except WorkerDidNotStart as e:  # (not a bug of ours: no traceback)
        print(f"accel-train: error: {e}", file=sys.stderr, flush=True)
        code = EXIT_ERROR
    except Exception:
        traceback.print_exc()
        code = EXIT_ERROR
    report_status(code)
    return code
