"""The command an attempt runs and its environment: the accelerate config for the hardware, the
launch arguments YAML cannot carry, the variables each backend needs, the config check and the
precision probe."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

from ..platform import backend_env
from . import PREFIX, LaunchError
from .devices import probe_timeout

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "accelerate_configs"

# The config for the hardware found: (device, several machines, several processes here) -> its name.
CONFIG_FOR = {
    ("cpu", False, False): "cpu",
    ("cpu", False, True): "2proc_cpu",
    ("cpu", True, False): "2node_cpu",
    ("cpu", True, True): "2node_cpu",
    ("gpu", False, False): "1node_gpu",
    ("gpu", False, True): "1node_gpu",
    ("gpu", True, False): "2node_gpu",
    ("gpu", True, True): "2node_gpu",
    ("npu", False, False): "1node_npu",
    ("npu", False, True): "1node_npu",
    ("npu", True, False): "2node_npu",
    ("npu", True, True): "2node_npu",
}
# The network interfaces the user chose for each backend travel with the job.
SOCKET_VARS = (
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "HCCL_SOCKET_IFNAME",
    "HCCL_IF_IP",
    "TP_SOCKET_IFNAME",
)


def config_file(name: str) -> Path:
    """A config given as a path, else by name in accelerate_configs/."""
    if Path(name).is_file():
        return Path(name)
    path = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if not CONFIG_DIR.is_dir():
        raise LaunchError(
            f"accelerate config '{name}' not found: no accelerate_configs/ beside this accel_train"
            f" ({REPO}; the configs are not part of an installed package): run launch.sh from a"
            " checkout of accel_train, or pass --accel_config PATH"
        )
    if not path.is_file():
        names = "".join(f"{p.name} " for p in sorted(CONFIG_DIR.glob("*.yaml")))
        raise LaunchError(
            f"accelerate config '{name}' not found (looked for it as a path and in {CONFIG_DIR}); "
            f"name one of: {names}"
        )
    return path


def config_value(path: Path, pattern: str) -> str | None:
    """The first line's match of `pattern` (a top-level key's value; group 1), None where no line
    matches."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise LaunchError(f"accelerate config {path} is invalid: {e}") from None
    for line in text.splitlines():
        match = re.match(pattern, line)
        if match:
            return match.group(1)
    return None


def python_path(env) -> str:
    return f"{REPO}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)


