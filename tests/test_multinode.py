"""Two real network hosts (namespaces + veth), each running launch.sh as its platform would."""

import random
import re

import pytest

from conftest import ROOT, wait_all

pytestmark = pytest.mark.slow
TRAIN = ["--train_samples", "128", "--test_samples", "37", "--epochs", "1", "--batch_size", "16"]


def logs(paths):
    return [p.read_text() for p in paths]


def test_modelarts_job_on_two_hosts(two_hosts, tmp_path):
    port = random.randint(20000, 40000)
    procs, paths = [], []
    for node in (0, 1):
        env = two_hosts.env(node, MA_NUM_HOSTS="2", VC_TASK_INDEX=str(node), VC_WORKER_HOSTS=",".join(two_hosts.names),
                            MA_JOB_DIR=str(ROOT))
        # ModelArts appends --data_url=... --train_url=... and then --init_method/--rank/--world_size
        args = [ROOT / "launch.sh", *TRAIN, f"--train_url={tmp_path}/node{node}/outputs/train_url_0/",
                "--init_method", f"tcp://{two_hosts.names[0]}:{port}", "--rank", str(node), "--world_size", "2"]
        paths.append(tmp_path / f"node{node}.log")
        procs.append(two_hosts.popen(node, ["bash", *args], env, paths[-1]))
    codes = wait_all(procs, timeout=300)
    text = logs(paths)
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    assert "2 process(es) [DistributedType.MULTI_CPU" in text[0]
    assert f"rank 0 at {two_hosts.names[0]}:{port}" in text[1]
    writes = re.findall(r"rank \d+/\d+ wrote \S+", "\n".join(text))
    assert writes == [f"rank 0/2 wrote {tmp_path}/node0/outputs/train_url_0/model.safetensors"]
    assert (tmp_path / "node0/outputs/train_url_0/model.safetensors").is_file()
    assert not (tmp_path / "node1/outputs/train_url_0/model.safetensors").exists()
    assert "(37 samples)" in text[0]


def test_plain_variables_on_two_hosts_with_shared_output(two_hosts, tmp_path):
    out = tmp_path / "shared_out"
    procs, paths = two_hosts.launch_plain([*TRAIN, "--output_dir", out, "--log_all_ranks"], tmp_path)
    codes = wait_all(procs, timeout=300)
    text = logs(paths)
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    writes = re.findall(r"rank \d+/\d+ wrote", "\n".join(text))
    assert writes == ["rank 0/2 wrote"]
    assert (out / "model.safetensors").is_file() and len(list(out.glob("checkpoints/step_*"))) == 1
    assert sorted(p.name for p in next(out.glob("checkpoints/step_*")).glob("random_states_*")) == \
        ["random_states_0.pkl", "random_states_1.pkl"]


def test_smoke_check_on_two_hosts(two_hosts, tmp_path):
    # The documented smoke check of a two-machine setup: launch.sh --smoke-test on each machine, which runs
    # Accelerate's test script with that machine's rank and the rank-0 address, and checks the group size.
    procs, paths = two_hosts.launch_plain(["--smoke-test"], tmp_path)
    codes = wait_all(procs, timeout=300)
    text = logs(paths)
    assert codes == [0, 0], "\n\n".join(t[-3000:] for t in text)
    for node in (0, 1):
        assert re.findall(r"(?m)^Num processes: (\d+)$", text[node]) == ["2"]
        assert re.findall(r"(?m)^Process index: (\d+)$", text[node]) == [str(node)]
        assert (f"smoke: ok: 2node_cpu.yaml: 1 process(es) here (indices {node}..{node}) in one group of 2 over "
                "2 machine(s)") in text[node]
