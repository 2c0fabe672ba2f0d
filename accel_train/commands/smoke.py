"""Smoke check:
`accel-train smoke --config_file accelerate_configs/<platform>.yaml [accelerate launch options]`.

Runs Accelerate's own test script (the one `accelerate test` runs) through `accelerate launch` with
the given config and options, in the environment the trainer gets (ACCELERATE_USE_CPU=1 for CPU
configs and on hosts without an accelerator), and passes only if the ranks really formed the
config's group: every process this machine should hold reports `Num processes: <total>`, their
`Process index` values are exactly this machine's share
(machine_rank x per-machine .. +per-machine-1), and the script exits 0. `accelerate test` alone
prints "Test is a success" when N single-process runs ran side by side; this check fails then.

`--timeout S` (default 900): no result by then (a rendezvous that never completes, a rank stuck in a
collective) is a failure, and the launcher and every worker it started are stopped.

Several machines: run it on every machine with that machine's --machine_rank and the rank-0
--main_process_ip/--main_process_port (launch.sh --smoke-test does it from the platform variables).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from ..errors import ConfigError
from ..platform.hardware import has_accelerator

NUM_RE = re.compile(r"^Num processes: (\d+)\s*$", re.M)
INDEX_RE = re.compile(r"^Process index: (\d+)\s*$", re.M)


def test_script() -> Path:
    import accelerate

    return Path(accelerate.__file__).resolve().parent / "test_utils" / "scripts" / "test_script.py"


def check(output: str, returncode: int, total: int, indices: range) -> list[str]:
    """What is wrong with a run of Accelerate's test script that should hold `indices` of a group of
    `total`."""
    problems = []
    if returncode != 0:
        problems.append(f"Accelerate's test script exited with status {returncode}")
    sizes = [int(n) for n in NUM_RE.findall(output)]
    seen = sorted(int(i) for i in INDEX_RE.findall(output))
    if len(sizes) != len(indices) or any(n != total for n in sizes):
        problems.append(
            f"expected {len(indices)} process(es) here each reporting "
            f"'Num processes: {total}', got {', '.join(map(str, sizes)) or 'none'}: "
            f"the ranks did not join one group of {total}"
            + (
                " (one process was started: a config with distributed_type NO, as "
                "`accelerate config default` writes it, or MULTI_CPU without an MPI "
                "hostfile runs one whatever --num_processes says; use "
                "accelerate_configs/2proc_cpu.yaml for CPU ranks or 1node_gpu.yaml "
                "for GPUs)"
                if total > 1 and sizes == [1]
                else ""
            )
        )
    if seen != list(indices):
        problems.append(
            f"expected process indices {indices.start}..{indices.stop - 1} here, got "
            f"{', '.join(map(str, seen)) or 'none'}"
        )
    return problems


def layout(argv: list[str]) -> tuple[str, int, int, int, bool]:
    """(config_file, total processes, machines, this machine's rank, CPU run) as accelerate launch
    will see them."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    # accelerate launch takes each of these with hyphens too (--num-processes, ...): so must this
    # reading of them
    p.add_argument("--config_file", "--config-file")
    p.add_argument("--num_processes", "--num-processes", type=int)
    p.add_argument("--num_machines", "--num-machines", type=int)
    p.add_argument("--machine_rank", "--machine-rank", type=int)
    p.add_argument("--cpu", action="store_true")
    try:
        known, _ = p.parse_known_args(argv)
    except SystemExit:
        raise ConfigError("bad accelerate launch options (see accel-train smoke --help)") from None
    if not known.config_file:
        raise ConfigError(
            "--config_file is required: name the accelerate config to check, e.g. "
            "accelerate_configs/2proc_cpu.yaml"
        )
    if not Path(known.config_file).is_file():
        raise ConfigError(f"--config_file {known.config_file}: no such file")
    from accelerate.commands.config.config_args import load_config_from_file

    try:
        cfg = load_config_from_file(known.config_file)
    except Exception as e:  # accelerate raises ValueError/TypeError/yaml errors for a bad file
        raise ConfigError(
            f"accelerate config {known.config_file} does not load: {str(e).strip()[:200]}"
        ) from None
    total = known.num_processes or cfg.num_processes or 1
    machines = known.num_machines or cfg.num_machines or 1
    rank = known.machine_rank if known.machine_rank is not None else (cfg.machine_rank or 0)
    if total % machines:
        raise ConfigError(
            f"{total} processes cannot be split evenly over {machines} machines; fix num_processes"
        )
    if not 0 <= rank < machines:
        raise ConfigError(f"machine_rank {rank} is not below the number of machines {machines}")
    dist = str(getattr(cfg.distributed_type, "value", cfg.distributed_type))
    cpu = (
        known.cpu
        or bool(getattr(cfg, "use_cpu", False))
        or dist == "MULTI_CPU"
        or not has_accelerator()
    )
    return known.config_file, total, machines, rank, cpu


def copy_lines(stream, lines: list[str]) -> None:
    for line in stream:
        sys.stdout.write(line)
        lines.append(line)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, by the parent links in /proc (none where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(d.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def stop_tree(pid: int) -> None:
    """SIGKILL the launcher (`pid`, leader of its own session) and everything below it. torch
    elastic starts each worker in a session of its own, out of reach of the launcher's process
    group: the workers are found through /proc while the launcher, stopped first so that it starts
    nothing new, is still their parent."""

    def kill(how, target, sig):
        try:
            how(target, sig)
        except OSError:  # (gone already, or not a group leader)
            pass

    kill(os.killpg, pid, signal.SIGSTOP)
    for below in descendants(pid):
        # a worker leads a group of its own (its DataLoader workers)
        kill(os.killpg, below, signal.SIGKILL)
        kill(os.kill, below, signal.SIGKILL)
    kill(os.killpg, pid, signal.SIGKILL)


def main_smoke(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--timeout", type=float, default=900.0)
    own, launch_args = p.parse_known_args(argv)
    config_file, total, machines, rank, cpu = layout(launch_args)
    per_machine = total // machines
    here = range(rank * per_machine, (rank + 1) * per_machine)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cpu:
        env["ACCELERATE_USE_CPU"] = "1"  # without it, ranks on a CPU host never join one group
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(test_script())]
    print(f"smoke: {' '.join(cmd)}{' (ACCELERATE_USE_CPU=1)' if cpu else ''}", flush=True)
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=copy_lines, args=(proc.stdout, lines), daemon=True)
    reader.start()
    reader.join(own.timeout)
    timed_out = reader.is_alive()
    # a rendezvous that never completes, a rank stuck in a collective: stop everything it started
    if timed_out:
        stop_tree(proc.pid)
        # (the pipe closes once its last writer is gone; no longer than that in any case)
        reader.join(5)
        try:
            returncode = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            returncode = None
    else:
        returncode = proc.wait()
    sys.stdout.flush()
    problems = check("".join(lines), returncode, total, here)
    if timed_out:
        problems = [
            (
                f"no result within --timeout {own.timeout:.0f}s (a rendezvous that never "
                "completed, or a rank stuck in a collective?); the launcher and its workers "
                "were stopped"
            ),
            *(p for p in problems if not p.startswith("Accelerate's test script exited")),
        ]
    name = Path(config_file).name
    if problems:
        print(f"smoke: FAILED for {name}: " + "; ".join(problems), file=sys.stderr, flush=True)
        return 1
    print(
        f"smoke: ok: {name}: {per_machine} process(es) here (indices "
        f"{here.start}..{here.stop - 1}) in one group of {total} over {machines} machine(s)",
        flush=True,
    )
    return 0
