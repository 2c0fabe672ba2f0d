"""Each platform's job layout from its environment: the number of machines, this machine's rank, the
rank-0 host and port, and a process count where the platform gives one. First match wins for each
value, in this order: explicit variables, ModelArts (its variables and boot arguments), Kubeflow's
PyTorchJob, SLURM, else one machine. Pure: an environment (a dict) and the boot arguments in, a
Layout out; the values stay text here, checked once they are combined with the devices
(launcher/__main__.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass, field

from . import LaunchError

INIT_METHOD = re.compile(r"tcp://([^:/]+|\[[0-9a-fA-F:]+\]):([0-9]+)/?")


@dataclass
class Layout:
    nnodes: str
    node_rank: str
    master_addr: str
    master_port: str
    nproc: str  # the processes per machine the platform gives ("" none)
    nproc_word: str = ""  # Kubeflow's auto | gpu | cpu, resolved once the devices are counted
    # each value's variable (or boot argument)
    sources: dict[str, str] = field(default_factory=dict)


def first_set(*candidates: tuple[str, str]) -> tuple[str, str]:
    """The first (source, value) whose value is not empty, else ("", "")."""
    return next(((source, value) for source, value in candidates if value), ("", ""))


def modelarts_init_method(text: str) -> tuple[str, str]:
    """--init_method tcp://HOST:PORT (a ModelArts boot argument) -> (host, port)."""
    if not text:
        return "", ""
    match = INIT_METHOD.fullmatch(text)
    if match is None:
        raise LaunchError(f"--init_method must look like tcp://HOST:PORT, got '{text}'")
    return match.group(1), match.group(2)


def scontrol_hostnames(nodelist: str) -> str | None:
    """SLURM's own expansion of a node list: its first host, or None without scontrol."""
    if shutil.which("scontrol") is None:
        return None
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True
    ).stdout
    return out.splitlines()[0] if out.strip() else ""


def slurm_first_host(env, hostnames=scontrol_hostnames) -> str:
    """Rank 0 is the first node of this job step, whose nodes SLURM_NNODES / SLURM_NODEID count.
    Under srun, SLURM_STEP_NODELIST (and SLURM_NODELIST) list the step's nodes, SLURM_JOB_NODELIST
    the whole allocation's: `srun -N2 -w gpu03,gpu04` inside gpu[01-04] meets on gpu03, not gpu01.
    Outside srun only the job's lists exist."""
    nodes = (
        env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_NODELIST")
        or env.get("SLURM_JOB_NODELIST")
        or ""
    )
    if not nodes:
        return ""
    first = hostnames(nodes)
    if first is not None:
        return first
    ranged = re.match(r"([^,\[]*)\[([0-9]+)", nodes)  # node[01-04,07],other -> node01
    return ranged.group(1) + ranged.group(2) if ranged else nodes.split(",")[0]


def check_not_elastic(env) -> None:
    """Kubeflow's elastic PyTorchJob (an elasticPolicy): PET_NNODES "MIN:MAX" (or the worker count),
    PET_RDZV_BACKEND (c10d), PET_RDZV_ENDPOINT, and no node rank: torchrun's c10d rendezvous would
    rank the pods (training-operator pkg/controller.v1/pytorch envvar.go, elastic.go,
    elastic_test.go). The launcher starts a fixed set of machines with a static rendezvous: refused,
    naming the form it runs, unless NNODES is given explicitly."""
    pet_nnodes = env.get("PET_NNODES", "")
    backend, endpoint = env.get("PET_RDZV_BACKEND", ""), env.get("PET_RDZV_ENDPOINT", "")
    if not env.get("NNODES") and (":" in pet_nnodes or backend or endpoint):
        raise LaunchError(
            f"an elastic PyTorchJob (PET_NNODES={pet_nnodes}, PET_RDZV_BACKEND={backend},"
            f" PET_RDZV_ENDPOINT={endpoint}) is not supported: launch.sh runs a fixed number of"
            " machines; remove the job's elasticPolicy and give it Master and Worker replicas (the"
            " operator then sets PET_NNODES=N, PET_NODE_RANK, MASTER_ADDR, MASTER_PORT)"
        )


