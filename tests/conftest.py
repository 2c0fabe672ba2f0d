"""Shared helpers: CIFAR-10 files in the real pickle format, and real `accelerate launch` runs."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "accelerate_configs"

# The device facts every test, trainer and rank sees: pinned, so that no result depends on the CPU
# running the suite (with the machine's own facts, every automatic-precision run trains bf16 on a
# CPU with avx512_bf16 and fp32 elsewhere, each comparison on another numeric path).
# ACCEL_TRAIN_TEST_CPU=bf16 runs the suite as a CPU with native bf16 (.ci/run runs the min-versions
# tests that way); a test that needs other facts sets its own.
TEST_CPUS = {
    "plain": {
        "kind": "cpu",
        "name": "test cpu without bf16",
        "cpu_flags": ["avx2", "avx512f"],
        "arch": "x86_64",
    },
    "bf16": {
        "kind": "cpu",
        "name": "test cpu with bf16",
        "cpu_flags": ["avx2", "avx512f", "avx512_bf16"],
        "arch": "x86_64",
    },
}
TEST_CPU = os.environ.get("ACCEL_TRAIN_TEST_CPU", "plain")
os.environ["ACCEL_TRAIN_DEVICE_FACTS"] = json.dumps(TEST_CPUS[TEST_CPU])


def cifar_arrays(n: int, rng: np.random.Generator, learnable: bool) -> tuple[np.ndarray, list[int]]:
    labels = rng.integers(0, 10, n)
    if learnable:
        # Class c: a fixed colour of its own plus noise; crops and flips keep it.
        colours = np.random.default_rng(1234).integers(30, 226, (10, 3))
        img = colours[labels][:, :, None].repeat(1024, axis=2).astype(np.int16)
        img += rng.integers(-25, 26, img.shape)
        data = np.clip(img, 0, 255).astype(np.uint8).reshape(n, 3072)
    else:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return data, [int(v) for v in labels]


def write_batch(path: Path, data, labels, **extra) -> None:
    obj = {
        b"batch_label": path.name.encode(),
        b"labels": labels,
        b"data": data,
        b"filenames": [f"img_{i}.png".encode() for i in range(len(labels))],
        **extra,
    }
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar(
    root: Path, rows=(7, 5, 6, 9, 3), test_rows: int = 11, learnable: bool = False, seed: int = 0
) -> Path:
    """<root>/cifar-10-batches-py in the real format, with any number of rows per batch file."""
    d = Path(root) / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(rows, start=1):
        write_batch(d / f"data_batch_{i}", *cifar_arrays(n, rng, learnable))
    write_batch(d / "test_batch", *cifar_arrays(test_rows, rng, learnable))
    with open(d / "batches.meta", "wb") as f:
        pickle.dump(
            {
                b"label_names": [
                    b"airplane",
                    b"automobile",
                    b"bird",
                    b"cat",
                    b"deer",
                    b"dog",
                    b"frog",
                    b"horse",
                    b"ship",
                    b"truck",
                ],
                b"num_cases_per_batch": 10000,
            },
            f,
            protocol=2,
        )
    return Path(root)


class Exploit:
    """Pickles to os.system("touch <path>"): a batch file that would run code when unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def clean_env(**extra) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            ("ACCELERATE_", "MASTER_", "WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC")
        )
    }
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TQDM_DISABLE="1", **extra)
    return env


