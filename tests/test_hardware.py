"""The precision and memory format each device really has (accel_train/platform/hardware.py), chosen
by the trainer and by launch.sh. Every capability is mocked: CUDA compute capability, Ascend SoC
name, CPU flags.
"""

import json
import sys
import types

import pytest
from conftest import CONFIGS, ROOT, clean_env, launch, run_cli
from test_launch import (
    BF16_CPU,
    PLAIN_CPU,
    dry_run,
    hw,  # noqa: F401 (the fake nvidia-smi / npu-smi fixture)
    parse,
)

from accel_train.config.train_config import TrainConfig
from accel_train.platform import hardware
from accel_train.platform.hardware import DeviceFacts, choose_precision, cpu_info, launcher_choice


def cpu(*flags, arch="x86_64"):
    return DeviceFacts("cpu", "test CPU", cpu_flags=frozenset(flags), arch=arch)


def gpu(cc, name="GPU"):
    return DeviceFacts("cuda", name, cc)


def npu(soc):
    return DeviceFacts("npu", soc)


@pytest.mark.parametrize(
    "facts,best",
    [
        (gpu((7, 0), "Tesla V100-SXM2-32GB"), "fp16"),  # no bf16 convolutions in cuDNN below 8.0
        (gpu((7, 5), "Tesla T4"), "fp16"),
        (gpu((6, 1)), "fp16"),
        (gpu((8, 0), "NVIDIA A100"), "bf16"),
        (gpu((8, 6)), "bf16"),
        (gpu((9, 0), "NVIDIA H100"), "bf16"),
        (npu("Ascend910A"), "fp16"),  # 910A family: no bf16 (HCCL: bf16 only on A2/A3)
        (npu("Ascend910ProA"), "fp16"),
        (npu("Ascend910ProB"), "fp16"),
        (npu("Ascend910PremiumA"), "fp16"),
        (npu("Ascend910B"), "fp16"),  # the bare name is a 910A-generation SoC (SocVersion 104)
        (npu("Ascend310P3"), "fp16"),
        (npu("Ascend910B1"), "bf16"),  # A2
        (npu("Ascend910B3"), "bf16"),
        (npu("Ascend910B4_1"), "bf16"),
        (npu("Ascend910_9391"), "bf16"),  # A3
        (cpu("avx2", "fma"), "no"),  # pytorch#146508: bf16 autocast 44-499x slower
        # AVX-512 without bf16: oneDNN emulates it (slow)
        (
            cpu("avx512f", "avx512bw", "avx512vl"),
            "no",
        ),
        (cpu("avx512f", "avx512_bf16"), "bf16"),
        (cpu("avx512f", "amx_bf16", "amx_tile"), "bf16"),
        (cpu("bf16"), "no"),  # not an x86 flag
        (cpu("fp", "asimd", "sve", "bf16", arch="aarch64"), "bf16"),  # Neoverse V1/N2, Graviton3
        (cpu("fp", "asimd", arch="aarch64"), "no"),  # Graviton2, Neoverse N1
        (DeviceFacts("mps"), "no"),
    ],
)
def test_nothing_asked_gets_the_best_the_device_has(facts, best):
    choice = choose_precision(facts, None)
    assert choice.precision == best and choice.error is None
    assert choice.reason.startswith(f"precision {hardware.NAMES[best]}: ")


@pytest.mark.parametrize(
    "facts,asked,fix,fact",
    [
        (gpu((7, 0), "Tesla V100"), "bf16", "fp16", "compute capability 7.0 < 8.0"),
        (npu("Ascend910A"), "bf16", "fp16", "Ascend910A has no bf16"),
        (cpu("avx2"), "bf16", "no", "no native bf16"),
        (cpu("avx512_bf16"), "fp16", "bf16", "fp16 on a CPU runs fp32"),
    ],
)
def test_a_precision_the_device_lacks_is_one_line_naming_what_to_use(facts, asked, fix, fact):
    source = f"the accelerate config's mixed_precision: '{asked}'"
    choice = choose_precision(facts, asked, source)
    assert choice.error and "\n" not in choice.error
    assert choice.error.startswith(f"{source} asks for {asked}") and fact in choice.error
    assert (
        f"--mixed_precision {fix}" in choice.error and f"mixed_precision: '{fix}'" in choice.error
    )
    assert "--force_precision" in choice.error
    forced = choose_precision(facts, asked, source, force=True)
    assert (
        forced.error is None and forced.precision == asked and "--force_precision" in forced.reason
    )


