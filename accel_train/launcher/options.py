"""The launcher's own options and the ModelArts boot arguments; the rest goes to the trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import LaunchError

HELP = """\
launch.sh: the one launcher for accel_train on clusters and as a ModelArts boot command.

Works out the number of machines, this machine's rank, the rank-0 host and port and the processes
per machine, picks the accelerate config for the hardware it finds, and runs
  python3 -m accelerate.commands.launch (accelerate launch)
    --config_file accelerate_configs/<cfg>.yaml <what YAML cannot carry> -m accel_train <args>
(launch.sh execs `python3 -m accel_train.launcher`, which does all of this.)

Sources, first match wins for each value:
  1. explicit:   NNODES NODE_RANK MASTER_ADDR MASTER_PORT NPROC_PER_NODE
  2. ModelArts:  MA_NUM_HOSTS|VC_WORKER_NUM  VC_TASK_INDEX  first of VC_WORKER_HOSTS  MA_NUM_GPUS
                 (MA_NUM_GPUS=0: a CPU-only flavour) and the boot arguments
                 --init_method tcp://HOST:PORT --rank N --world_size N
  3. Kubeflow:   PET_NNODES PET_NODE_RANK (MASTER_ADDR MASTER_PORT) PET_NPROC_PER_NODE (a number,
                 or the operator's default auto: the visible GPUs or NPUs, else 1; gpu: the GPUs;
                 cpu: one CPU process); an elastic PyTorchJob (PET_NNODES=MIN:MAX,
                 PET_RDZV_BACKEND) is refused: no elasticPolicy
  4. SLURM:      SLURM_NNODES SLURM_NODEID  first host of the step's SLURM_STEP_NODELIST
                 (else SLURM_NODELIST, SLURM_JOB_NODELIST)  SLURM_GPUS_ON_NODE
  5. else one machine; processes per machine = the visible GPUs or NPUs, else 1.
ModelArts' Ascend-Powered-Engine preset runs this file once per card (ASCEND_DEVICE_ID, RANK_ID,
RANK_SIZE, RANK_TABLE_FILE set): only device 0's copy starts the job, for every card of the node
(without npu-smi: RANK_SIZE / machines of them); the other copies exit 0 at once.
Started as a worker of torchrun (TORCHELASTIC_RUN_ID, RANK set), it runs the trainer for that rank
in place.
NPUs: HCCL_CONNECT_TIMEOUT and HCCL_EXEC_TIMEOUT are set below the trainer's --timeout_s unless set.
A failed collective raises in the trainer instead of ending the rank, unless you set these yourself:
TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (GPUs),
TORCH_HCCL_ASYNC_ERROR_HANDLING=HCCL_ASYNC_ERROR_HANDLING=0 (NPUs);
the backend's watchdog monitor on, after --timeout_s: TORCH_{NCCL,HCCL}_ENABLE_MONITORING=1,
TORCH_{NCCL,HCCL}_HEARTBEAT_TIMEOUT_SEC=<--timeout_s>.
Devices: nvidia-smi (torch.cuda.device_count() without it, where it fails: a warning, or where it
lists MIG instances), npu-smi; CUDA_VISIBLE_DEVICES and ASCEND_RT_VISIBLE_DEVICES limit them
("" or -1: none visible, so one CPU process).