def run(cmd: list, timeout: float, env: dict, cwd) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own: at the timeout the whole group goes (torchrun's ranks
    too, which would otherwise outlive the test holding a port and both cores)."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(map(str, cmd))}\nSTDOUT:\n{out[-3000:]}\n"
            f"STDERR:\n{err[-5000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(
    config: str,
    args: list[str],
    timeout: float = 300,
    env: dict | None = None,
    check: bool = True,
    cwd=ROOT,
    launcher: tuple = (),
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file <config> [launcher args] -m accel_train <args>` (config: a
    name in accelerate_configs/ or a path).

    A one-process config (cpu.yaml, or a copy) runs in this process (see in_process) unless
    fresh=True asks for the new interpreters, or --compile does (torch.compile's caches belong to
    the process); every config with ranks is the real launch."""
    if not (launcher or fresh or compiles(args)) and one_process(config):
        proc = in_process(args, timeout, env, cwd, config)
    else:
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIGS / config),
            *map(str, launcher),
            "-m",
            "accel_train",
            *map(str, args),
        ]
        proc = run(cmd, timeout, env or clean_env(), cwd)
    if check and proc.returncode != 0:
        raise AssertionError(
            "exit"
            f" {proc.returncode}\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
        )
    return proc


def compiles(args) -> bool:
    return any(str(a) == "--compile" or str(a).startswith("--compile=") for a in args)


def one_process(config: str) -> bool:
    # (CONFIGS / an absolute path is that path)
    settings = yaml.safe_load((CONFIGS / config).read_text())
    return settings.get("num_processes") == 1 and settings.get("distributed_type") == "NO"


def run_cli(
    args: list[str], timeout: float = 120, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """`python -m accel_train <args>` as a plain single process: in this process unless fresh=True
    (or --compile)."""
    if not (fresh or compiles(args)):
        return in_process(args, timeout, env, ROOT)
    return run(
        [sys.executable, "-m", "accel_train", *map(str, args)], timeout, env or clean_env(), ROOT
    )


# ---------------------------------------------------------------------------------------------
# One-process runs in the test process. A new interpreter costs ~10 s here (torch, then timm ->
# torchvision -> torch._dynamo) and `accelerate launch` another ~5 s, most of a small run. The
# trainer's own entry point, cli.main(args), runs here instead, with what the launch would give it:
# the launcher's environment (Accelerate's own prepare_simple_launcher_cmd_env from the config), its
# thread count, the working directory, stdout/stderr and the INFO log captured as the process's
# would be, a timeout; Accelerate's process state and the signal handlers are restored after. What a
# real process adds (exit status through sys.exit, torchrun, signals from outside) is tested with
# fresh=True and by every multi-rank launch.
# ---------------------------------------------------------------------------------------------


class InProcessTimeout(BaseException):
    # not an Exception: the trainer's own handlers must not take it
    pass


def launcher_env(config: str, env: dict) -> dict:
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_simple_launcher_cmd_env

    with (
        mock.patch.dict(os.environ, env, clear=True),
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
    ):
        parsed = launch_command_parser().parse_args(
            ["--config_file", str(CONFIGS / config), "-m", "accel_train"]
        )
        parsed = _validate_launch_command(parsed)[0]
        return prepare_simple_launcher_cmd_env(parsed)[1]


def in_process(
    args: list, timeout: float, env: dict | None, cwd, config: str | None = None
) -> subprocess.CompletedProcess:
    """config: as `accelerate launch --config_file <config>` (whose simple launcher exits 1 for any
    failure, as here); None: as `python -m accel_train` (the trainer's own status)."""
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from accel_train.cli import main

    env = env or clean_env()
    launched = (
        None  # what the trainer reads of its parent `accelerate launch` (accelerator.parent_launch)
    )
    if config:
        env = launcher_env(config, env)
        launched = (["--config_file", str(CONFIGS / config)], Path(cwd))
    out, err = io.StringIO(), io.StringIO()
    log = logging.StreamHandler(err)
    # as cli.main's
    log.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    root, level, threads, here = (
        logging.getLogger(),
        logging.getLogger().level,
        torch.get_num_threads(),
        os.getcwd(),
    )
    handlers = {
        sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
    }
    # pytest-timeout's own alarm (the suite's per-test bound) is set aside and given back, less the
    # time spent; where it comes first, its own handler runs (its stack dump, its failure)
    pending, started = signal.getitimer(signal.ITIMER_REAL)[0], time.monotonic()
    ours = min(timeout, pending) if pending else timeout

    def expired(signum, frame):
        if pending and pending <= timeout and callable(alarm):
            alarm(signum, frame)
        raise InProcessTimeout(
            f"timed out after {timeout}s: accel_train {' '.join(map(str, args))}"
        )

    def warn(message, category, filename, lineno, file=None, line=None):
        # where a real process prints them
        err.write(warnings.formatwarning(message, category, filename, lineno, line))

    # the trainer makes its own Accelerator, as in a new process
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    alarm = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, ours)
    try:
        with (
            mock.patch.dict(os.environ, env, clear=True),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(),
            mock.patch("accel_train.platform.accelerator.parent_launch", lambda: launched),
        ):
            warnings.simplefilter("default")
            warnings.showwarning = warn
            os.chdir(cwd)
            root.addHandler(log)
            root.setLevel(logging.INFO)
            torch.set_num_threads(int(env.get("OMP_NUM_THREADS", threads)))
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's --help / --version
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except InProcessTimeout as e:
        raise AssertionError(
            f"{e}\nSTDOUT:\n{out.getvalue()[-3000:]}\nSTDERR:\n{err.getvalue()[-5000:]}"
        ) from None
    finally:  # (pytest-timeout's alarm last: nothing of this clean-up may be cut short)
        signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        root.removeHandler(log)
        root.setLevel(level)
        torch.set_num_threads(threads)
        os.chdir(here)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        gc.collect()  # (a run's persistent DataLoader workers end here, not at some later test)
        signal.signal(signal.SIGALRM, alarm)
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - started), 0.001))
    if config and code != 0:
        code = 1  # accelerate's simple launcher: CalledProcessError for any failed child
    return subprocess.CompletedProcess(
        ["accel_train", *map(str, args)], code, out.getvalue(), err.getvalue()
    )


@pytest.fixture
def cifar_dir(tmp_path):
    return write_cifar(tmp_path / "input_dir")


# ---------------------------------------------------------------------------------------------
# Two real network hosts: network namespaces joined by a veth pair, each with its own address and
# its own /etc/hosts (ModelArts-style worker names).
# ---------------------------------------------------------------------------------------------


class TwoHosts:
    def __init__(self, tag: str):
        self.ns = [f"at{tag}n0", f"at{tag}n1"]
        self.ifname = [f"at{tag}v0", f"at{tag}v1"]
        subnet = 100 + int(tag) % 100
        self.ip = [f"10.231.{subnet}.1", f"10.231.{subnet}.2"]
        self.names = [f"modelarts-job-{tag}-worker-{i}.modelarts-job-{tag}.svc" for i in range(2)]

    def sh(self, *cmd):
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)

    def up(self):
        for ns in self.ns:
            self.sh("ip", "netns", "add", ns)
        self.sh("ip", "link", "add", self.ifname[0], "type", "veth", "peer", "name", self.ifname[1])
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{ip} {name}\n" for ip, name in zip(self.ip, self.names)
        )
        for ns, ifname, ip in zip(self.ns, self.ifname, self.ip):
            self.sh("ip", "link", "set", ifname, "netns", ns)
            self.sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", ifname)
            self.sh("ip", "-n", ns, "link", "set", ifname, "up")
            self.sh("ip", "-n", ns, "link", "set", "lo", "up")
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts)
            (etc / "hostname").write_text(ns + "\n")

    def down(self):
        for ns in self.ns:
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30
            ).stdout
            for pid in pids.split():
                subprocess.run(["kill", "-9", pid], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    def popen(self, node: int, cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
        f = open(log, "w")
        return subprocess.Popen(
            ["ip", "netns", "exec", self.ns[node], *map(str, cmd)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )

    def env(self, node: int, **extra) -> dict:
        return clean_env(GLOO_SOCKET_IFNAME=self.ifname[node], **extra)

    def launch_plain(self, args: list, logdir: Path) -> tuple[list[subprocess.Popen], list[Path]]:
        """launch.sh on both hosts with the plain variables (NNODES, NODE_RANK, MASTER_ADDR,
        MASTER_PORT)."""
        port = str(random.randint(20000, 40000))
        procs, logs = [], []
        for node in (0, 1):
            env = self.env(
                node, NNODES="2", NODE_RANK=str(node), MASTER_ADDR=self.ip[0], MASTER_PORT=port
            )
            logs.append(logdir / f"node{node}.log")
            procs.append(self.popen(node, ["bash", ROOT / "launch.sh", *args], env, logs[-1]))
        return procs, logs


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int]:
    """Wait for every process; kill the whole group of any still running at the deadline."""
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
    return codes


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    # a tag of this test process's own: two xdist workers (gw0, gw1) never share namespace, veth or
    # subnet names
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    hosts = TwoHosts(str(10 + 2 * (os.getpid() % 40) + worker % 2))
    hosts.down()
    try:
        hosts.up()
    except subprocess.CalledProcessError as e:
        hosts.down()
        pytest.skip(f"network namespaces refused here: {e.stderr.strip()}")
    try:
        yield hosts
    finally:
        hosts.down()


def trainer_pids(tag: str) -> dict[int, int]:
    """{rank: pid} of the trainer processes (not the launchers, not their DataLoader workers:
    forked, with the trainer's command line and environment) started with ACCEL_TEST_TAG=tag."""
    found = {}  # pid -> (rank, parent pid)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
            parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        argv = cmd.split(b"\0")
        launcher = any(
            a.endswith((b"accelerate", b"torchrun", b"accelerate.commands.launch"))
            for a in argv[:3]
        )
        if f"ACCEL_TEST_TAG={tag}".encode() in env and b"-m\0accel_train" in cmd and not launcher:
            rank = next((int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")), 0)
            found[int(d.name)] = (rank, parent)
    return {rank: pid for pid, (rank, parent) in found.items() if parent not in found}


# ---------------------------------------------------------------------------------------------
# The fault harness: launch.sh started in the background, a wait for a step, a fault, the relaunch,
# the end.
# ---------------------------------------------------------------------------------------------


class Job:
    """launch.sh on this machine's `ranks` processes, its output in `log`, tagged (ACCEL_TEST_TAG)
    so that its ranks can be found; use as a context manager: the whole group is killed if the test
    leaves before the end.
    """

    def __init__(self, args: list, out: Path, log: Path, ranks: int = 2, env: dict | None = None):
        self.out, self.log, self.tag = Path(out), Path(log), uuid.uuid4().hex
        env = clean_env(
            NPROC_PER_NODE=str(ranks),
            ACCEL_TEST_TAG=self.tag,
            ACCEL_RESTART_DELAY="1",
            **(env or {}),
        )
        self.ranks = ranks
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                ["bash", ROOT / "launch.sh", *map(str, args), "--output_dir", str(out)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
                start_new_session=True,
            )

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def steps(self, n: int, timeout: float = 240) -> int:
        """Wait until the run has logged n steps (its steps.jsonl: --log_every 1); the count
        then."""
        wait_for(lambda: steps_logged(self.out) >= n, timeout=timeout, interval=0.01)
        return steps_logged(self.out)

    def pids(self, timeout: float = 30) -> dict[int, int]:
        """{rank: pid} of the attempt's ranks, once all of them are there."""
        return wait_for(
            lambda: len(trainer_pids(self.tag)) == self.ranks and trainer_pids(self.tag),
            timeout=timeout,
        )

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> int:
        pid = self.pids()[rank]
        os.kill(pid, sig)
        return pid

    @property
    def text(self) -> str:
        return self.log.read_text()

    def end(self, timeout: float = 300) -> int:
        """launch.sh's exit status (relaunches included)."""
        return self.proc.wait(timeout=timeout)


def steps_logged(out: Path) -> int:
    """Rows in a run's steps.jsonl so far (what a signal test waits on before it signals)."""
    path = Path(out) / "steps.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def processes(match) -> list:
    """The live processes for which match(psutil.Process) is true (one that ends or cannot be read
    meanwhile is none)."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        try:
            if match(proc):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout}s waiting for {getattr(predicate, '__name__', predicate)}"
    )


def check_best(out: Path) -> dict:
    """A finished run's model_best.safetensors: its metadata names the metrics rows' best epoch
    (highest test_acc, the first of equals), its weights are finite and are exactly that epoch's
    checkpoint's model weights (the trained model's, not the EMA's). Needs that epoch's checkpoint
    kept (--keep_checkpoints). Returns the row.
    """
    import torch
    from safetensors.torch import load_file

    from accel_train.files import BEST_FILE, EMA_FILE
    from accel_train.model.create import plain_state_dict
    from accel_train.training.exports import best_row, exported_best

    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    best = best_row(rows)
    assert best is not None and best == next(
        r for r in rows if r["test_acc"] == max(r["test_acc"] for r in rows)
    )
    assert exported_best(out) == {k: best[k] for k in ("epoch", "step", "test_acc")}, (
        exported_best(out),
        rows,
    )
    weights = load_file(Path(out) / BEST_FILE)
    bad = [k for k, v in weights.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    assert weights and not bad, f"non-finite weights in {BEST_FILE}: {bad[:5]}"
    ckpt = Path(out) / "checkpoints" / f"step_{best['step']:08d}"
    saved = plain_state_dict(load_file(ckpt / "model.safetensors"))
    assert weights.keys() == saved.keys(), (sorted(weights.keys() ^ saved.keys())[:5], ckpt)
    differ = [k for k in saved if not torch.equal(weights[k], saved[k])]
    assert not differ, f"{BEST_FILE} is not {ckpt.name}'s model weights: {differ[:5]}"
    if (ckpt / EMA_FILE).exists():
        ema = plain_state_dict(load_file(ckpt / EMA_FILE))
        assert any(
            not torch.equal(weights[k], ema[k])
            for k in ema
            if k in weights and weights[k].is_floating_point()
        )
    return best


# ---------------------------------------------------------------------------------------------
# The model the multi-process runs train
# ---------------------------------------------------------------------------------------------

# The model of the runs that prove the loop's logic (exact resume, equivalence, checkpoints), not
# the model: timm's own test ResNet (0.37M parameters, timm's stem), about 25x less compute per step
# than resnet18 with the cifar stem on 2 cores. Tests that rely on a step taking real time (a signal
# or kill landing mid-epoch) and those that check the resnet18 export keep resnet18.
TINY = ["--model", "test_resnet"]
# Group norm for runs compared across process counts (BatchNorm's statistics are per process); one
# group, as test_resnet's 16 channels do not split into timm's default 32
TINY_GN = [*TINY, "--model_kwargs", '{"norm_layer": "groupnorm1"}']


# ---------------------------------------------------------------------------------------------
# The reference registry: the uninterrupted runs that the "ends equal to the uninterrupted run"
# tests compare with, each distinct one (how it is launched, its processes, flags and environment)
# trained once per session, whichever test process asks first: the others wait for it on a lock in
# the session's common temporary folder, so the tests that share a reference need not share a test
# process. References are read-only: copy one to resume it.
# ---------------------------------------------------------------------------------------------


class References:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def get(
        self, how: str, ranks: int, args, env: dict | None = None, timeout: float = 400
    ) -> Path:
        """The output dir of `args` run to its end: how is an accelerate config
        (accelerate_configs/, through `launch`) or "launch.sh" (NPROC_PER_NODE=ranks); env:
        variables added to clean_env()'s."""
        key = json.dumps([how, ranks, [str(a) for a in args], sorted((env or {}).items())])
        folder = self.root / hashlib.sha1(key.encode()).hexdigest()[:16]
        with open(f"{folder}.lock", "w") as lock:
            deadline = time.monotonic() + timeout + 60
            while True:  # (bounded: a test never hangs)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, (
                        f"no reference after {timeout + 60} s: {key}"
                    )
                    time.sleep(0.2)
            if not (folder / "done").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                (folder / "key.json").write_text(key)
                out = folder / "out"
                if how == "launch.sh":
                    proc = run(
                        ["bash", ROOT / "launch.sh", *args, "--output_dir", out],
                        timeout,
                        clean_env(NPROC_PER_NODE=str(ranks), **(env or {})),
                        ROOT,
                    )
                    assert proc.returncode == 0, (
                        f"reference {key}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
                    )
                else:
                    assert ranks == (
                        yaml.safe_load((CONFIGS / how).read_text()).get("num_processes") or 1
                    ), key
                    launch(
                        how,
                        [*args, "--output_dir", out],
                        timeout,
                        env=clean_env(**env) if env else None,
                    )
                (folder / "done").touch()
        return folder / "out"


@pytest.fixture(scope="session")
def references(tmp_path_factory) -> References:
    # (under xdist, each test process's own; its parent is the session's)
    base = tmp_path_factory.getbasetemp()
    return References(
        (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    )


# The reference pair several tests compare with: TINY_GN (comparable across process counts), 256
# random samples, global batch 32 (8 steps an epoch), 3 epochs, a checkpoint every 2 steps; "full"
# runs to the end, "part" is the same run stopped at step 11 (3 steps into epoch 2: a resume
# finishes that epoch, then runs a whole fresh one). test_checkpoint resumes part on 1 and 2 ranks,
# test_resume the 2-rank part on 1 and 4, test_equivalence compares the two full runs.
def reference_flags(ranks: int) -> list:
    return [
        *TINY_GN,
        "--train_samples",
        "256",
        "--test_samples",
        "40",
        "--epochs",
        "3",
        "--batch_size",
        32 // ranks,
        "--log_every",
        "1",
        "--checkpoint_every",
        "2",
    ]


def reference_args(ranks: int, out, *extra) -> list:
    return [*reference_flags(ranks), "--output_dir", out, *extra]


def reference_pair(references: References, config: str, ranks: int) -> tuple[Path, Path]:
    return (
        references.get(config, ranks, reference_flags(ranks)),
        references.get(config, ranks, [*reference_flags(ranks), "--max_steps", "11"]),
    )


@pytest.fixture
def one_process_reference(references) -> tuple[Path, Path]:
    return reference_pair(references, "cpu.yaml", 1)


@pytest.fixture
def two_rank_reference(references) -> tuple[Path, Path]:
    return reference_pair(references, "2proc_cpu.yaml", 2)


# ---------------------------------------------------------------------------------------------
# Stages by cost. The README's command, `python -m pytest` with no test paths and no -m, runs the
# in-process tests and the `core` launches: one short multi-rank proof of each core promise. Every
# other test that starts real processes is in one stage, run by .ci/run after the README's command
# (`python -m pytest -m <stage>`; docs/tests.md lists them): `launches` (ranks for flags, pipelines,
# outputs, own models), `faults` (kills, signals, frozen and hung ranks, relaunches), `hosts` (two
# network hosts) and `campaign` (the fault campaign and its checker). Each of these is also `slow`:
# `-m "not slow"` is the in-process subset. Named paths or node ids run whole (what a developer or
# tools/mutate.py asks for is never deselected by cost).
# ---------------------------------------------------------------------------------------------

STAGES = ("core", "launches", "faults", "hosts", "campaign")


def stage_of(item) -> str | None:
    """The stage a test is marked with (None: an in-process test); a usage error where a test that
    starts real processes (marked slow, or a two-host job) has none or the wrong one, or where it
    has two (`-m` selects by any of a test's marks, its module's included: a test in two stages
    would run twice), so that every test runs in exactly one run of CI."""
    marked = sorted({mark.name for mark in item.iter_markers() if mark.name in STAGES})
    if (
        len(marked) > 1
        or ("two_hosts" in item.fixturenames and marked != ["hosts"])
        or (item.get_closest_marker("slow") and not marked)
    ):
        raise pytest.UsageError(
            f"{item.nodeid}: stages {marked}; a test that starts real processes is marked with "
            f"one of {', '.join(STAGES)} (a two-host job: hosts), its own or its module's"
        )
    return marked[0] if marked else None


# ---------------------------------------------------------------------------------------------
# Two test processes (pytest-xdist, `-n 2` in pyproject.toml). Most of a test's time is interpreters
# starting and one-threaded in-process runs, which leave a core idle; two workers fill both. Tests
# that share an expensive fixture of ours (a session or module fixture: a trained output; not the
# reference registry, which serves both workers) go to one worker, which builds it once
# (xdist_group), and the long tests start before the fast ones, so the run does not end on one long
# test: xdist's loadgroup sends the groups first (by their number of tests), then the two-host jobs
# (the longest), the other multi-process tests and the fast ones in that order.
# ---------------------------------------------------------------------------------------------


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    later = []
    for item in items:
        stage = stage_of(item)
        if stage:
            item.add_marker(pytest.mark.slow)
        if stage not in (None, "core"):
            later.append(item)
    if later and not config.option.markexpr and not config.option.file_or_dir:
        # the README's command
        config.hook.pytest_deselected(items=later)
        later = set(later)
        items[:] = [item for item in items if item not in later]
    parent: dict[str, str] = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        keys = [
            f"{d.baseid or 'conftest'}::{name}"
            for name, defs in (info.name2fixturedefs.items() if info else ())
            for d in defs[-1:]
            if d.scope in ("module", "session") and is_ours(d.func) and name != "references"
        ]
        for key in keys[1:]:
            parent[find(key)] = find(keys[0])
        shared[item] = keys
    for item, keys in shared.items():
        if keys:
            item.add_marker(
                pytest.mark.xdist_group(find(keys[0]).replace("::", ".").replace("/", "."))
            )
    # multi-process tests before the fast ones, two-host jobs first among them (a stable sort: file
    # order otherwise)
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            "two_hosts" not in item.fixturenames,
        )
    )


def is_ours(func) -> bool:
    code = getattr(func, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(ROOT / "tests")
