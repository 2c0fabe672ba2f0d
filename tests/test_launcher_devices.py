"""Device counting (accel_train/launcher/devices.py), in process, with the tools' outputs mocked:
nvidia-smi (its GPUs, its failure, MIG instances), CUDA's own count, npu-smi, the visible-device
lists, the Ascend preset's RANK_SIZE."""

import pytest

from accel_train.launcher import LaunchError, devices

H100 = "\n".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})" for i in range(4))
MIG = (
    "GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-0)\n  MIG 3g.20gb     Device  0: (UUID: MIG-a)\n"
    "  MIG 2g.10gb     Device  1: (UUID: MIG-b)\n  MIG 1g.5gb      Device  2: (UUID: MIG-c)\n"
)


@pytest.fixture
def tools(monkeypatch):
    """A machine whose tools answer as given: {tool: (status, output)}; absent tools are not on
    PATH."""
    answers = {}
    monkeypatch.setattr(
        devices.shutil, "which", lambda name, path=None: name if name in answers else None
    )

    def run_tool(cmd, env, merge_stderr=False):
        name = "cuda" if cmd[1:2] == ["-c"] else cmd[0]
        return answers.get(name, (127, ""))

    monkeypatch.setattr(devices, "run_tool", run_tool)
    return answers


def count(tools_answers, env=None):
    said = []
    return devices.count_nvidia("python3", env or {}, said.append), said


def test_nvidia_smi_gpus(tools):
    tools["nvidia-smi"] = (0, H100 + "\n")
    assert count(tools) == (4, [])


def test_without_nvidia_smi_cuda_counts(tools):
    tools["cuda"] = (0, "2\n")
    assert count(tools) == (2, [])
    tools["cuda"] = (1, "Traceback ...")  # (a torch that cannot start: no GPU)
    assert count(tools) == (0, [])


def test_a_failing_nvidia_smi_is_said_and_cuda_counts(tools):
    tools["nvidia-smi"] = (
        9,
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
    )
    tools["cuda"] = (0, "2\n")
    assert count(tools) == (
        2,
        [
            "launch.sh: warning: nvidia-smi fails (NVIDIA-SMI has failed because it couldn't "
            "communicate with the NVIDIA driver.): counting the 2 GPU(s) CUDA shows"
        ],
    )
    tools["cuda"] = (0, "0\n")
    assert count(tools)[1][0].endswith("CUDA shows no GPU either: a CPU job")
    tools["nvidia-smi"] = (124, "")  # hung past ACCEL_PROBE_TIMEOUT
    assert "nvidia-smi fails (no output)" in count(tools)[1][0]


def test_mig_instances_are_counted_as_cuda_shows_them(tools):
    tools["nvidia-smi"], tools["cuda"] = (0, MIG), (0, "1\n")
    assert count(tools) == (
        1,
        [
            "launch.sh: MIG instances here (3 listed by nvidia-smi -L): CUDA shows a process "
            "one of them: 1 GPU(s) counted"
        ],
    )
    tools["cuda"] = (124, "")  # CUDA's count did not come: one instance, as CUDA shows a process
    assert count(tools)[0] == 1


def test_npu_smi(tools):
    tools["npu-smi"] = (0, "\tTotal Count                    : 8\n\n\tNPU ID : 0\n")
    assert devices.count_npu({}) == "8"
    del tools["npu-smi"]
    assert devices.count_npu({}) == ""


@pytest.mark.parametrize(
    "listed,n",
    [
        ("0,1", 2),
        ("", 0),
        ("-1", 0),
        ("0,1,-1,3", 2),
        (" 0, 1 ", 2),
        ("GPU-8e6f1c2a-0000-0000-0000-000000000001,MIG-3", 2),
        ("0,,1", 1),
    ],
)
def test_a_visible_list_stops_at_its_first_invalid_entry(listed, n):
    assert devices.visible({"CUDA_VISIBLE_DEVICES": listed}, "CUDA_VISIBLE_DEVICES") == n
    assert devices.visible({}, "CUDA_VISIBLE_DEVICES") is None
    assert devices.limit(8, n) == n and devices.limit(1, None) == 1 and devices.limit("", 2) == 0


def test_the_ascend_preset_counts_rank_size_over_the_machines():
    assert (
        devices.ascend_cards_per_node("16", "2") == 8
        and devices.ascend_cards_per_node("8", "x") == 8
    )
    with pytest.raises(
        LaunchError, match="RANK_SIZE=12 cards cannot be split evenly over 8 machines"
    ):
        devices.ascend_cards_per_node("12", "8")
    with pytest.raises(LaunchError, match="RANK_SIZE must be a positive integer, got '0'"):
        devices.ascend_cards_per_node("0", "1")


def test_a_probe_is_bounded_by_accel_probe_timeout(tmp_path):
    hang = tmp_path / "hang"
    hang.write_text("#!/bin/sh\nexec sleep 60\n")
    hang.chmod(0o755)
    assert devices.run_tool([str(hang)], {"ACCEL_PROBE_TIMEOUT": "0.5"}) == (124, "")
    assert devices.run_tool([str(tmp_path / "none")], {})[0] == 127
    with pytest.raises(LaunchError, match="ACCEL_PROBE_TIMEOUT must be a number"):
        devices.probe_timeout({"ACCEL_PROBE_TIMEOUT": "soon"})
