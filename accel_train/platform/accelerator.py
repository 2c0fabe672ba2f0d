"""The Accelerator of a training run, as this platform needs it: the precision the device really
has, the trackers, the collective timeout on every backend (HCCL's own timeouts below it), and one
process group.

Nothing here names a device or a backend: the accelerate config the job was launched with does.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    InitProcessGroupKwargs,
    LoggerType,
    ProjectConfiguration,
    TorchDynamoPlugin,
    is_npu_available,
)

from ..config.train_config import TrainConfig
from ..errors import ConfigError
from ..exits import note_backend
from .backend_env import (
    failure_env,
    hccl_timeouts,
    monitor_env,
)
from .cores import intra_op_threads
from .hardware import (
    DeviceFacts,
    choose_precision,
    compile_problem,
    device_facts,
    device_kind,
    has_accelerator,
)
from .ranks import said_once

logger = get_logger("accel_train")


def asked_precision(mixed_precision: str, env=os.environ, launch=None) -> tuple[str | None, str]:
    """The precision asked for and where: the trainer's flag, else the launcher's config, else
    nothing. Where nothing is asked, the second value names the rule that leaves the precision to
    the device. `launch`: parent_launch()'s answer (tests state it)."""
    if mixed_precision != "auto":
        return mixed_precision, f"--mixed_precision {mixed_precision}"
    launched = env.get("ACCELERATE_MIXED_PRECISION")  # accelerate launch sets it from the config
    if launched and launched.lower() == env.get("ACCEL_TRAIN_AUTO_PRECISION", "").lower():
        return None, "launch.sh's pick"  # launch.sh's own pick from the device's facts
    if launched and launched.lower() == "no":
        # accelerate launch writes 'no' for a config without mixed_precision too: only its command
        # line and its config file tell a stated fp32 from none stated
        unstated = config_without_precision(parent_launch() if launch is None else launch)
        if unstated:
            return None, f"{unstated} states no mixed_precision"
    if launched:
        return launched.lower(), f"the accelerate config's mixed_precision: '{launched.lower()}'"
    return None, "neither --mixed_precision nor a launcher's config states one"


LAUNCH_ENTRY = ("accelerate.commands.launch", "accelerate-launch")


def launch_options(cmdline: bytes) -> list[str] | None:
    """The options an `accelerate launch` command line gives accelerate itself (up to its -m or
    script), or None where it is no such command line (`accelerate launch`, `python -m
    accelerate.commands.launch`)."""
    argv = cmdline.decode(errors="replace").split("\0")
    for i, arg in enumerate(argv):
        name = os.path.basename(arg)
        if name in LAUNCH_ENTRY or (name == "accelerate" and argv[i + 1 : i + 2] == ["launch"]):
            rest = argv[i + (2 if name == "accelerate" else 1) :]
            ends = [j for j, a in enumerate(rest) if a in ("-m", "--module") or a.endswith(".py")]
            return rest[: ends[0] if ends else len(rest)]
    return None


def parent_launch() -> tuple[list[str], Path] | None:
    """(accelerate launch's options, its working directory) where this process's parent is
    `accelerate launch` (it starts every rank itself, torchrun's agent included); None where it is
    not, or cannot be read (not Linux)."""
    parent = Path(f"/proc/{os.getppid()}")
    try:
        options = launch_options((parent / "cmdline").read_bytes())
        return (options, (parent / "cwd").resolve()) if options is not None else None
    except OSError:
        return None


def config_without_precision(launch: tuple[list[str], Path] | None) -> str | None:
    """The config `accelerate launch` read, named, where neither it nor the command line states
    mixed_precision (accelerate then passes 'no'); None where one of them states it, or where that
    cannot be told."""
    if launch is None:
        return None
    options, cwd = launch
    named = None
    for i, arg in enumerate(options):
        key, _, value = arg.partition("=")
        if key == "--mixed_precision":
            return None
        if key == "--config_file":
            named = value or (options[i + 1] if i + 1 < len(options) else None)
    if named is None:  # accelerate launch reads its default config then, if there is one
        from accelerate.commands.config import default_config_file

        if "--cpu" in options or not os.path.isfile(default_config_file):
            return "accelerate launch without a config file"
        named = default_config_file
    try:
        import yaml

        settings = yaml.safe_load((cwd / named).read_text())  # (JSON is YAML too)
    except Exception:
        return None
    if not isinstance(settings, dict) or "mixed_precision" in settings:
        return None
    return f"the accelerate config {named}"