def job_env(device: str, timeout_s: int, env, say) -> dict[str, str]:
    """The variables the job gets on top of the launcher's environment, in the order the dry run
    prints them. A dead peer must be found by the trainer's own collective timeout (--timeout_s) on
    every backend: HCCL's own timeouts are set below it unless the user set them (the trainer then
    refuses values not below it); a failed collective reaches the trainer as an exception instead of
    ending the rank, and the backend's watchdog monitor is on after --timeout_s (backend_env: the
    trainer sets the same in each rank; torchrun passes the environment to every rank)."""
    out = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path(env)}
    # (torchrun's own default counts as unset only inside a torchrun worker: the launcher is none)
    own = {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"}
    if device == "cpu":
        out["ACCELERATE_USE_CPU"] = "1"
    elif device == "gpu":
        out.update(backend_env.failure_env("cuda", dict(own)))
        out.update(backend_env.monitor_env("cuda", timeout_s, dict(own)))
    else:
        connect, exec_ = backend_env.derived_hccl_timeouts(timeout_s)
        if not env.get("HCCL_EXEC_TIMEOUT") and exec_ == backend_env.HCCL_EXEC_TIMEOUT_MAX:
            say(
                f"{PREFIX}: HCCL_EXEC_TIMEOUT={exec_}: capped at CANN's upper bound (Atlas training"
                " series), below three quarters of --timeout_s"
            )
        out["HCCL_CONNECT_TIMEOUT"] = env.get("HCCL_CONNECT_TIMEOUT") or str(connect)
        out["HCCL_EXEC_TIMEOUT"] = env.get("HCCL_EXEC_TIMEOUT") or str(exec_)
        out.update(backend_env.failure_env("npu", dict(own)))
        out.update(backend_env.monitor_env("npu", timeout_s, dict(own)))
    out.update({name: env[name] for name in SOCKET_VARS if env.get(name)})
    return out


def launch_args(
    config: Path, nnodes: int, nproc: int, node_rank: int, addr: str, port: str
) -> list[str]:
    args = [
        "--config_file",
        str(config),
        "--num_machines",
        str(nnodes),
        "--num_processes",
        str(nnodes * nproc),
    ]
    if nnodes > 1:
        args += [
            "--machine_rank",
            str(node_rank),
            "--main_process_ip",
            addr,
            "--main_process_port",
            port,
            "--rdzv_backend",
            "static",
            "--same_network",
        ]
    elif port:
        args += ["--main_process_port", port]
    return args


def rendezvous_wait(seconds: int) -> list[str]:
    """How long the rendezvous of several machines waits for all of them (torch's static rendezvous
    timeout: rank 0's store for the others, the others' connection to it; default 600 s); then
    accelerate launch exits 1 and no rank has started."""
    return ["--rdzv_conf", f"timeout={seconds}"]


def check_config(python: str, config: Path, env) -> None:
    """The config must load with accelerate's own loader (an unknown key is an error) before
    anything starts, and before the precision probe prints its line (platform/accel_config.py; a
    file that loaded before is not read again). Status 3: this interpreter cannot import accelerate
    (a venv not activated): it is named, not the config."""
    try:
        proc = subprocess.run(
            [python, "-m", "accel_train.platform.accel_config", str(config)],
            capture_output=True,
            text=True,
            env={**env, "PYTHONPATH": python_path(env)},
        )
    except OSError as e:
        raise LaunchError(
            f"{python} ({shutil.which(python) or 'not found'}) could not check accelerate config "
            f"{config}: {e.strerror}"
        ) from None
    problem = proc.stdout.rstrip("\n")
    if proc.returncode == 1:
        raise LaunchError(f"accelerate config {config} is invalid: {problem or 'it does not load'}")
    if proc.returncode == 3:
        raise LaunchError(problem)
    if proc.returncode:
        said = [line for line in proc.stderr.splitlines() if line.strip()]
        raise LaunchError(
            f"{python} ({shutil.which(python) or 'not found'}) could not check accelerate config "
            f"{config}: {said[-1] if said else f'exit status {proc.returncode}'}"
        )


def probe_precision(
    python: str, device: str, config_precision: str | None, named: bool, env, say
) -> tuple[list[str], dict[str, str]]:
    """A precision the device has (platform/hardware.py; docs/speed.md: Precision and memory
    format per platform): bf16 where native, fp16 with loss scaling on pre-Ampere GPUs and Ascend
    910A, fp32 on CPUs without bf16. Our own configs get the device's best; a config the user named
    keeps its own where the device has it. Returns the launch arguments and the job's variables it
    adds."""
    probe = [python, "-m", "accel_train.platform.hardware"]
    probe += ["--config_precision", config_precision or ""]
    probe += ["--cpu"] * (device == "cpu") + ["--keep"] * named
    try:
        chosen = subprocess.run(
            probe,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**env, "PYTHONPATH": python_path(env)},
            timeout=probe_timeout(env),
        ).stdout.rstrip("\n")
    except (OSError, subprocess.TimeoutExpired):
        chosen = ""
    precision, _, reason = chosen.partition(" ")
    if precision not in ("no", "fp16", "bf16"):
        say(
            f"{PREFIX}: warning: could not read the device's precision facts; the config's"
            f" mixed_precision ({config_precision or 'no'}) stays"
        )
        return [], {}
    say(f"{PREFIX}: {reason or chosen}")
    args = ["--mixed_precision", precision] if precision != (config_precision or "no") else []
    # the launcher's own pick (not a precision the user's named config asked for): the trainer's
    # start-up check may fall back to fp32 where this precision computes wrong gradients for the
    # run's shapes (docs/speed.md)
    auto = not named or not config_precision or precision != config_precision
    return args, ({"ACCEL_TRAIN_AUTO_PRECISION": precision} if auto else {})


def dry_run_line(env_vars: dict[str, str], cmd: list[str]) -> str:
    """`env K=V ... CMD`, each word quoted for a shell (shlex.quote; a space after each, as the line
    has always been)."""
    return "".join(
        shlex.quote(w) + " " for w in ["env", *(f"{k}={v}" for k, v in env_vars.items()), *cmd]
    )


def uses_own_precision_flag(trainer_args: list[str]) -> bool:
    return any(a.startswith(("--mixed_precision", "--force_precision")) for a in trainer_args)
