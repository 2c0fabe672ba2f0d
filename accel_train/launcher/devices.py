"""The devices this machine's processes may use: the GPUs or NPUs the tools find, limited by the
visible-device variables. Each probe is bounded by ACCEL_PROBE_TIMEOUT (default 60 s): a hung driver
must not hang the launch."""

from __future__ import annotations

import re
import shutil
import subprocess

from . import PREFIX, LaunchError
from .options import is_uint

# The GPUs the CUDA driver shows one process, through torch (it honours CUDA_VISIBLE_DEVICES); run
# by the job's interpreter in a process of its own, so that the launcher never imports torch.
CUDA_COUNT = """import ctypes, sys
try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0); sys.exit()
import torch
print(torch.cuda.device_count())"""


def probe_timeout(env) -> float:
    text = env.get("ACCEL_PROBE_TIMEOUT") or "60"
    try:
        return float(text)
    except ValueError:
        raise LaunchError(
            f"ACCEL_PROBE_TIMEOUT must be a number of seconds, got '{text}'"
        ) from None


def run_tool(cmd: list[str], env, merge_stderr=False) -> tuple[int, str]:
    """(exit status, output) of a probe; 124 where it ran past the probe timeout, as timeout(1)
    reports it."""
    try:
        proc = subprocess.run(
            cmd,
            stdout=subprocess.PIPE,
            text=True,
            errors="replace",
            env=env,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.DEVNULL,
            timeout=probe_timeout(env),
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout or b""
        return 124, out.decode(errors="replace") if isinstance(out, bytes) else out
    except OSError as e:
        return 127, str(e)
    return proc.returncode, proc.stdout


def visible(env, name: str) -> int | None:
    """How many devices the variable NAME lets through, None where it is unset. Like the CUDA
    runtime, the list stops at its first invalid entry (-1, an empty one): "" and "-1" show none."""
    if name not in env:
        return None
    n = 0
    for entry in env[name].split(","):
        entry = entry.replace(" ", "")
        if not entry or entry.startswith("-"):
            break
        n += 1
    return n


def cuda_count(python: str, env) -> str:
    return run_tool([python, "-c", CUDA_COUNT], env)[1].strip()


def count_nvidia(python: str, env, say) -> int:
    """What CUDA will show each process: nvidia-smi's GPUs, or CUDA's own count where nvidia-smi
    cannot say."""
    if shutil.which("nvidia-smi", path=env.get("PATH")) is None:  # an image without nvidia-smi
        n = cuda_count(python, env)
        return int(n) if is_uint(n) else 0
    status, listing = run_tool(["nvidia-smi", "-L"], env, merge_stderr=True)
    listing = listing.rstrip("\n")
    if status != 0:  # a broken driver, a hung GPU
        n = cuda_count(python, env)
        n = int(n) if is_uint(n) else 0
        what = f"counting the {n} GPU(s) CUDA shows" if n else "CUDA shows no GPU either: a CPU job"
        say(
            f"{PREFIX}: warning: nvidia-smi fails ({(listing or 'no output').splitlines()[0]}):"
            f" {what}"
        )
        return n
    lines = listing.splitlines()
    mig = [line for line in lines if re.match(r" *MIG ", line)]
    if mig:
        # a MIG instance is listed under its physical GPU; CUDA shows one process a single MIG
        # instance, whatever CUDA_VISIBLE_DEVICES lists (NVIDIA MIG User Guide, "CUDA Device
        # Enumeration"): count as CUDA does
        n = cuda_count(python, env)
        n = int(n) if is_uint(n) else 1
        say(
            f"{PREFIX}: MIG instances here ({len(mig)} listed by nvidia-smi -L): CUDA shows a"
            f" process one of them: {n} GPU(s) counted"
        )
        return n
    return sum(line.startswith("GPU ") for line in lines)


def count_npu(env) -> str:
    """npu-smi's "Total Count" of NPUs, "" without npu-smi (or where it says none)."""
    if shutil.which("npu-smi", path=env.get("PATH")) is None:
        return ""
    for line in run_tool(["npu-smi", "info", "-l"], env)[1].splitlines():
        if "Total Count" in line:
            return line.partition(":")[2].replace(" ", "").strip()
    return ""


def ascend_cards_per_node(rank_size: str, nnodes: str) -> int:
    """Without npu-smi: RANK_SIZE counts the rank table's cards, all nodes together."""
    if not is_uint(rank_size) or int(rank_size) < 1:
        raise LaunchError(f"RANK_SIZE must be a positive integer, got '{rank_size}'")
    if not is_uint(nnodes) or int(nnodes) < 1:
        return int(rank_size)  # (a bad count of machines is reported with the others)
    if int(rank_size) % int(nnodes):
        raise LaunchError(
            f"RANK_SIZE={rank_size} cards cannot be split evenly over {nnodes} machines"
        )
    return int(rank_size) // int(nnodes)


def limit(found, shown: int | None) -> int:
    found = int(found) if isinstance(found, int) or is_uint(str(found)) else 0
    return shown if shown is not None and shown < found else found