def make_accelerator(cfg: TrainConfig, facts: DeviceFacts | None = None) -> Accelerator:
    if is_npu_available():
        hccl_timeouts(cfg.timeout_s)
    # Ranks on a host without an accelerator join one gloo group only if asked to run on cpu.
    cpu = not has_accelerator()
    # read when the process group is made: in Accelerator() (accelerate's PartialState)
    failure_env(device_kind(cpu))
    monitor_env(device_kind(cpu), cfg.timeout_s)
    trackers = cfg.trackers()
    unknown = [t for t in trackers if t not in LoggerType.list()]
    if unknown:
        raise ConfigError(
            f"--log_with {','.join(unknown)}: not an Accelerate tracker; use one of "
            f"{', '.join(LoggerType.list())}"
        )
    facts = facts or device_facts(cpu=True if cpu else None)
    asked, source = asked_precision(cfg.mixed_precision)
    # docs/speed.md: Precision and memory format per platform
    choice = choose_precision(facts, asked, source, force=cfg.force_precision)
    refusal = choice.error or (compile_problem(facts.kind) if cfg.compile else None)
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision="no" if refusal else choice.precision,
        gradient_accumulation_steps=cfg.grad_accum,
        # --compile: Accelerate compiles in prepare(), after the DDP wrap (last, as it advises)
        dynamo_plugin=(
            TorchDynamoPlugin(backend="inductor", mode=cfg.compile_mode) if cfg.compile else None
        ),
        log_with=trackers or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=cfg.output_dir),
        # non_blocking: the batches are pinned
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
        kwargs_handlers=[
            # the collective timeout on every backend; no backend named (Accelerate forces hccl on
            # NPU and refuses any other name)
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.timeout_s)),
            DistributedDataParallelKwargs(
                bucket_cap_mb=cfg.ddp_bucket_cap_mb,
                gradient_as_bucket_view=cfg.ddp_grad_as_bucket_view,
            ),
        ],
    )
    with said_once(accelerator):  # the same facts on every rank: one line
        if refusal:
            raise ConfigError(refusal)
    check_one_group(accelerator.num_processes, cfg.world_size)
    if accelerator.num_processes > 1:
        # how launch.sh reads this rank's SIGABRT, if it dies of one
        note_backend(accelerator.state.backend)
    accelerator.device_facts = facts
    asked_for = choice.precision != "no" and asked is not None
    accelerator.precision_source = source if asked_for else ""  # "": not asked
    logger.info(choice.reason, main_process_only=not cfg.log_all_ranks)
    threads, why = intra_op_threads(cfg.threads)
    if threads:
        torch.set_num_threads(threads)
    logger.info(why, main_process_only=not cfg.log_all_ranks)
    return accelerator


def fall_back_to_fp32(accelerator) -> None:
    """Before prepare(): the run trains in fp32 after all (the precision check: the reduced
    precision computed wrong gradients). Accelerate fixes the precision when the Accelerator is made
    and keeps it in three places that autocast() and prepare() read (accelerate accelerator.py:
    native_amp, scaler; state.py: _mixed_precision, in the state every Accelerator shares);
    tests/test_precision_check.py checks that fp32 took effect."""
    accelerator.state._mixed_precision = "no"
    accelerator.native_amp = False
    accelerator.scaler = None


def check_one_group(num_processes: int, world_size: int | None, env=os.environ) -> None:
    """Refuse silent duplicate training: N processes launched that each train alone (`world_size`:
    --world_size, the nodes ModelArts says the job has)."""
    # torchrun counts ranks
    launched = int(env.get("WORLD_SIZE", 1)) if "TORCHELASTIC_RUN_ID" in env else 1
    if launched > 1 and num_processes != launched:
        raise ConfigError(
            f"the launcher started {launched} processes but they did not join one "
            f"process group (each sees {num_processes}); on a CPU host set use_cpu: "
            "true in the accelerate config or ACCELERATE_USE_CPU=1"
        )
    if (world_size or 1) > 1 and num_processes == 1:
        raise ConfigError(
            f"--world_size {world_size} (nodes) but this is a single process: "
            "start the job with launch.sh (or accelerate launch with a multi-node "
            "config), not python directly"
        )
    asked = asked_processes(env)
    if num_processes == 1 and asked > 1:  # (Accelerate's behaviour, said with its fix)
        raise ConfigError(
            f"accelerate launch --num_processes {asked} started one process: its "
            "config's distributed_type is NO (as `accelerate config default` writes "
            "it), which runs one process whatever --num_processes says; pass "
            "--config_file accelerate_configs/2proc_cpu.yaml (CPU ranks) or "
            "1node_gpu.yaml (GPUs), or start it with launch.sh"
        )


def asked_processes(env=os.environ, parent_cmdline: bytes | None = None) -> int:
    """The --num_processes that `accelerate launch` (the parent of a process it started: it sets
    ACCELERATE_MIXED_PRECISION, utils/launch.py) was given on its command line; 1 where none, or
    not Linux."""
    if "ACCELERATE_MIXED_PRECISION" not in env:
        return 1
    if parent_cmdline is None:
        try:
            parent_cmdline = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
        except OSError:
            return 1
    argv = parent_cmdline.decode(errors="replace").split("\0")
    for i, arg in enumerate(argv):
        value = (
            arg.split("=", 1)[1]
            if arg.startswith("--num_processes=")
            else (argv[i + 1] if arg == "--num_processes" and i + 1 < len(argv) else None)
        )
        if value is not None and value.isdigit():
            return int(value)
    return 1


def prepare_output_dir(path) -> Path:
    """Every rank checks it can write there before any work starts."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ConfigError(
            f"--output_dir {out} is a file, not a directory; pass a directory (it is "
            "created if missing)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot create output directory {out} ({e.strerror}); pass a writable --output_dir"
        ) from None
    try:
        tempfile.TemporaryFile(dir=out).close()
    except OSError as e:
        raise ConfigError(
            f"output directory {out} is not writable ({e.strerror}); pass a writable --output_dir"
        ) from None
    return out


def tracker_config(cfg: TrainConfig) -> dict:
    return {k: v for k, v in cfg.to_dict().items() if isinstance(v, (int, float, str, bool))}
