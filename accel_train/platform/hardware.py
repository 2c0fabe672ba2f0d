"""What the device really has: the precision and memory format a run gets, and why.

`device_facts()` reads the hardware (torch, torch_npu, /proc/cpuinfo); everything else here is a
pure function of those facts, so that tests can mock any device. Sources of each fact
(docs/speed.md: Precision and memory format per platform):

- NVIDIA below compute capability 8.0 (V100 7.0, T4 7.5) has no bf16 convolutions in cuDNN, while
  `torch.cuda.is_bf16_supported()` counts emulation and says True: the capability decides here.
- Ascend: bf16 exists on the A2/A3 series only (SoC names Ascend910B1..B4, Ascend910_93xx; HCCL
  lists bf16 all-reduce only for them); the 910A family (Ascend910A/ProA/ProB/PremiumA and the bare
  "Ascend910B", which is a 910A-generation SoC, torch_npu's SocVersion < 220) and the 310P have
  none. Accelerate's `is_bf16_available()` answers True on every NPU (and on every CPU).
- x86 CPUs without `avx512_bf16` or AMX (`amx_bf16`) run bf16 autocast far slower than fp32
  (pytorch#146508: 44-499x on AVX2-only CPUs; ~5x measured on an AVX-512 Xeon without avx512_bf16,
  bench/RESULTS.md), though `torch.ops.mkldnn._is_mkldnn_bf16_supported()` says True on any AVX-512
  CPU. aarch64: the `bf16` feature in /proc/cpuinfo (Neoverse V1/N2, Graviton3+) is what PyTorch's
  own oneDNN check (`cpuinfo_has_arm_bf16`) uses.
- fp16 on a CPU runs fp32 under Accelerate (no gain; DESIGN.md).
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass, field

PRECISIONS = ("no", "fp16", "bf16")
NAMES = {"no": "fp32", "fp16": "fp16 (with loss scaling)", "bf16": "bf16"}
# Ascend SoCs with bf16: the A2 (910B1..B4) and A3 (910_93xx, 910C) series and later (910_95 / 950)
NPU_BF16 = re.compile(r"^Ascend(910B\d|910_9\d|910C\d|950)")
CPU_BF16_X86 = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class DeviceFacts:
    kind: str  # "cpu", "cuda", "npu", or another torch device type
    name: str = ""  # GPU name, NPU SoC name, CPU model
    capability: tuple[int, int] | None = None  # CUDA: the visible GPUs' lowest compute capability
    # x86 'flags' / aarch64 'Features' of /proc/cpuinfo
    cpu_flags: frozenset = field(default_factory=frozenset)
    arch: str = ""  # platform.machine()

    def bf16(self) -> tuple[bool, str]:
        """(native bf16?, the fact that says so)"""
        if self.kind == "cuda":
            if self.capability is None:
                return False, f"{self.name or 'this GPU'}: compute capability unknown"
            ok = self.capability >= (8, 0)
            cc = "{}.{}".format(*self.capability)
            return ok, (
                f"{self.name or 'GPU'} (compute capability {cc}) has bf16 tensor cores"
                if ok
                else (
                    f"{self.name or 'GPU'} (compute capability {cc} < 8.0) has no bf16 "
                    "convolutions in cuDNN"
                )
            )
        if self.kind == "npu":
            ok = bool(NPU_BF16.match(self.name))
            return ok, (
                f"{self.name} (Ascend A2/A3 series) has bf16"
                if ok
                else (
                    f"{self.name or 'this NPU'} has no bf16 (the Ascend A2/A3 series, "
                    "910B1-B4/910_93xx, has it)"
                )
            )
        if self.kind == "cpu":
            arm = self.arch.lower() in ("aarch64", "arm64")
            found = (
                ["bf16"]
                if arm and "bf16" in self.cpu_flags
                else [f for f in CPU_BF16_X86 if f in self.cpu_flags]
            )
            cpu = f"this CPU ({self.name})" if self.name else "this CPU"
            if found:
                return True, f"{cpu} has native bf16 ({', '.join(found)})"
            return (
                False,
                (
                    f"{cpu} has no native bf16 "
                    f"(no {'bf16 feature' if arm else 'avx512_bf16 or amx_bf16'}): bf16 "
                    "autocast would run many times slower than fp32"
                ),
            )
        return False, f"no precision facts for {self.kind} devices"


def best_precision(facts: DeviceFacts) -> tuple[str, str]:
    """The fastest precision the device has natively, and why."""
    bf16, why = facts.bf16()
    if bf16:
        return "bf16", why
    if facts.kind in ("cuda", "npu"):
        return "fp16", why + ": fp16 with loss scaling instead"
    return "no", why


def has(facts: DeviceFacts, precision: str) -> tuple[bool, str]:
    """Whether the device runs `precision` natively (fp32 always), and why not."""
    if precision == "no":
        return True, ""
    if precision == "bf16":
        return facts.bf16()
    if facts.kind == "cpu":  # fp16
        return False, "fp16 on a CPU runs fp32 under Accelerate"
    return facts.kind in ("cuda", "npu"), f"no precision facts for {facts.kind} devices"


@dataclass(frozen=True)
class Choice:
    precision: str  # what the run uses: no | fp16 | bf16
    reason: str  # one line: which and why
    error: str | None = None  # set when the asked precision is refused (a ConfigError line)


def choose_precision(
    facts: DeviceFacts, asked: str | None, source: str = "", force: bool = False
) -> Choice:
    """The precision a run uses.

    asked: None (nothing asked: the best the device has), or no|fp16|bf16 from `source` (a short
    phrase naming where it was asked, e.g. "--mixed_precision bf16" or "the accelerate config's
    mixed_precision"). A precision the device lacks is refused (Choice.error, naming what to use),
    unless `force`. Nothing asked: `source` names the rule that left it to the device (the start
    line says it)."""
    best, why = best_precision(facts)
    if asked in (None, "auto"):
        rule = f"; the device's fastest: {source}" if source else ""
        return Choice(best, f"precision {NAMES[best]}: {why}{rule}")
    if asked not in PRECISIONS:
        return Choice("no", "", f"mixed precision {asked!r} is not one of {', '.join(PRECISIONS)}")
    ok, lacks = has(facts, asked)
    if ok:
        # a fact, not a guess: which precision is faster for this model is not measured by the run
        # (bf16 measures slower on some CPUs), and the line never tells a launch.sh run to start
        # with launch.sh
        other = (
            f"; {why}, unused: --mixed_precision {best} to use it (this run did not measure "
            "which is faster; bench/bench.py compares them here)"
            if asked == "no" and best != "no"
            else ""
        )
        return Choice(asked, f"precision {NAMES[asked]}, as {source} asks{other}")
    if force:
        return Choice(
            asked,
            f"precision {NAMES[asked]}, as {source} asks, forced by "
            f"--force_precision although {lacks}",
        )
    return Choice(
        asked,
        "",
        f"{source} asks for {asked}, but {lacks}; use {best} instead "
        f"(--mixed_precision {best}, or mixed_precision: '{best}' in the "
        "accelerate config; launch.sh picks it by itself), or add "
        f"--force_precision to run {asked} anyway",
    )


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, frozenset]:
    """(model name, flags) of the first CPU in /proc/cpuinfo (x86 'flags', aarch64 'Features')."""
    name, flags = "", frozenset()
    try:
        with open(path) as f:
            text = f.read(1 << 20)
    except OSError:
        return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return name, flags


def has_accelerator() -> bool:
    """A GPU (any torch accelerator) or an Ascend NPU is here; ranks on a host without one must ask
    for the cpu."""
    import torch
    from accelerate.utils import is_npu_available

    return torch.accelerator.is_available() or is_npu_available()


def device_kind(cpu: bool) -> str:
    if cpu:
        return "cpu"
    import torch
    from accelerate.utils import is_npu_available

    if is_npu_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"


def facts_from_env(text: str) -> DeviceFacts:
    """ACCEL_TRAIN_DEVICE_FACTS='{"kind": "npu", "name": "Ascend910A"}' (or cuda + capability
    [7, 0], cpu + cpu_flags and arch): states the facts instead of probing (tests; hosts where the
    probe cannot run)."""
    import json

    try:
        d = json.loads(text)
        return DeviceFacts(
            str(d["kind"]),
            str(d.get("name", "")),
            tuple(d["capability"]) if d.get("capability") else None,
            frozenset(d.get("cpu_flags", ())),
            str(d.get("arch", platform.machine())),
        )
    except (ValueError, KeyError, TypeError) as e:
        from ..errors import ConfigError

        raise ConfigError(
            'ACCEL_TRAIN_DEVICE_FACTS is not a JSON object with at least "kind" '
            f"({e}); unset it or fix it"
        ) from None


def device_facts(cpu: bool | None = None, cpuinfo: str = "/proc/cpuinfo") -> DeviceFacts:
    """The facts of the device this process trains on. cpu=None: CPU when no accelerator is visible
    or ACCELERATE_USE_CPU is set (as accel_train asks Accelerate for the CPU)."""
    if os.environ.get("ACCEL_TRAIN_DEVICE_FACTS"):
        return facts_from_env(os.environ["ACCEL_TRAIN_DEVICE_FACTS"])
    if cpu is None:
        cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    kind = device_kind(cpu)
    if kind == "cuda":
        import torch

        caps = [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]
        return DeviceFacts("cuda", torch.cuda.get_device_name(0), min(caps))
    if kind == "npu":
        import torch
        import torch_npu  # noqa: F401

        # the SoC name, e.g. Ascend910B3
        return DeviceFacts("npu", str(torch.npu.get_device_name(0)))
    if kind == "cpu":
        name, flags = cpu_info(cpuinfo)
        return DeviceFacts("cpu", name, cpu_flags=flags, arch=platform.machine())
    return DeviceFacts(kind)


def channels_last_default(facts_kind: str) -> tuple[bool, str]:
    """channels_last where it was measured faster (CPU: bench/RESULTS.md; CUDA tensor cores:
    NVIDIA's and PyTorch's channels_last guidance); off on NPUs and elsewhere until measured."""
    if facts_kind in ("cpu", "cuda"):
        return True, f"channels_last (measured faster on {facts_kind.upper()})"
    return (
        False,
        (
            f"NCHW (channels_last is not measured faster on {facts_kind.upper()}: pass "
            "--channels_last to try it)"
        ),
    )


def compile_problem(facts_kind: str) -> str | None:
    """Why --compile cannot work on this device, or None. Inductor fails on NPUs with an older
    torch_npu; newer torch_npu ships a beta Inductor NPU backend as torch_npu._inductor
    (TORCHINDUCTOR_NPU_BACKEND, Ascend/pytorch docs)."""
    if facts_kind != "npu":
        return None
    import importlib.util

    try:
        found = importlib.util.find_spec("torch_npu._inductor") is not None
    except (ImportError, ValueError):
        found = False
    if found:
        return None
    try:
        from importlib.metadata import version

        have = f"torch_npu {version('torch_npu')}"
    except Exception:
        have = "this torch_npu"
    return (
        f"--compile: {have} has no Inductor backend for NPUs (torch_npu._inductor, in newer "
        "releases); drop --compile or install a torch_npu that has it"
    )


def launcher_choice(facts: DeviceFacts, config_precision: str, keep: bool) -> tuple[str, str]:
    """What launch.sh passes to accelerate launch: the best precision the device has, or (keep: a
    config the user named) the config's own where the device has it. config_precision "": the config
    states none, which leaves it to the device as launch.sh does for its own configs."""
    best, why = best_precision(facts)
    if not config_precision:
        return (
            best,
            (
                f"precision {NAMES[best]}: {why}; the device's fastest: the config states "
                "no mixed_precision"
            ),
        )
    if keep and config_precision in PRECISIONS and has(facts, config_precision)[0]:
        return (
            config_precision,
            (
                f"precision {NAMES[config_precision]}, as the config's "
                f"mixed_precision: '{config_precision}' asks"
            ),
        )
    if keep and config_precision != best:
        lacks = (
            has(facts, config_precision)[1]
            if config_precision in PRECISIONS
            else "unknown precision"
        )
        return best, f"precision {NAMES[best]}, not the config's {config_precision}: {lacks}"
    return (
        best,
        (
            f"precision {NAMES[best]}: {why}; the device's fastest: launch.sh's pick for "
            "its own config"
        ),
    )


def main(argv=None) -> int:
    """`python -m accel_train.platform.hardware [--cpu] [--config_precision P] [--keep]`: prints
    `<precision> <reason>`, the precision launch.sh passes to accelerate launch (one cheap call: no
    torch import with --cpu)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m accel_train.platform.hardware")
    p.add_argument("--cpu", action="store_true", help="the job runs on the CPU")
    p.add_argument(
        "--config_precision",
        default="",
        help="the accelerate config's mixed_precision (empty: it states none)",
    )
    p.add_argument(
        "--keep",
        action="store_true",
        help="the user named the config: keep its precision if the device has it",
    )
    args = p.parse_args(argv)
    precision, reason = launcher_choice(
        device_facts(cpu=True if args.cpu else None), args.config_precision, args.keep
    )
    print(f"{precision} {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