Own options (everything else goes to the trainer):
  --dry-run             print the exact command and exit
  --smoke-test          instead of training, run Accelerate's test script on this setup and fail
                        unless every rank joined one group of the expected size (accel-train smoke)
  --preflight           check the rank-0 host and port before each attempt (always done for
                        several machines; --no-preflight skips it)
  --rdzv_wait S         how long the first rendezvous of several machines waits for every machine
                        (a non-zero rank's preflight for rank 0 to come up, rank 0 for the
                        others to join; or ACCEL_RDZV_WAIT=S; default 600, like torchrun's
                        rendezvous timeout)
  --rejoin_wait S       how long a relaunch of several machines waits for the other machines
                        to rejoin (or ACCEL_REJOIN_WAIT=S; default the trainer's --timeout_s + 60:
                        the others find the loss and relaunch within it); none came: exit
                        status 3, the newest checkpoint kept, for the platform or you to start
                        every machine again
  --accel_config NAME   config name or path (or ACCEL_CONFIG=...); default: by hardware. A named
                        config for one machine also gives the processes (its num_processes, at
                        most one per visible GPU/NPU) unless NPROC_PER_NODE or the platform
                        gives a count
  --max_restarts N      relaunch a failed job up to N times, resuming from the newest checkpoint of
                        the run it started (or ACCEL_MAX_RESTARTS=N; after --overwrite never the run
                        that --overwrite replaces); only a lost peer (3) or a killed rank (137)
                        is relaunched: bad input (2), an error (1) or divergence (5) never are;
                        a job of several machines that fails before any rank starts (1) is a
                        machine missing from the rendezvous, relaunched as a lost peer
  --restart_on_preempt  also relaunch after a preemption (exit 4) that did not come through this
                        script (or ACCEL_RESTART_ON_PREEMPT=1); SIGTERM/SIGUSR1 to this script is
                        passed to the job, which checkpoints and stops with exit status 4
  -h, --help            this text"""

# The options that take a value, as the attribute each one sets (ModelArts' boot arguments too).
VALUED = {
    "--rdzv_wait": "rdzv_wait",
    "--rejoin_wait": "rejoin_wait",
    "--accel_config": "accel_config",
    "--max_restarts": "max_restarts",
    "--init_method": "init_method",
    "--rank": "rank",
    "--world_size": "world_size",
}


# The launcher's own flags without a value.
OWN = (
    "--dry-run",
    "--dry_run",
    "--smoke-test",
    "--smoke_test",
    "--preflight",
    "--no-preflight",
    "--no_preflight",
    "--restart_on_preempt",
)


@dataclass
class Options:
    dry_run: bool = False
    smoke_test: bool = False
    preflight: str = "auto"  # "1", "0" or "auto": several machines
    accel_config: str = ""
    max_restarts: str = "0"
    rdzv_wait: str = "600"
    rejoin_wait: str = ""  # "": the trainer's --timeout_s + plan.REJOIN_MARGIN_S
    restart_on_preempt: bool = False
    init_method: str = ""
    rank: str = ""
    world_size: str = ""
    help: bool = False
    given: list[str] = field(default_factory=list)  # the launcher's own options given, in order
    trainer_args: list[str] = field(default_factory=list)


def parse(argv: list[str], env) -> Options:
    """The launcher's options out of argv, the rest kept in order for the trainer; the
    environment's defaults."""
    opts = Options(
        accel_config=env.get("ACCEL_CONFIG", ""),
        max_restarts=env.get("ACCEL_MAX_RESTARTS") or "0",
        rdzv_wait=env.get("ACCEL_RDZV_WAIT") or env.get("PREFLIGHT_TIMEOUT") or "600",
        rejoin_wait=env.get("ACCEL_REJOIN_WAIT", ""),
        restart_on_preempt=(env.get("ACCEL_RESTART_ON_PREEMPT") or "0") == "1",
    )
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if arg in OWN or name in VALUED:
            opts.given.append(name if name in VALUED else arg)
        if arg in ("--dry-run", "--dry_run"):
            opts.dry_run = True
        elif arg in ("--smoke-test", "--smoke_test"):
            opts.smoke_test = True
        elif arg == "--preflight":
            opts.preflight = "1"
        elif arg in ("--no-preflight", "--no_preflight"):
            opts.preflight = "0"
        elif arg == "--restart_on_preempt":
            opts.restart_on_preempt = True
        elif arg in ("-h", "--help"):
            opts.help = True
            return opts
        elif name in VALUED and eq:
            setattr(opts, VALUED[name], value)
        elif arg in VALUED:
            if i + 1 >= len(argv):
                raise LaunchError(f"{arg} needs a value")
            i += 1
            setattr(opts, VALUED[arg], argv[i])
        else:
            opts.trainer_args.append(arg)
        i += 1
    return opts


def is_uint(text: str) -> bool:
    return text.isascii() and text.isdigit()


def trainer_seconds(args: list[str], flag: str, default: int) -> int:
    """The whole seconds the trainer will read for `flag` (the last one given wins, as in argparse;
    rounded up); the default where it is not given or not a plain number (the trainer reports a bad
    value itself; a --config file's value is not read here)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
        elif arg == flag:
            value = args[i + 1] if i + 1 < len(args) else ""
    if value is None:
        return default
    whole, dot, fraction = value.partition(".")
    if not is_uint(whole) or (fraction and not is_uint(fraction)):
        return default
    return int(whole) + (1 if fraction.strip("0") else 0)
