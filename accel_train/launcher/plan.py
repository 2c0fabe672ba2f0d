"""The plan of a launch, worked out once before any attempt: the layout from the platform, the
devices here, the config, the command and its environment (and the numbers the attempts read from
the trainer's flags)."""

from __future__ import annotations

import sys
from dataclasses import fields
from functools import cached_property
from pathlib import Path

from . import PREFIX, LaunchError, command, devices, options, platforms

# the peers, whose last beat came up to --heartbeat_s before the stop, give up first
FROZEN_MARGIN_S = 3
# A relaunch's wait for the other machines beyond their --timeout_s (the latest a survivor finds the
# loss): its checkpoint write, the restart delay, the interpreter and accelerate's start
REJOIN_MARGIN_S = 60


def say(line: str) -> None:
    # one write: under PYTHONUNBUFFERED print() writes the line and its newline apart, and the lines
    # of launchers started side by side (torchrun's workers) then share a line
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def trainer_default(name: str):
    # (only where needed: it imports PyYAML, which a bare interpreter may lack)
    from ..config.train_config import TrainConfig

    return next(f.default for f in fields(TrainConfig) if f.name == name)


def trainer_timeout_s(args) -> int:
    return options.trainer_seconds(args, "--timeout_s", int(trainer_default("timeout_s")))


def env_seconds(env, name: str, default: float) -> float:
    """A launcher timing from the environment (a test's or an operator's), checked before the job
    starts: a bad value found at the first relaunch would lose that relaunch."""
    text = env.get(name) or ""
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise LaunchError(f"{name} must be a number of seconds >= 0, got '{text}'")
    return value


def frozen_limit_s(processes: int, args) -> int:
    """How long a rank may stay stopped (state T) in a job of several processes: as long as its
    peers' heartbeat waits for it (--heartbeat_timeout_s), or their collective timeout where
    heartbeats are off (0), plus FROZEN_MARGIN_S; none in a one-process job."""
    if processes <= 1:
        return 0
    beat = options.trainer_seconds(
        args, "--heartbeat_timeout_s", int(trainer_default("heartbeat_timeout_s"))
    )
    return (beat or trainer_timeout_s(args)) + FROZEN_MARGIN_S


