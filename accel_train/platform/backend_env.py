"""The environment a backend reads when its process group is made: HCCL's own timeouts below
--timeout_s, a failed collective raised in the calling thread (not the process ended), the backend's
watchdog monitor on. The trainer (accelerator.make_accelerator) and the launcher
(launcher/command.py) both take these facts from here. Light: no torch, so the launcher imports it
before any probe."""

from __future__ import annotations

import os

from ..errors import ConfigError

# HCCL's own timeouts (CANN environment variables HCCL_CONNECT_TIMEOUT, default 120 s, 120..7200,
# and HCCL_EXEC_TIMEOUT, default 1836 s); torch_npu asks for a process-group timeout above both,
# else which timeout ends a job whose peer died is left to chance. Unset ones are set below
# --timeout_s (the launcher exports the same values to the job: derived_hccl_timeouts).
# HCCL_EXEC_TIMEOUT's range depends on the product series (CANN 8.0.0 environment variable
# reference, HCCL_EXEC_TIMEOUT:
# https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/envvar/envref_07_0078.html):
# Atlas training series (910A) (0, 17340], taken as a multiple of 68 (rounded down, at least 68);
# Atlas A2/A3 training series [0, 2147483647] (0: never). The job cannot tell the series here, so
# the smaller bound holds for all: 17340 (= 255 * 68). (In HCCL's "AIV" expansion mode on A2/A3 HCCL
# itself caps it at 1091 s, lower.)
HCCL_TIMEOUTS = ("HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")
HCCL_EXEC_TIMEOUT_MAX = 17340


def derived_hccl_timeouts(timeout_s: int) -> tuple[int, int]:
    """(connect, exec) for --timeout_s: three quarters of it, connect within 120..7200, exec a
    multiple of 68 within 68..17340 (HCCL_EXEC_TIMEOUT_MAX)."""
    budget = timeout_s * 3 // 4
    return min(max(budget, 120), 7200), min(max(budget // 68 * 68, 68), HCCL_EXEC_TIMEOUT_MAX)


def hccl_timeouts(timeout_s: int, env=os.environ) -> None:
    """On NPU, before the process group exists: HCCL's timeouts below --timeout_s. Unset ones are
    set here (HCCL reads them when it builds its communicator, in this process); ones the user set
    must already be below."""
    for name, derived in zip(HCCL_TIMEOUTS, derived_hccl_timeouts(timeout_s)):
        text = env.get(name, "").strip()
        if text and not text.isdigit():
            raise ConfigError(
                f"{name}={text!r} is not a number of seconds; unset it (it is then set from "
                "--timeout_s) or give an integer below --timeout_s"
            )
        value = int(text) if text else derived
        if value >= timeout_s:
            source = f"set to {text}" if text else "its least value"
            raise ConfigError(
                f"--timeout_s {timeout_s} must be above {name} ({value} s, {source}): a dead peer "
                f"would be found by HCCL's timeout or not at all; raise --timeout_s above {value}"
                + (f" or set {name} below {timeout_s}" if text else "")
            )
        env[name] = str(value)


# A failed collective must reach the training thread as an exception (errors.is_lost_peer), not end
# the process (docs/failures.md has the sources). NCCL's default (3) tears the rank down with
# SIGABRT; 2 (CleanUpOnly) makes the watchdog abort the communicator at the collective timeout or on
# an NCCL error, which ends the stuck kernel, and the next collective call raises. HCCL's default
# (1) tears down too; 0 leaves it to HCCL_EXEC_TIMEOUT, HCCL's own timeout on the device, whose task
# error the next call raises (torch_npu up to v2.10.0-26.1.0 reads only HCCL_ASYNC_ERROR_HANDLING
# and takes 0 or 1; later ones read TORCH_HCCL_ASYNC_ERROR_HANDLING first). Each entry: the names a
# backend reads, the value, the names set. A value the user gave under any of the names is kept, and
# nothing is set then. The launcher exports the same to the job.
FAILURE_ENV = {
    "cuda": (
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"),
        "2",
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING",),
    ),
    "npu": (
        ("TORCH_HCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING"),
        "0",
        ("TORCH_HCCL_ASYNC_ERROR_HANDLING", "HCCL_ASYNC_ERROR_HANDLING"),
    ),
}
# set by torchrun's agent for every worker that lacks it
TORCHRUN_DEFAULT = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


def failure_env(kind: str, env=os.environ) -> dict[str, str]:
    """Before the process group exists: the backend of `kind` raises a failed collective in the
    calling thread. Sets what the user did not set (torchrun's own default,
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1 in every worker of an agent whose environment lacks it,
    local_elastic_agent.py _start_workers, counts as not set); returns what it set."""
    if kind not in FAILURE_ENV:
        return {}
    names, value, to_set = FAILURE_ENV[kind]
    given = {n: env[n] for n in names if env.get(n, "").strip()}
    if "TORCHELASTIC_RUN_ID" in env and given == dict([TORCHRUN_DEFAULT]):
        given = {}
    if given:
        return {}
    chosen = dict.fromkeys(to_set, value)
    env.update(chosen)
    return chosen


# The backend's own watchdog monitor (a thread that ends the rank when the backend's watchdog thread
# is stuck, e.g. in a communicator abort that hangs) on, after --timeout_s: no backend wait outlasts
# the collective timeout, as no peer outlasts --heartbeat_timeout_s (heartbeat.py). PyTorch's stock
# ProcessGroupNCCL: on by default, 480 s (ProcessGroupNCCL.hpp TORCH_NCCL_ENABLE_MONITORING,
# TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC; nccl2 has no monitor); torch_npu: off by default, 600 s
# (ProcessGroupHCCL.cpp, the constructor: getCvarBool(TORCH_HCCL_ENABLE_MONITORING, false),
# getCvarInt(TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC, 60 * 10)). Each name the user set is kept; the
# launcher exports the same.
MONITOR_ENV = {
    "cuda": ("TORCH_NCCL_ENABLE_MONITORING", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"),
    "npu": ("TORCH_HCCL_ENABLE_MONITORING", "TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC"),
}


def monitor_env(kind: str, timeout_s: int, env=os.environ) -> dict[str, str]:
    """Before the process group exists: the backend's watchdog monitor on, after --timeout_s;
    returns what it set."""
    chosen = {
        n: v
        for n, v in zip(MONITOR_ENV.get(kind, ()), ("1", str(timeout_s)))
        if not env.get(n, "").strip()
    }
    env.update(chosen)
    return chosen
