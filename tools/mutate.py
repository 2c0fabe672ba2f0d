"""Mutation test: plant each of a fixed list of small, plausible bugs, one at a time, in a copy of
the tree, run the tests that cover the promise it breaks, and print which survive. A survivor names
a missing test. Extend MUTANTS as features land: a promise of the README, the one line of code
that keeps it, and the tests that must fail without it.

    python tools/mutate.py                # every mutant; exit 1 if any survives; each kill names
                                          # the run of CI that makes it (readme: the README's
                                          # command, or a stage)
    python tools/mutate.py resume_newest  # some of them, by name
    python tools/mutate.py --check        # only that every mutant still applies to the tree
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    promise: str  # what the bug breaks, as the README promises it
    path: str  # the file it is planted in
    old: str  # text that occurs exactly once in that file ...
    new: str  # ... and what it becomes
    tests: tuple  # pytest node ids that must fail with the bug planted


MUTANTS = [
    Mutant(
        "resume_newest",
        "--resume auto continues from the newest complete step any machine holds",
        "accel_train/checkpoint/resume.py",
        'r.get("explicit")] if entry]\n        return (max(found) if found else None)',
        'r.get("explicit")] if entry]\n        return (found[-1] if found else None)',
        (
            "tests/test_resume.py::test_resume_auto_takes_the_newest_step_whichever_machine_holds_it",
        ),
    ),
    Mutant(
        "reseed_rank",
        "every random draw is a function of (seed, step, micro-batch, rank): ranks differ",
        "accel_train/training/loop.py",
        'draw_seed(run.run_math["seed"], state.step, micro, accelerator.process_index)',
        'draw_seed(run.run_math["seed"], state.step, micro, 0)',
        (
            "tests/test_loop.py::test_each_rank_draws_its_own_dropout_masks_and_a_resume_draws_the_same_again",
        ),
    ),
    Mutant(
        "loss_isnan",
        "a non-finite loss (NaN or inf) stops every rank with exit status 5",
        "accel_train/training/divergence.py",
        "bad = ~torch.isfinite(loss.detach())",
        "bad = torch.isnan(loss.detach())",
        ("tests/test_divergence.py::test_an_infinite_loss_stops_the_run_as_a_nan_does",),
    ),
    Mutant(
        "gradcheck_loose",
        "a reduced precision whose gradients exceed the rounding bound falls back to fp32",
        "accel_train/precision/check.py",
        "limit = bound(precision, depth(model))",
        "limit = 1000 * bound(precision, depth(model))",
        (
            "tests/test_precision_check.py::test_a_gradient_wrong_by_a_modest_factor_fails_the_check",
        ),
    ),
    Mutant(
        "cache_key_size",
        "a changed image folder gets a new decoded cache, never a stale one (a file rewritten "
        "in place with another size, its mtime restored)",
        "accel_train/data/cache.py",
        r'stamp = f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}"',
        r'stamp = f"{st.st_mtime_ns}\0{st.st_ino}"',
        (
            (
                "tests/test_imagefolder.py::test_a_file_rewritten_with_its_old_mtime_is_decoded_again_not_read_from_the"
                "_cache"
            ),
        ),
    ),
    Mutant(
        "cache_key_ctime",
        "a changed image folder gets a new decoded cache, never a stale one (a file replaced by "
        "one of the same size and mtime: cp -p, rsync -a, touch -r)",
        "accel_train/data/cache.py",
        r'stamp = f"{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_ctime_ns}"',
        r'stamp = f"{st.st_size}\0{st.st_mtime_ns}"',
        (
            "tests/test_folder_edges.py::test_a_file_replaced_with_the_same_size_and_mtime_is_decoded_again",
        ),
    ),
    Mutant(
        "checkpoint_unchecked",
        "no checkpoint holds non-finite weights (the newest finite one is named)",
        "accel_train/checkpoint/checkpointer.py",
        "self.watch.check(self.accelerator, state.step, self.model)",
        "self.watch.check(self.accelerator, state.step)",
        ("tests/test_divergence.py::test_a_checkpoint_is_never_written_with_non_finite_weights",),
    ),
    Mutant(
        "resume_lr",
        "after a resume every step trains with the lr of its global step",
        "accel_train/training/startup.py",
        "    scheduler.step_update(state.step)\n",
        "    scheduler.step_update(state.step + 1)\n",
        (
            "tests/test_resume.py::test_more_epochs_on_resume_rebuild_the_schedule",
            "tests/test_resume.py::test_every_resumed_step_trains_with_the_lr_its_row_says",
        ),
    ),
    Mutant(
        "trust_from_file",
        "trust to import model code comes only from the command line or train(), never a file",
        "accel_train/cli.py",
        '    file.pop("trust_model_code", None)',
        '    file.get("trust_model_code", None)',
        ("tests/test_trust.py::test_a_file_trusts_nothing_but_the_command_line_and_train_do",),
    ),
    Mutant(
        "norm_overflow",
        "finite weights whose norm overflows stop the run (a wrong bf16 kernel's garbage)",
        "accel_train/training/divergence.py",
        "overflowed = next((s - 2 for s in states if s >= 2), -1) if 0 not in states else -1",
        "overflowed = -1",
        ("tests/test_divergence.py::test_a_finite_weight_whose_norm_overflows_stops_the_run",),
    ),
    Mutant(
        "output_dir_lock",
        "two jobs never write one output directory at once",
        "accel_train/checkpoint/output_dir.py",
        "            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "            pass\n",
        (
            "tests/test_resume.py::test_a_second_job_in_a_written_output_dir_is_one_line_naming_the_holder",
        ),
    ),
    Mutant(
        "export_local_main",
        "the model and the run's outputs are written by the main process only",
        "accel_train/platform/ranks.py",
        "if not accelerator.is_main_process:\n            return None",
        "if not accelerator.is_local_main_process:\n            return None",
        ("tests/test_outputs.py::test_only_the_global_main_process_writes_the_runs_outputs",),
    ),
    Mutant(
        "policy_bad_input",
        "bad input (exit status 2) is never relaunched, whatever --max_restarts says",
        "accel_train/launcher/policy.py",
        'errors.EXIT_BAD_INPUT: "bad input',
        'None: "bad input',
        ("tests/test_launcher_policy.py::test_what_a_relaunch_cannot_fix_ends_the_job_at_once",),
    ),
    Mutant(
        "frozen_faults_folder",
        "a stopped rank is killed once its peers gave it up (a status came, or its "
        "limit passed), not when a rank's fault note appears",
        "accel_train/launcher/attempt.py",
        "entry.is_file() for entry in os.scandir(self.status_dir)",
        "True for entry in os.scandir(self.status_dir)",
        (
            (
                "tests/test_launcher_attempt.py::"
                "test_a_frozen_rank_is_killed_after_its_limit_only_where_no_rank_of_the_machine_runs"
            ),
        ),
    ),
    Mutant(
        "visible_list_stop",
        "a visible-device list counts up to its first invalid entry, as CUDA does",
        "accel_train/launcher/devices.py",
        'if not entry or entry.startswith("-"):\n            break',
        'if not entry or entry.startswith("-"):\n            continue',
        ("tests/test_launcher_devices.py::test_a_visible_list_stops_at_its_first_invalid_entry",),
    ),
    Mutant(
        "signal_spares_leader",
        "a stop signal reaches the trainer, not accelerate's one-process launcher "
        "(which answers it by SIGKILLing the trainer 5 s later)",
        "accel_train/launcher/attempt.py",
        "if pid != pgid and os.getpgid(pid) == pgid",
        "if os.getpgid(pid) == pgid",
        (
            "tests/test_launcher_attempt.py::test_a_signal_reaches_the_group_but_its_leader_and_the_status_is_a_shells",
        ),
    ),
    Mutant(
        "rank_by_rank_only",
        "a rank is told from its agent where a scheduler set RANK for the machine "
        "(Kubeflow, an exported SLURM_PROCID): a frozen rank is found, its agent never signalled",
        "accel_train/launcher/attempt.py",
        "return any(env.get(key) != parent_env.get(key) for key in WORKER_KEYS)",
        'return env.get("RANK") != parent_env.get("RANK")',
        (
            "tests/test_launcher_attempt.py::test_a_rank_is_told_from_its_agent_and_its_dataloader_workers",
        ),
    ),
    Mutant(
        "failed_launcher_leaves_job",
        "a launcher that fails or is interrupted stops its job first, never "
        "leaving it to run unsupervised",
        "accel_train/launcher/attempt.py",
        "self.stop_job()\n            raise",
        "raise",
        ("tests/test_launcher_attempt.py::test_a_launcher_that_fails_stops_its_job_first",),
    ),
    Mutant(
        "pid1_no_reaping",
        "a launcher that is the container's PID 1 reaps the job's orphans: a zombie "
        "never keeps an attempt alive",
        "accel_train/launcher/attempt.py",
        "os.waitpid(proc.pid, os.WNOHANG)",
        "pass",
        (
            "tests/test_launcher_attempt.py::test_a_launcher_that_is_pid_1_reaps_the_orphans_of_its_job",
        ),
    ),
    Mutant(
        "half_step_saved",
        "a failure while a rank applies a step saves nothing (never a half-updated step)",
        "accel_train/resilience/survivor.py",
        "        yield  # (not in try/finally: an exception raised here skips the release on"
        " purpose)\n",
        "        try:\n            yield\n        except BaseException:\n           "
        " self.lock.release()\n            raise\n",
        (
            "tests/test_survivor.py::test_a_step_is_updated_under_the_lock_and_a_failure_inside_leaves_it_held",
        ),
    ),
]


def problems(m: Mutant, root: Path = ROOT) -> list[str]:
    """Why the mutant no longer applies to the tree at `root` (empty: it does)."""
    found = []
    text = (root / m.path).read_text() if (root / m.path).is_file() else None
    if text is None:
        return [f"{m.name}: {m.path} does not exist"]
    if text.count(m.old) != 1:
        found.append(
            f"{m.name}: its text occurs {text.count(m.old)} times in {m.path} (want once): update"
            " MUTANTS"
        )
    for node in m.tests:
        file, _, test = node.partition("::")
        if (
            not (root / file).is_file()
            or f"def {test.split('[')[0]}(" not in (root / file).read_text()
        ):
            found.append(f"{m.name}: no test {node}")
    return found


def tree_copy(dest: Path) -> None:
    """The tracked and the untracked, not ignored files: what CI would clone, plus work not yet
    committed."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def stages(nodes) -> dict[str, str]:
    """The run of CI each test id is in: "readme" (the README's command: the in-process tests and
    the core launches) or the stage .ci/run runs it in (tests/conftest.py, STAGES)."""
    found = {}
    for stage in ("launches", "faults", "hosts", "campaign"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                "-n",
                "0",
                "-m",
                stage,
                *nodes,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        found.update((line.strip(), stage) for line in proc.stdout.splitlines() if "::" in line)
    return {
        node: next(
            (stage for test, stage in found.items() if test == node or test.startswith(node + "[")),
            "readme",
        )
        for node in nodes
    }


def failed(stdout: str, m: Mutant) -> str | None:
    """The mutant's test that failed (as MUTANTS names it), from pytest's short summary."""
    for line in stdout.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            test = line.split()[1]
            return next(
                (node for node in m.tests if test == node or test.startswith(node + "[")), test
            )
    return None


def run(m: Mutant, timeout: float) -> tuple[str, float, str | None]:
    """'killed' (a covering test failed, named third), 'SURVIVED' (all passed), or 'error: ...'."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{m.name}-") as tmp:
        tree = Path(tmp)
        tree_copy(tree)
        target = tree / m.path
        target.write_text(target.read_text().replace(m.old, m.new))
        env = {
            **os.environ,
            "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(
                os.pathsep
            ),
        }
        try:  # the copy's own package and tests (cwd first on sys.path, and its subprocesses' cwd)
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-q",
                    "-x",
                    "-p",
                    "no:cacheprovider",
                    "-n",
                    "0",
                    "--timeout",
                    str(int(timeout)),
                    *m.tests,
                ],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout + 60,
            )
        except subprocess.TimeoutExpired:
            return "error: timed out", time.monotonic() - start, None
    seconds = time.monotonic() - start
    if proc.returncode == 0:
        return "SURVIVED", seconds, None
    if proc.returncode == 1:
        return "killed", seconds, failed(proc.stdout, m)
    return (
        f"error: pytest exit {proc.returncode}: {proc.stdout.strip().splitlines()[-1:]}",
        seconds,
        None,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument(
        "--check", action="store_true", help="only check that every mutant still applies"
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant's tests")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(
            f"unknown mutant(s) {', '.join(sorted(unknown))}; known:"
            f" {', '.join(m.name for m in MUTANTS)}"
        )
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    stale = [p for m in chosen for p in problems(m)]
    if stale or args.check:
        print("\n".join(stale) or f"{len(chosen)} mutants apply")
        return 1 if stale else 0
    survivors = errors = 0
    where = stages([node for m in chosen for node in m.tests])
    for m in chosen:
        verdict, seconds, test = run(m, args.timeout)
        survivors += verdict == "SURVIVED"
        errors += verdict.startswith("error")
        stage = f"by {where.get(test, '?')}" if test else ""
        print(f"{m.name:22} {verdict:9} {stage:11} {seconds:5.0f} s  {m.promise}", flush=True)
    print(
        f"{len(chosen)} mutants: {len(chosen) - survivors - errors} killed, {survivors} survived,"
        f" {errors} errors"
    )
    return 1 if survivors or errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