class Plan:
    """Everything an attempt needs, worked out once: the layout, the devices, the config, the
    command."""

    def __init__(self, opts: options.Options, env: dict[str, str], python: str):
        self.opts, self.env, self.python = opts, env, python
        self.rank_stop_s = env_seconds(env, "ACCEL_RANK_STOP_S", 120)
        self.restart_delay_s = env_seconds(env, "ACCEL_RESTART_DELAY", 1)
        self.status_root = env.get("TMPDIR") or "/tmp"
        if not (opts.dry_run or Path(self.status_root).is_dir()):
            raise LaunchError(
                f"TMPDIR={self.status_root} is not a folder: the attempts' status folders go there;"
                " unset TMPDIR or create it"
            )
        layout = platforms.detect(env, opts.init_method, opts.rank, opts.world_size)
        self.layout = layout
        per_card = platforms.ascend_per_card(env)
        n_gpu = devices.limit(
            devices.count_nvidia(self.python, env, say),
            devices.visible(env, "CUDA_VISIBLE_DEVICES"),
        )
        n_npu = devices.count_npu(env)
        if per_card and not n_npu:
            n_npu = devices.ascend_cards_per_node(env["RANK_SIZE"], layout.nnodes)
        n_npu = devices.limit(n_npu, devices.visible(env, "ASCEND_RT_VISIBLE_DEVICES"))
        device, found = ("gpu", n_gpu) if n_gpu > 0 else ("npu", n_npu) if n_npu > 0 else ("cpu", 1)
        nproc = layout.nproc
        if layout.nproc_word and not nproc:
            # as torchrun: the visible devices, but one process on a CPU node
            if layout.nproc_word == "cpu":
                # (torchrun starts one per CPU core: they would compete for the cores)
                device, found = "cpu", 1  # a CPU job, even where GPUs are visible
            elif layout.nproc_word == "gpu" and n_gpu <= 0:
                raise LaunchError(
                    "PET_NPROC_PER_NODE=gpu but no GPU is visible here (torchrun refuses it too: "
                    "'Cuda is not available'); set the PyTorchJob's nprocPerNode to auto, cpu or a "
                    "number"
                )
            nproc = str(found)
        if (
            nproc
            and options.is_uint(nproc)
            and not env.get("NPROC_PER_NODE")
            and not env.get("PET_NPROC_PER_NODE")
        ):
            # MA_NUM_GPUS / SLURM_GPUS_ON_NODE count the machine's devices; only the visible ones
            # get a process.
            if device != "cpu" and int(nproc) > found:
                say(
                    f"{PREFIX}: the platform says {nproc} devices, {found} are visible here:"
                    f" {found} process(es)"
                )
                nproc = str(found)
            elif device == "cpu":
                say(
                    f"{PREFIX}: warning: the platform says {nproc} devices, but no GPU or NPU is"
                    f" visible here; running {nproc} CPU processes"
                )
        platform_nproc = nproc  # a count the platform or NPROC_PER_NODE gave ("": none)
        nproc = nproc or str(found)
        for name, value in (
            ("nnodes", layout.nnodes),
            ("node_rank", layout.node_rank),
            ("nproc_per_node", nproc),
            ("max_restarts", opts.max_restarts),
            ("rdzv_wait", opts.rdzv_wait),
            ("rejoin_wait", opts.rejoin_wait or "0"),
        ):
            if not options.is_uint(value):
                raise LaunchError(
                    f"{name} must be a non-negative integer, got '{value}' (check "
                    "NNODES/NODE_RANK/NPROC_PER_NODE or the platform variables)"
                )
        self.nnodes, self.node_rank, self.nproc = (
            int(layout.nnodes),
            int(layout.node_rank),
            int(nproc),
        )
        self.max_restarts, self.rdzv_wait = int(opts.max_restarts), int(opts.rdzv_wait)
        if self.nnodes < 1:
            raise LaunchError(f"the number of machines must be >= 1, got {self.nnodes}")
        if self.nproc < 1:
            raise LaunchError(f"processes per machine must be >= 1, got {self.nproc}")
        if self.node_rank >= self.nnodes:
            raise LaunchError(
                f"this machine's rank {self.node_rank} is not below the number of machines "
                f"{self.nnodes}"
            )
        port = layout.master_port
        if port and (not options.is_uint(port) or not 1 <= int(port) <= 65535):
            raise LaunchError(f"MASTER_PORT must be a port number, got '{port}'")
        self.master_addr, self.rank0_at = layout.master_addr, ""
        if self.nnodes > 1:
            # (one machine needs no rendezvous address, and ModelArts gives it no port)
            if not self.master_addr:
                raise LaunchError(
                    f"{self.nnodes} machines but no rank-0 host: set MASTER_ADDR (or "
                    "VC_WORKER_HOSTS, --init_method tcp://HOST:PORT, SLURM_STEP_NODELIST)"
                )
            port = port or "29500"
            self.rank0_at = f", rank 0 at {self.master_addr}:{port}"
        self.master_port = port

        # a config the user named keeps its precision where the device has it
        named = opts.accel_config
        name = named or command.CONFIG_FOR[(device, self.nnodes > 1, self.nproc > 1)]
        self.config = command.config_file(name)
        if command.config_value(self.config, r"use_cpu: *(true)") is not None:
            device = "cpu"
        if command.config_value(self.config, r"distributed_type: *(MULTI_NPU)") is not None:
            device = "npu"
        # A config named on one machine that states its own process count (num_machines: 1) gets
        # that count, unless the platform or NPROC_PER_NODE gave one; on GPUs/NPUs at most one
        # process per visible device.
        if named and not platform_nproc and self.nnodes == 1:
            machines = command.config_value(self.config, r"num_machines: *([0-9]+)") or "1"
            stated = command.config_value(self.config, r"num_processes: *([0-9]+)")
            if machines == "1" and stated and int(stated) >= 1:
                self.nproc = int(stated) if device == "cpu" else min(int(stated), found)
        self.device = device

        args = opts.trainer_args
        timeout_s = trainer_timeout_s(args) if device != "cpu" else 0
        self.env_vars = command.job_env(device, timeout_s, env, say)
        if per_card:  # they describe the one card this copy was started for, not the job's ranks
            for var in ("ASCEND_DEVICE_ID", "RANK_ID", "RANK_SIZE"):
                env.pop(var, None)
        self.launch_args = command.launch_args(
            self.config, self.nnodes, self.nproc, self.node_rank, self.master_addr, self.master_port
        )
        if self.nnodes > 1:
            self.launch_args += command.rendezvous_wait(self.rdzv_wait)
        if not opts.dry_run:
            command.check_config(self.python, self.config, env)
        # Skipped where the trainer's --mixed_precision (or --force_precision) decides, and in a dry
        # run on a GPU/NPU (the probe imports torch) unless ACCEL_TRAIN_DEVICE_FACTS states the
        # facts.
        if not command.uses_own_precision_flag(args) and (
            device == "cpu" or not opts.dry_run or env.get("ACCEL_TRAIN_DEVICE_FACTS")
        ):
            config_precision = command.config_value(
                self.config, r"""mixed_precision: *['"]?([A-Za-z0-9]+)"""
            )
            more_args, more_env = command.probe_precision(
                self.python, device, config_precision, bool(named), env, say
            )
            self.launch_args += more_args
            self.env_vars.update(more_env)
        if opts.smoke_test:
            # Accelerate's test script on the same launch arguments, checked for the group size
            self.cmd = [self.python, "-m", "accel_train", "smoke", *self.launch_args]
        else:
            # `accelerate launch` itself, run by the same Python as the probes (not whichever
            # `accelerate` is first on PATH) and without the `accelerate` command's imports of all
            # its subcommands (estimate-memory imports timm and torchvision: ~3.5 s more CPU at
            # every start of a 2-core machine). ACCEL_TRAIN_SCRIPT=my_script.py: your script (it
            # calls accel_train.train(); docs/own_data_and_models.md: Your own model) in its place.
            entry = (
                [env["ACCEL_TRAIN_SCRIPT"]]
                if env.get("ACCEL_TRAIN_SCRIPT")
                else ["-m", "accel_train"]
            )
            self.cmd = [
                self.python,
                "-m",
                "accelerate.commands.launch",
                *self.launch_args,
                *entry,
                *args,
            ]

    @cached_property
    def rejoin_wait(self) -> int:
        if self.opts.rejoin_wait:
            return int(self.opts.rejoin_wait)
        return trainer_timeout_s(self.opts.trainer_args) + REJOIN_MARGIN_S

    def attempt_cmd(self, attempt: int) -> list[str]:
        """The command of an attempt (from 0): a relaunch resumes the run, and its rendezvous of
        several machines waits --rejoin_wait for the others."""
        if attempt == 0:
            return list(self.cmd)
        cmd = list(self.cmd)
        if self.nnodes > 1:
            at = cmd.index(command.rendezvous_wait(self.rdzv_wait)[0])
            cmd[at : at + 2] = command.rendezvous_wait(self.rejoin_wait)
        return cmd + ["--resume", "auto"]

    def wait_s(self, attempt: int) -> int:
        """How long an attempt's rendezvous (and a non-zero rank's preflight) waits for the other
        machines."""
        return self.rdzv_wait if attempt == 0 else self.rejoin_wait

    def job_environment(self, **more: str) -> dict[str, str]:
        return {**self.env, **self.env_vars, **more}