def test_what_the_device_has_is_kept_and_the_other_is_named_without_a_speed_claim():
    kept = choose_precision(
        cpu("avx512_bf16"), "no", "the accelerate config's mixed_precision: 'no'"
    )
    assert kept.precision == "no" and kept.error is None
    assert "--mixed_precision bf16 to use it" in kept.reason and "avx512_bf16" in kept.reason
    # no speed claimed that the run did not measure, no launch.sh advice (said
    # under launch.sh too)
    assert "bf16 is faster" not in kept.reason and "launch.sh" not in kept.reason
    fp16 = choose_precision(gpu((8, 0)), "fp16", "--mixed_precision fp16")
    assert fp16.precision == "fp16" and fp16.error is None
    plain = choose_precision(cpu("avx2"), "no", "x")
    assert plain.precision == "no" and "faster" not in plain.reason


def test_launcher_choice_best_for_our_configs_kept_for_named_ones():
    assert launcher_choice(cpu("avx512_bf16"), "no", keep=False)[0] == "bf16"
    # a by-hand config keeps it
    assert launcher_choice(cpu("avx512_bf16"), "no", keep=True)[0] == "no"
    # ... unless the device lacks it
    assert launcher_choice(cpu("avx2"), "bf16", keep=True)[0] == "no"
    assert launcher_choice(npu("Ascend910A"), "bf16", keep=True)[0] == "fp16"
    assert launcher_choice(gpu((7, 5)), "bf16", keep=False)[0] == "fp16"
    assert launcher_choice(gpu((8, 0)), "bf16", keep=False)[0] == "bf16"


def test_launcher_choice_a_named_config_that_states_no_precision_gets_the_best():
    # (2proc_cpu.yaml, named)
    precision, reason = launcher_choice(cpu("avx512_bf16"), "", keep=True)
    assert precision == "bf16" and "the config states no mixed_precision" in reason
    precision, reason = launcher_choice(cpu("avx512_bf16"), "no", keep=True)
    assert precision == "no" and "as the config's mixed_precision: 'no' asks" in reason


