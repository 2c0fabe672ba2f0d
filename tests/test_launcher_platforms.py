"""Each platform's detection (accel_train/launcher/platforms.py), in process: its real variable sets
in, the job's layout and the source of each value out (the sets the launch tests, docs/cluster.md
and the platforms' own sources name)."""

import pytest

from accel_train.launcher import LaunchError, platforms


def layout(env, **boot):
    got = platforms.detect(env, hostnames=lambda nodes: None, **boot)
    return (got.nnodes, got.node_rank, got.master_addr, got.master_port, got.nproc), got.sources


def test_nothing_set_is_one_machine():
    assert layout({}) == (("1", "0", "", "", ""), {"nnodes": "default", "node_rank": "default"})


def test_explicit_variables_win_over_every_platform():
    env = {
        "NNODES": "2",
        "NODE_RANK": "0",
        "MASTER_ADDR": "explicit",
        "MASTER_PORT": "1234",
        "NPROC_PER_NODE": "4",
        "MA_NUM_HOSTS": "4",
        "VC_TASK_INDEX": "3",
        "VC_WORKER_HOSTS": "w0,w1,w2,w3",
        "MA_NUM_GPUS": "8",
        "PET_NNODES": "3",
        "SLURM_NNODES": "5",
        "SLURM_NODEID": "4",
        "SLURM_JOB_NODELIST": "s[1-5]",
    }
    values, sources = layout(env)
    assert values == ("2", "0", "explicit", "1234", "4")
    assert sources == {
        "nnodes": "NNODES",
        "node_rank": "NODE_RANK",
        "master_addr": "MASTER_ADDR",
        "master_port": "MASTER_PORT",
        "nproc": "NPROC_PER_NODE",
    }


def test_modelarts_variables_and_boot_arguments():
    env = {
        "MA_NUM_HOSTS": "2",
        "VC_TASK_INDEX": "1",
        "MA_NUM_GPUS": "8",
        "VC_WORKER_HOSTS": "job-worker-0.job.svc,job-worker-1.job.svc",
    }
    values, sources = layout(
        env, init_method="tcp://job-worker-0.job.svc:6666", rank="1", world_size="2"
    )
    assert values == ("2", "1", "job-worker-0.job.svc", "6666", "8")
    assert sources["master_addr"] == "VC_WORKER_HOSTS" and sources["master_port"] == "--init_method"
    # the boot arguments alone (an older engine without the VC_ variables), IPv6 too
    values, sources = layout({}, init_method="tcp://[fe80::1]:7777/", rank="1", world_size="3")
    assert values == ("3", "1", "[fe80::1]", "7777", "")
    assert sources == {
        "nnodes": "--world_size",
        "node_rank": "--rank",
        "master_addr": "--init_method",
        "master_port": "--init_method",
    }
    assert layout({"VC_WORKER_NUM": "2", "VC_TASK_INDEX": "0"})[0][:2] == ("2", "0")
    # a CPU-only flavour: no devices, not 0 processes
    assert layout({"MA_NUM_GPUS": "0"})[0][4] == ""


@pytest.mark.parametrize("bad", ["tcp://host", "host:1234", "tcp://h:port", "udp://h:1"])
def test_a_bad_init_method_is_refused(bad):
    with pytest.raises(LaunchError, match="--init_method must look like tcp://HOST:PORT"):
        layout({}, init_method=bad)


def test_kubeflow():
    env = {
        "PET_NNODES": "3",
        "PET_NODE_RANK": "2",
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "PET_NPROC_PER_NODE": "4",
    }
    assert layout(env)[0] == ("3", "2", "job-master-0", "23456", "4")
    for word in ("auto", "gpu", "cpu"):  # the operator's words: resolved with the devices
        got = platforms.detect({**env, "PET_NPROC_PER_NODE": word}, hostnames=lambda n: None)
        assert got.nproc == "" and got.nproc_word == word


@pytest.mark.parametrize(
    "elastic",
    [
        {"PET_NNODES": "1:3"},
        {"PET_NNODES": "2", "PET_RDZV_BACKEND": "c10d"},
        {"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "h:1234"},
    ],
)
def test_an_elastic_pytorchjob_is_refused_unless_nnodes_is_explicit(elastic):
    with pytest.raises(LaunchError, match="elastic PyTorchJob .* remove the job's elasticPolicy"):
        layout(elastic)
    assert layout({**elastic, "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "h0"})[0][:3] == (
        "2",
        "1",
        "h0",
    )


def test_slurm_meets_on_the_steps_first_node():
    env = {
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NODELIST": "gpu[01-04]",
        "SLURM_STEP_NODELIST": "gpu[03-04]",
        "SLURM_NODELIST": "gpu[03-04]",
        "SLURM_GPUS_ON_NODE": "4",
    }
    values, sources = layout(env)
    assert (
        values == ("2", "1", "gpu03", "", "4") and sources["master_addr"] == "SLURM_STEP_NODELIST"
    )
    del env["SLURM_STEP_NODELIST"]
    assert layout(env)[0][2] == "gpu03"  # SLURM_NODELIST: the step's too
    del env["SLURM_NODELIST"]
    assert layout(env)[0][2] == "gpu01"  # outside srun: the job's
    assert layout({"SLURM_JOB_NODELIST": "a,b"})[0][2] == "a"
    assert layout({"SLURM_JOB_NODELIST": "node[7,9-10],other"})[0][2] == "node7"
    assert layout({"SLURM_GPUS_ON_NODE": "0"})[0][4] == ""  # a CPU job
    # scontrol, where there is one, expands the list itself
    got = platforms.detect(
        {"SLURM_JOB_NODELIST": "weird-list"}, hostnames=lambda nodes: f"first-of-{nodes}"
    )
    assert got.master_addr == "first-of-weird-list"


def test_the_ascend_preset_and_a_torchrun_worker_are_recognised():
    preset = {
        "RANK_TABLE_FILE": "/user/config/jobstart_hccl.json",
        "RANK_ID": "0",
        "ASCEND_DEVICE_ID": "0",
        "RANK_SIZE": "8",
    }
    assert platforms.ascend_per_card(preset)
    # a card chosen by hand, not the preset
    assert not platforms.ascend_per_card({"ASCEND_DEVICE_ID": "3"})
    assert platforms.torchrun_worker({"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2"})
    # (a platform's own RANK: no torchrun agent above)
    assert not platforms.torchrun_worker({"RANK": "0"})