def detect(
    env, init_method: str = "", rank: str = "", world_size: str = "", hostnames=scontrol_hostnames
) -> Layout:
    """The layout from the environment and the ModelArts boot arguments (--init_method, --rank,
    --world_size)."""
    get = env.get
    ma_host, ma_port = modelarts_init_method(init_method)
    vc_first_host = (get("VC_WORKER_HOSTS") or "").split(",")[0]
    nnodes = first_set(
        ("NNODES", get("NNODES")),
        ("MA_NUM_HOSTS", get("MA_NUM_HOSTS")),
        ("VC_WORKER_NUM", get("VC_WORKER_NUM")),
        ("--world_size", world_size),
        ("PET_NNODES", get("PET_NNODES")),
        ("SLURM_NNODES", get("SLURM_NNODES")),
        ("default", "1"),
    )
    node_rank = first_set(
        ("NODE_RANK", get("NODE_RANK")),
        ("VC_TASK_INDEX", get("VC_TASK_INDEX")),
        ("--rank", rank),
        ("PET_NODE_RANK", get("PET_NODE_RANK")),
        ("SLURM_NODEID", get("SLURM_NODEID")),
        ("default", "0"),
    )
    check_not_elastic(env)
    addr = first_set(
        ("MASTER_ADDR", get("MASTER_ADDR")),
        ("VC_WORKER_HOSTS", vc_first_host),
        ("--init_method", ma_host),
        ("SLURM_STEP_NODELIST", slurm_first_host(env, hostnames)),
    )
    port = first_set(("MASTER_PORT", get("MASTER_PORT")), ("--init_method", ma_port))
    # MA_NUM_GPUS=0 / SLURM_GPUS_ON_NODE=0 (CPU-only flavours, CPU jobs) say "no devices", not "0
    # processes".
    ma_gpus = "" if get("MA_NUM_GPUS") == "0" else get("MA_NUM_GPUS") or ""
    slurm_gpus = "" if get("SLURM_GPUS_ON_NODE") == "0" else get("SLURM_GPUS_ON_NODE") or ""
    # Kubeflow's training operator always writes PET_NPROC_PER_NODE: nprocPerNode, or "auto" when
    # the job leaves it unset (training-operator pytorch_defaults.go DefaultNprocPerNode,
    # envvar.go); "gpu" and "cpu" are allowed too. torchrun reads these words itself; here they are
    # resolved once the devices are counted.
    pet_nproc, word = get("PET_NPROC_PER_NODE") or "", ""
    if pet_nproc in ("auto", "gpu", "cpu"):
        pet_nproc, word = "", pet_nproc
    nproc = first_set(
        ("NPROC_PER_NODE", get("NPROC_PER_NODE")),
        ("MA_NUM_GPUS", ma_gpus),
        ("PET_NPROC_PER_NODE", pet_nproc),
        ("SLURM_GPUS_ON_NODE", slurm_gpus),
    )
    values = {
        "nnodes": nnodes,
        "node_rank": node_rank,
        "master_addr": addr,
        "master_port": port,
        "nproc": nproc,
    }
    return Layout(
        **{k: v for k, (_, v) in values.items()},
        nproc_word=word,
        sources={k: s for k, (s, v) in values.items() if v},
    )


def ascend_per_card(env) -> bool:
    """ModelArts' Ascend-Powered-Engine preset (rank-table mode) runs the boot file once per card,
    with ASCEND_DEVICE_ID, RANK_ID, RANK_SIZE and RANK_TABLE_FILE set; its documentation: "check the
    ASCEND_DEVICE_ID value. If it is 0, execute the logic; otherwise, exit directly" (ModelArts user
    guide, "Starting a Preset Image's Boot File"). Device 0's copy starts one process per card of
    this node; the other copies exit 0."""
    return bool(env.get("ASCEND_DEVICE_ID") and env.get("RANK_SIZE") and env.get("RANK_TABLE_FILE"))


def torchrun_worker(env) -> bool:
    """Started as a worker by torchrun (its agent sets TORCHELASTIC_RUN_ID and RANK in every worker,
    e.g. ModelArts' preset with MA_RUN_METHOD=torchrun): the rank exists already; a launcher of its
    own would start a one-process job that inherits torchrun's RANK and WORLD_SIZE."""
    return "TORCHELASTIC_RUN_ID" in env and "RANK" in env
