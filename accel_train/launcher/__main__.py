"""`python -m accel_train.launcher [own options] [trainer flags]` (what launch.sh execs): the plan
(plan.py), then attempts until one ends the job (options.py has the options, --help the whole
text)."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time

from .. import errors
from ..rank_files import STATUS_DIR
from . import PREFIX, LaunchError, command, options, platforms
from .plan import Plan, frozen_limit_s, say


def in_place(opts: options.Options, env: dict[str, str], python: str) -> int:
    """A worker of another launcher (torchrun): this process is one rank already; it becomes the
    trainer."""
    if opts.smoke_test:
        raise LaunchError(
            "--smoke-test under torchrun: this process is one of torchrun's ranks already; run"
            " launch.sh --smoke-test (or accel-train smoke) outside torchrun"
        )
    ignored = [name for name in opts.given if name not in ("--dry-run", "--dry_run")]
    if ignored:
        say(
            f"{PREFIX}: warning: {' '.join(ignored)} ignored: started by torchrun, whose agent"
            " relaunches, rendezvous and places this rank (its own --max_restarts, --nnodes, ...)"
        )
    entry = [env["ACCEL_TRAIN_SCRIPT"]] if env.get("ACCEL_TRAIN_SCRIPT") else ["-m", "accel_train"]
    cmd = [python, *entry, *opts.trainer_args]
    env_vars = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": command.python_path(env)}
    if opts.dry_run:
        print(command.dry_run_line(env_vars, cmd))
        return 0
    say(
        f"{PREFIX}: started by torchrun as its rank {env.get('RANK', '?')} of"
        f" {env.get('WORLD_SIZE', '?')} (TORCHELASTIC_RUN_ID {env.get('TORCHELASTIC_RUN_ID')}): the"
        " trainer runs in place for this rank, without a launcher of its own (torchrun's agent is"
        " the supervisor)"
    )
    sys.stdout.flush()
    os.execvpe(python, cmd, {**env, **env_vars})
    return 1


def run(plan: Plan, opts: options.Options) -> int:
    try:  # (psutil: only once the command is known to run)
        from . import attempt, policy
    except ImportError as e:
        raise LaunchError(
            f"{sys.executable} cannot import {e.name} ({e}): install accel_train's requirements"
            " into it (pip install -e .), or set PYTHON= to the environment's python"
        ) from None

    supervisor = attempt.Supervisor()

    def preflight(attempt_no: int) -> None:
        """Before each attempt: the rank-0 host resolves and rank 0 can listen (rank 0), or its port
        answers within the attempt's wait (other ranks: machines may start minutes apart, and a
        relaunched rank 0 comes back within --rejoin_wait). It prints its own one-line cause."""
        if opts.preflight == "1" or (opts.preflight == "auto" and plan.nnodes > 1):
            status = supervisor.run(
                [
                    plan.python,
                    "-m",
                    "accel_train",
                    "preflight",
                    "--host",
                    plan.master_addr or "127.0.0.1",
                    "--port",
                    plan.master_port or "29500",
                    "--rank",
                    str(plan.node_rank),
                    "--timeout",
                    str(plan.wait_s(attempt_no)),
                ],
                plan.job_environment(),
                stdout=sys.stderr,
            )
            if status:
                stopped_before_start()
                if attempt_no and plan.nnodes > 1:
                    say(policy.not_rejoined(plan.rejoin_wait))
                    raise SystemExit(errors.EXIT_LOST_PEER)
                raise SystemExit(errors.EXIT_BAD_INPUT)

    def stopped_before_start() -> None:
        if supervisor.signalled:
            say(
                f"{PREFIX}: stopped by SIG{supervisor.signalled} before the job started (nothing to"
                " save)"
            )
            raise SystemExit(4)

    if opts.smoke_test:
        preflight(0)
        return supervisor.run(plan.cmd, plan.job_environment())
    # One run id for every attempt (the trainer's ACCEL_TRAIN_RUN_ID: a fresh run takes it): a
    # relaunch of an --overwrite run (then --overwrite with --resume auto) resumes that run's own
    # checkpoints only, never the run it replaces.
    run_id = f"{secrets.randbits(32):08x}{secrets.randbits(16):04x}"
    attempt_no = 0
    while True:
        if attempt_no and plan.nnodes > 1:
            say(
                f"{PREFIX}: waiting up to {plan.rejoin_wait} s for the other machine(s) to rejoin"
                " (--rejoin_wait)"
            )
        preflight(attempt_no)
        say(
            f"{PREFIX}: machine {plan.node_rank} of {plan.nnodes}, {plan.nproc} process(es) here,"
            f" config {plan.config.name}{plan.rank0_at} (attempt {attempt_no + 1} of"
            f" {plan.max_restarts + 1})"
        )
        stopped_before_start()
        try:
            status_dir = tempfile.mkdtemp(prefix="accel_train_status.", dir=plan.status_root)
        except OSError as e:
            raise LaunchError(
                f"cannot make this attempt's status folder in {plan.status_root}: {e.strerror}"
            ) from None
        watch = attempt.FrozenWatch(
            status_dir, frozen_limit_s(plan.nnodes * plan.nproc, opts.trainer_args)
        )
        started = time.monotonic()
        status = supervisor.run(
            plan.attempt_cmd(attempt_no),
            plan.job_environment(**{STATUS_DIR: status_dir}, ACCEL_TRAIN_RUN_ID=run_id),
            watch=watch,
        )
        waited_s = time.monotonic() - started
        attempt.ranks_ended(status_dir, supervisor, plan.rank_stop_s)
        report = policy.read_report(status_dir)
        decision = policy.decide(
            status,
            report,
            nproc=plan.nproc,
            signalled=supervisor.signalled,
            restart_on_preempt=opts.restart_on_preempt,
            attempt=attempt_no,
            max_restarts=plan.max_restarts,
            machines=plan.nnodes,
            waited_s=waited_s,
            rejoin_wait_s=plan.wait_s(attempt_no),
        )
        for line in decision.lines:
            say(line)
        shutil.rmtree(status_dir, ignore_errors=True)
        if decision.exit_status is not None:
            return decision.exit_status
        attempt_no += 1
        # (the recovery's start-up: docs/failures.md)
        time.sleep(plan.restart_delay_s)


def main(argv: list[str] | None = None, python: str | None = None) -> int:
    """`python`: the interpreter the job runs with, as launch.sh found it (its PYTHON, default
    python3), else this one."""
    env = os.environ
    python = python or sys.executable
    try:
        opts = options.parse(sys.argv[1:] if argv is None else argv, env)
        if opts.help:
            print(options.HELP)
            return 0
        if platforms.ascend_per_card(env) and env["ASCEND_DEVICE_ID"] != "0":
            say(
                f"{PREFIX}: ASCEND_DEVICE_ID={env['ASCEND_DEVICE_ID']}: this is one copy of the"
                " boot file per card (Ascend-Powered-Engine); the job for all of this node's cards"
                " is started by device 0's copy, this copy exits"
            )
            return 0
        if platforms.torchrun_worker(env):
            return in_place(opts, dict(env), python)
        plan = Plan(opts, env, python)
        if opts.dry_run:
            print(command.dry_run_line(plan.env_vars, plan.cmd))
            return 0
        return run(plan, opts)
    except LaunchError as e:
        say(f"{PREFIX}: error: {e}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the job starts (the device probes): nothing to stop
        return 130


if __name__ == "__main__":
    sys.exit(main())