X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
ARM = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics sve bf16 i8mm
CPU implementer\t: 0x41
"""


def test_cpu_flags_are_read_from_proc_cpuinfo_text(tmp_path, monkeypatch):
    # (conftest pins them for every other test)
    monkeypatch.delenv("ACCEL_TRAIN_DEVICE_FACTS", raising=False)
    (tmp_path / "x86").write_text(X86)
    (tmp_path / "arm").write_text(ARM)
    name, flags = cpu_info(tmp_path / "x86")
    assert name == "Intel(R) Xeon(R) Platinum 8480+" and {"avx512_bf16", "amx_bf16"} <= flags
    _, flags = cpu_info(tmp_path / "arm")
    assert "bf16" in flags and "sve" in flags
    assert cpu_info(tmp_path / "missing") == ("", frozenset())
    facts = hardware.device_facts(cpu=True, cpuinfo=str(tmp_path / "x86"))
    assert facts.kind == "cpu" and choose_precision(facts, None).precision == "bf16"


def test_cuda_facts_take_the_lowest_capability_of_the_visible_gpus(monkeypatch):
    import accelerate.utils
    import torch

    monkeypatch.delenv("ACCEL_TRAIN_DEVICE_FACTS", raising=False)
    monkeypatch.setattr(accelerate.utils, "is_npu_available", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: [(8, 0), (7, 0)][i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "mixed box")
    facts = hardware.device_facts(cpu=False)
    assert facts == DeviceFacts("cuda", "mixed box", (7, 0))
    assert choose_precision(facts, None).precision == "fp16"


def test_npu_facts_are_the_soc_name(monkeypatch):
    import accelerate.utils
    import torch

    monkeypatch.delenv("ACCEL_TRAIN_DEVICE_FACTS", raising=False)
    monkeypatch.setattr(accelerate.utils, "is_npu_available", lambda *a, **k: True)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(
        torch, "npu", types.SimpleNamespace(get_device_name=lambda i=0: "Ascend910A"), raising=False
    )
    facts = hardware.device_facts(cpu=False)
    assert facts == DeviceFacts("npu", "Ascend910A")
    assert choose_precision(facts, None).precision == "fp16"


def test_channels_last_by_default_where_measured_faster_and_off_on_npu():
    assert TrainConfig().channels_last is None  # auto
    assert hardware.channels_last_default("cpu")[0] and hardware.channels_last_default("cuda")[0]
    on_npu, why = hardware.channels_last_default("npu")
    assert not on_npu and "--channels_last" in why


def test_compile_on_npu_without_an_inductor_backend_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch_npu._inductor" else real(name, *a),
    )
    problem = hardware.compile_problem("npu")
    assert problem.startswith("--compile: ") and "drop --compile" in problem and "\n" not in problem
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: object() if name == "torch_npu._inductor" else real(name, *a),
    )
    assert hardware.compile_problem("npu") is None
    assert hardware.compile_problem("cpu") is None and hardware.compile_problem("cuda") is None


def test_asked_precision_flag_then_launcher_then_nothing():
    from accel_train.platform.accelerator import asked_precision

    assert asked_precision("fp16", {"ACCELERATE_MIXED_PRECISION": "bf16"}) == (
        "fp16",
        "--mixed_precision fp16",
    )
    asked, source = asked_precision("auto", {"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert asked == "bf16" and "accelerate config" in source
    asked, source = asked_precision("auto", {})
    assert (
        asked is None and "neither --mixed_precision nor a launcher's config states one" in source
    )


def test_a_launch_config_without_mixed_precision_leaves_it_to_the_device(tmp_path):
    """accelerate launch passes ACCELERATE_MIXED_PRECISION=no for a config that states no
    mixed_precision too (our CPU configs): its command line and config file tell the two apart."""
    from accel_train.platform.accelerator import asked_precision, launch_options

    launched = {"ACCELERATE_MIXED_PRECISION": "no"}
    ours = ["--config_file", "accelerate_configs/2proc_cpu.yaml"]
    asked, source = asked_precision("auto", launched, launch=(ours, ROOT))
    assert (
        asked is None
        and source
        == "the accelerate config accelerate_configs/2proc_cpu.yaml states no mixed_precision"
    )
    choice = choose_precision(cpu("avx512_bf16"), asked, source)
    assert choice.precision == "bf16" and choice.reason.endswith(
        "; the device's fastest: " + source
    )
    stated = tmp_path / "fp32.yaml"
    stated.write_text((ROOT / ours[1]).read_text() + "mixed_precision: 'no'\n")
    assert (
        asked_precision("auto", launched, launch=(["--config_file", str(stated)], ROOT))[0] == "no"
    )
    assert (
        asked_precision("auto", launched, launch=([*ours, "--mixed_precision", "no"], ROOT))[0]
        == "no"
    )
    assert asked_precision("auto", launched, launch=([f"--config_file={stated}"], ROOT))[0] == "no"
    assert (
        asked_precision(
            "auto", {**launched, "ACCELERATE_MIXED_PRECISION": "bf16"}, launch=(ours, ROOT)
        )[0]
        == "bf16"
    )
    # the launcher's own options, up to its -m: the trainer's --mixed_precision is not accelerate's
    cmd = (
        b"/venv/bin/python\0/venv/bin/accelerate\0launch\0--config_file\0c.yaml\0-m\0accel_train\0"
        b"--mixed_precision\0no"
    )
    assert launch_options(cmd) == ["--config_file", "c.yaml"]
    assert launch_options(
        b"python\0-m\0accelerate.commands.launch\0--num_processes=2\0train.py\0--x"
    ) == ["--num_processes=2"]
    # no launcher: a 'no' is taken as asked
    assert launch_options(b"python\0-m\0pytest\0-k\0launch") is None


# ---- the trainer, one process without a launcher (python -m accel_train) -------------------------

TINY = [
    "--train_samples",
    "16",
    "--test_samples",
    "8",
    "--batch_size",
    "8",
    "--epochs",
    "1",
    "--max_steps",
    "1",
]


@pytest.mark.launches
def test_without_a_launcher_a_bf16_cpu_trains_bf16_channels_last(tmp_path):
    proc = run_cli(
        [*TINY, "--output_dir", tmp_path / "out", "--plot", "false"],
        env=clean_env(ACCEL_TRAIN_DEVICE_FACTS=BF16_CPU),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precision bf16: this CPU (mocked) has native bf16 (avx512_bf16)" in proc.stderr
    assert (
        "memory format channels_last" in proc.stderr and "[DistributedType.NO, bf16]" in proc.stderr
    )


@pytest.mark.parametrize(
    "env,args,fragment",
    [
        # a launcher's config asks for bf16 on a CPU without it
        (
            {"ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU, "ACCELERATE_MIXED_PRECISION": "bf16"},
            [],
            (
                "the accelerate config's mixed_precision: 'bf16' asks for bf16, but this CPU"
                " (mocked) has no native bf16"
            ),
        ),
        # the flag asks for bf16 on a 910A
        (
            {"ACCEL_TRAIN_DEVICE_FACTS": json.dumps({"kind": "npu", "name": "Ascend910A"})},
            ["--mixed_precision", "bf16"],
            "--mixed_precision bf16 asks for bf16, but Ascend910A has no bf16",
        ),
        # --compile on an NPU whose torch_npu has no Inductor backend
        (
            {"ACCEL_TRAIN_DEVICE_FACTS": json.dumps({"kind": "npu", "name": "Ascend910B3"})},
            ["--compile"],
            "--compile: this torch_npu has no Inductor backend for NPUs",
        ),
    ],
)
def test_refused_before_anything_is_written(tmp_path, env, args, fragment):
    out = tmp_path / "out"
    proc = run_cli([*TINY, "--output_dir", out, *args], env=clean_env(**env))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line.lower()]
    assert (
        len(errors) == 1 and errors[0].startswith("accel-train: error: ") and fragment in errors[0]
    ), proc.stderr
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()


# ---- launch.sh: the precision it passes to accelerate launch (--dry-run, facts mocked) -----------


def precision_of(proc):
    _, opts, trainer = parse(proc)
    return opts.get("--mixed_precision"), opts["config"], proc.stderr


def test_launch_sh_on_a_bf16_cpu_passes_bf16():
    precision, config, err = precision_of(dry_run({"ACCEL_TRAIN_DEVICE_FACTS": BF16_CPU}))
    assert (precision, config) == ("bf16", "cpu.yaml") and "launch.sh: precision bf16: " in err


def test_launch_sh_on_a_plain_cpu_keeps_fp32_and_says_why():
    precision, config, err = precision_of(dry_run({"ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU}))
    assert precision is None and config == "cpu.yaml" and "launch.sh: precision fp32: " in err


@pytest.mark.parametrize("cc,expected", [([7, 0], "fp16"), ([7, 5], "fp16"), ([8, 0], None)])
def test_launch_sh_on_gpus_fp16_below_ampere(hw, cc, expected):
    facts = json.dumps({"kind": "cuda", "name": "mocked GPU", "capability": cc})
    precision, config, _ = precision_of(
        dry_run({"ACCEL_TRAIN_DEVICE_FACTS": facts}, bindir=hw(gpus=4))
    )
    assert (precision, config) == (expected, "1node_gpu.yaml")  # the config's bf16 stays on Ampere+


@pytest.mark.parametrize(
    "soc,expected", [("Ascend910A", "fp16"), ("Ascend910ProB", "fp16"), ("Ascend910B3", None)]
)
def test_launch_sh_on_ascend_fp16_on_910a(hw, soc, expected):
    facts = json.dumps({"kind": "npu", "name": soc})
    precision, config, _ = precision_of(
        dry_run({"ACCEL_TRAIN_DEVICE_FACTS": facts}, bindir=hw(npus=8))
    )
    assert (precision, config) == (expected, "1node_npu.yaml")


def test_launch_sh_keeps_a_named_config_and_the_trainer_flag(tmp_path):
    config = tmp_path / "mine.yaml"
    ours = (ROOT / "accelerate_configs" / "cpu.yaml").read_text()
    config.write_text(ours + "mixed_precision: 'no'\n")
    precision, _, _ = precision_of(
        dry_run({"ACCEL_TRAIN_DEVICE_FACTS": BF16_CPU}, ["--accel_config", str(config)])
    )
    assert precision is None  # a by-hand 'no' stays (the trainer's log names the faster mode)
    config.write_text(ours + "mixed_precision: 'bf16'\n")
    precision, _, err = precision_of(
        dry_run({"ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU}, ["--accel_config", str(config)])
    )
    assert precision == "no" and "not the config's bf16" in err
    precision, _, _ = precision_of(
        dry_run(
            {"ACCEL_TRAIN_DEVICE_FACTS": PLAIN_CPU},
            ["--accel_config", str(config), "--force_precision"],
        )
    )
    assert precision is None  # the trainer runs the config's bf16 anyway, as asked
    _, opts, trainer = parse(
        dry_run({"ACCEL_TRAIN_DEVICE_FACTS": BF16_CPU}, ["--mixed_precision", "no"])
    )
    assert "--mixed_precision" not in opts and trainer[-2:] == ["--mixed_precision", "no"]


@pytest.mark.parametrize("name", ["2proc_cpu", "cpu"])
def test_launch_sh_a_named_cpu_config_leaves_the_precision_to_the_device(name):
    """Our CPU configs state no mixed_precision: named with --accel_config they train as launch.sh's
    own pick does (before, `--accel_config 2proc_cpu` kept fp32 'as the config asks' on a CPU with
    native bf16).
    """
    proc = dry_run({"ACCEL_TRAIN_DEVICE_FACTS": BF16_CPU}, ["--accel_config", name])
    env, _, _ = parse(proc)
    precision, config, err = precision_of(proc)
    assert (precision, config) == ("bf16", f"{name}.yaml"), err
    assert "launch.sh: precision bf16: " in err and "the config states no mixed_precision" in err
    # nothing asked: the start-up check may fall back to fp32
    assert env["ACCEL_TRAIN_AUTO_PRECISION"] == "bf16"


@pytest.mark.launches
def test_accelerate_launch_of_2proc_cpu_trains_the_devices_best(tmp_path):
    """The README's multi-process command on a CPU with native bf16 trains bf16, as `python -m
    accel_train` does (before: fp32 'as the config asks', though the config states no precision);
    the start line names the rule.
    """
    proc = launch(
        "2proc_cpu.yaml",
        [*TINY, "--output_dir", tmp_path / "out", "--plot", "false"],
        env=clean_env(ACCEL_TRAIN_DEVICE_FACTS=BF16_CPU),
        timeout=300,
    )
    rule = (
        f"the device's fastest: the accelerate config {CONFIGS / '2proc_cpu.yaml'} states no"
        " mixed_precision"
    )
    lines = [
        ln
        for ln in proc.stderr.splitlines()
        if "precision bf16: this CPU (mocked) has native bf16" in ln
    ]
    assert len(lines) == 1 and rule in lines[0], proc.stderr[-3000:]
    assert ", bf16] on 1 machine" in proc.stderr, proc.stderr[-3000:]


# the accel-train script (pyproject)
@pytest.mark.parametrize(
    "entry",
    [
        "runpy.run_module('accel_train', run_name='__main__')",  # python -m accel_train
        "from accel_train.cli import main; main()",
    ],
)
def test_the_trainer_turns_on_torchs_huge_pages_before_torch_is_imported_unless_set(entry):
    """c10/core/impl/alloc_cpu.cpp reads THP_MEM_ALLOC_ENABLE once, at the first CPU allocation:
    cli.main sets it (unless the user did) before anything imports torch (`import accel_train`
    imports nothing heavy), whichever entry point runs it (before, the `accel-train` script, which
    calls cli.main without __main__, did not set it).
    """
    import subprocess

    probe = (
        "import os, runpy, sys; sys.argv = ['accel_train', '--help']; import accel_train.cli; "
        "assert 'torch' not in sys.modules, 'torch imported before cli.main'; out = sys.stdout; "
        "sys.stdout = open(os.devnull, 'w')\n"
        f"try: {entry}\n"
        "except SystemExit: pass\n"
        "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), file=out)"
    )
    for preset, expected in ((None, "1"), ("0", "0")):
        env = {k: v for k, v in clean_env().items() if k != "THP_MEM_ALLOC_ENABLE"}
        if preset is not None:
            env["THP_MEM_ALLOC_ENABLE"] = preset
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
        )
        assert done.returncode == 0 and done.stdout.strip() == expected, done.stderr[-2000:]
