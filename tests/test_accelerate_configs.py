"""Every accelerate config loads with accelerate's own loader and passes its launch validation."""

import re

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from conftest import CONFIGS

ALL = sorted(p.name for p in CONFIGS.glob("*.yaml"))
# name: (distributed_type, machines, total processes, mixed precision; None: the config states none,
# which leaves it to the trainer's device check)
EXPECTED = {
    "cpu.yaml": ("NO", 1, 1, None),
    "2proc_cpu.yaml": ("MULTI_GPU", 1, 2, None),
    "2node_cpu.yaml": ("MULTI_GPU", 2, 2, None),
    "1node_gpu.yaml": ("MULTI_GPU", 1, 8, "bf16"),
    "2node_gpu.yaml": ("MULTI_GPU", 2, 16, "bf16"),
    "1node_npu.yaml": ("MULTI_NPU", 1, 8, "bf16"),
    "2node_npu.yaml": ("MULTI_NPU", 2, 16, "bf16"),
}


def test_the_expected_configs_exist():
    assert set(ALL) == set(EXPECTED)


@pytest.mark.parametrize("name", ALL)
def test_config_loads_and_validates(name):
    path = CONFIGS / name
    cfg = load_config_from_file(str(path))
    kind, machines, procs, precision = EXPECTED[name]
    assert str(cfg.distributed_type).split(".")[-1] == kind
    assert (cfg.num_machines, cfg.num_processes, cfg.mixed_precision) == (
        machines,
        procs,
        precision,
    )
    assert cfg.num_processes % cfg.num_machines == 0, "processes must split evenly over machines"
    assert kind != "MULTI_CPU", "MULTI_CPU starts one process without an MPI hostfile"
    if cfg.num_machines > 1:
        assert cfg.main_process_ip and cfg.main_process_port, (
            "multi-node configs carry placeholders"
        )
    text = path.read_text()
    assert text.lstrip().startswith("#"), "each config starts with a comment saying what it is for"
    assert not re.search(r":\s*(NO|no)\s*$", text, re.M), "unquoted NO/no is a YAML boolean"
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, defaults, _ = _validate_launch_command(args)  # starts nothing
    assert args.num_processes == procs and args.num_machines == machines
    assert bool(args.multi_gpu) == (kind in ("MULTI_GPU", "MULTI_NPU"))


def test_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((CONFIGS / "cpu.yaml").read_text() + "num_proceses: 2\n")
    with pytest.raises(ValueError, match="num_proceses"):
        load_config_from_file(str(bad))


# `ACCELERATE_USE_CPU=1 accelerate test --config_file <cfg>` on cpu.yaml and 2proc_cpu.yaml: the
# same launch of Accelerate's test script is
# tests/test_smoke.py::test_smoke_passes_when_every_rank_joined, which asserts everything this
# file's launched test did (exit 0 of the script = "Test is a success", the process indices, "Num
# processes" == the config's) and the group size on top.


def test_the_npu_configs_name_the_fact_launch_sh_chooses_bf16_by():
    """1node_npu.yaml says what launch.sh and the trainer ask: not torch.npu.is_bf16_supported() but
    the SoC name (hardware.py NPU_BF16, from torch.npu.get_device_name:
    Accelerate's answer is True on every NPU).
    """
    from accel_train.platform import hardware

    assert hardware.NPU_BF16.pattern and "get_device_name(0)" in open(hardware.__file__).read()
    for name in ALL:
        text = (CONFIGS / name).read_text()
        assert "is_bf16_supported" not in text, name
        if "MULTI_NPU" in text and "launch.sh switches" in text:
            assert "hardware.py NPU_BF16" in text and "get_device_name" in text, name
