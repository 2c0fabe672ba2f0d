"""accel_train's training step vs a bare PyTorch loop, alternating in one process; ratios only.

    python bench/bench.py                      # CPU, small: about a minute on 2 cores
    python bench/bench.py --device cuda --batch_size 512 --precision bf16 --channels_last
    python bench/bench.py --table    # fp32/bf16 x NCHW/channels_last, ours/bare in each, CPU flags

"ours" is the real accel_train code path: `startup.setup()` (Accelerator, device-resident data
pipeline, timm model + stem, timm SGD, prepare) and per step `data.inputs()` (gather + crop + flip +
normalise on the device) and `loop.train_step()` + the optimizer step. "bare" is written here
independently: the same timm model and stem, batch, precision and memory format, torch.optim.SGD
(nesterov) and a fixed input batch already on the device (no data pipeline at all). They alternate
in rounds so that machine noise hits both. The last line printed is `ratio=<ours/bare>` (median
img/s over median img/s).

It also reports the one-time decode cost of an image folder (`--data imagefolder`, device pipeline):
images/s of `data.decode_all` (Pillow decode, convert to RGB, resize, centre crop) on
--decode_images generated PNG and JPEG files of mixed sizes, decoded to 32x32.

On CPU it also reports 1 vs 2 processes at the same global batch (scaling, reported, not asserted),
by running the trainer through `accelerate launch` with cpu.yaml and 2proc_cpu.yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import timm  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402


def bare_model(name: str, num_classes: int = 10) -> nn.Module:
    """timm model with a 3x3/stride-1 stem and no maxpool, written out here on purpose."""
    model = timm.create_model(name, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, 1, 1, bias=False)
    model.maxpool = nn.Identity()
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bare:
    def __init__(self, args, device):
        torch.manual_seed(0)
        self.device = device
        self.fmt = torch.channels_last if args.channels_last else torch.contiguous_format
        self.model = bare_model(args.model).to(device, memory_format=self.fmt).train()
        self.opt = torch.optim.SGD(
            self.model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4
        )
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.x = torch.randn(args.batch_size, 3, 32, 32, device=device).contiguous(
            memory_format=self.fmt
        )
        self.y = torch.randint(0, 10, (args.batch_size,), device=device)
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision)
        if args.compile:
            self.model = torch.compile(self.model, mode=args.compile_mode)

    def step(self):
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            loss = self.loss_fn(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class Ours:
    def __init__(self, args, device):
        os.environ["ACCELERATE_MIXED_PRECISION"] = args.precision
        if device.type == "cpu":
            os.environ["ACCELERATE_USE_CPU"] = "1"
        from accel_train.cli import parse_train_args
        from accel_train.training import loop
        from accel_train.training.startup import setup

        self.loop = loop
        self.cfg = parse_train_args(
            [
                "--data",
                "random",
                "--train_samples",
                str(max(args.batch_size * 8, 1024)),
                "--test_samples",
                "64",
                "--batch_size",
                str(args.batch_size),
                "--model",
                args.model,
                "--output_dir",
                args.output_dir,
                "--channels_last",
                str(args.channels_last),
                "--compile",
                str(args.compile),
                "--force_precision",
                "true",
                "--compile_mode",
                args.compile_mode,
                "--epochs",
                "100",
            ]
        )
        self.run = setup(self.cfg)
        self.device = self.run.accelerator.device
        self.epoch, self.batches = 0, iter(())
        # the survivor's lock, taken and released around the optimizer step as in the loop
        self.lock = threading.Lock()

    def next_inputs(self):
        batch = next(self.batches, None)
        if batch is None:
            self.epoch += 1
            self.run.train_loader.set_epoch(self.epoch)
            self.batches = iter(self.run.train_loader)
            batch = next(self.batches)
        return self.run.data.inputs(batch, train=True, epoch=self.epoch)

    def step(self):
        x, y = self.next_inputs()
        self.loop.train_step(self.run, x, y)
        with self.lock:
            # (the optimizer step of loop.apply_step; its EMA, schedule and progress are left out)
            self.run.optimizer.step()
            self.run.optimizer.zero_grad(set_to_none=True)


def timed(step, steps: int, batch: int, device) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return steps * batch / (time.perf_counter() - start)


def pipeline_rate(ours: Ours, steps: int, batch: int) -> float:
    def step():
        ours.next_inputs()

    timed(step, 3, batch, ours.device)
    return timed(step, steps, batch, ours.device)


def decode_rate(args) -> float:
    """images/s of the image-folder decode the device pipeline does once
    (accel_train.data.decode_all)."""
    import numpy as np
    from PIL import Image

    from accel_train.data import decode_all

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        files = []
        for i in range(args.decode_images):
            h, w = int(rng.integers(32, 129)), int(rng.integers(32, 129))
            files.append(Path(root) / f"img_{i}.{'png' if i % 2 else 'jpg'}")
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(files[-1])
        decode_all(files[:4], 32)  # warm up
        return decode_all(files, 32)[1]


def scaling(args) -> list[tuple[str, float]]:
    """1 vs 2 CPU processes, same global batch, through accelerate launch (real ranks)."""
    rows = []
    for config, per_process in (
        ("cpu.yaml", args.batch_size),
        ("2proc_cpu.yaml", args.batch_size // 2),
    ):
        with tempfile.TemporaryDirectory() as out:
            cmd = [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--config_file",
                str(ROOT / "accelerate_configs" / config),
                "-m",
                "accel_train",
                "--train_samples",
                str(args.batch_size * args.scaling_steps),
                "--test_samples",
                "16",
                "--epochs",
                "1",
                "--batch_size",
                str(per_process),
                "--model",
                args.model,
                "--output_dir",
                out,
            ]
            env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
            env.pop("OMP_NUM_THREADS", None)
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
            )
            if proc.returncode != 0:
                rows.append((config, float("nan")))
                continue
            row = json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])
            rows.append((config, row["images_per_sec"]))
    return rows


def cpu_flags_line() -> str:
    from accel_train.platform.hardware import CPU_BF16_X86, best_precision, device_facts

    facts = device_facts(cpu=True)
    shown = [
        f
        for f in (
            *CPU_BF16_X86,
            "amx_tile",
            "avx512_fp16",
            "avx512_vnni",
            "avx512f",
            "avx2",
            "bf16",
            "asimd",
        )
        if f in facts.cpu_flags
    ]
    return (
        f"# CPU: {facts.name or '?'} ({facts.arch}), {os.cpu_count()} cores; flags:"
        f" {' '.join(shown) or 'none'}; accel_train's choice: {best_precision(facts)[0]}"
    )


def table(args) -> None:
    """fp32/bf16 x NCHW/channels_last, ours and bare in each: one process per precision
    (Accelerate's precision is per process), NCHW and channels_last interleaved inside it, ours and
    bare alternating."""
    print(cpu_flags_line(), flush=True)
    rows = {}
    for precision in ("no", "bf16"):
        cmd = [
            sys.executable,
            __file__,
            "--device",
            args.device,
            "--model",
            args.model,
            "--batch_size",
            str(args.batch_size),
            "--precision",
            precision,
            "--both_formats",
            "--rounds",
            str(args.rounds),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--output_dir",
            args.output_dir,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"bench --precision {precision} failed")
        for line in proc.stdout.splitlines():
            if line.startswith("mode "):
                _, prec, fmt, *vals = line.split()
                rows[(prec, fmt)] = dict(v.split("=") for v in vals)
    base = float(rows[("no", "NCHW")]["ours"])
    print(
        f"{'mode':22s} {'ours img/s':>11s} {'bare img/s':>11s} {'ours/bare':>10s}"
        f" {'ours vs fp32 NCHW':>18s}  (ours: min..max over rounds)"
    )
    for (prec, fmt), v in rows.items():
        print(
            f"{('fp32' if prec == 'no' else prec) + ' ' + fmt:22s} {float(v['ours']):11.1f}"
            f" {float(v['bare']):11.1f} {float(v['ratio']):10.3f} {float(v['ours']) / base:17.2f}x "
            f" ({v['range']})"
        )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--precision", default="no", choices=("no", "bf16", "fp16"))
    p.add_argument("--channels_last", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--compile_mode", default="default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps per round for each side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--scaling_steps", type=int, default=12, help="steps of the 1-vs-2-process runs (CPU)"
    )
    p.add_argument("--no_scaling", action="store_true")
    p.add_argument(
        "--decode_images", type=int, default=256, help="generated image files for the decode figure"
    )
    p.add_argument("--output_dir", default=tempfile.mkdtemp(prefix="accel_train_bench_"))
    p.add_argument(
        "--table", action="store_true", help="the table of modes: fp32/bf16 x NCHW/channels_last"
    )
    p.add_argument(
        "--both_formats",
        action="store_true",
        help="NCHW and channels_last interleaved (one precision)",
    )
    args = p.parse_args()
    if args.table:
        return table(args)
    if args.both_formats:
        return both_formats(args)

    device = torch.device(args.device)
    ours = Ours(args, device)
    bare = Bare(args, ours.device)
    print(
        f"# {args.model} cifar stem, batch {args.batch_size}, precision {args.precision},"
        f" channels_last {args.channels_last}, compile {args.compile}, device {ours.device}, torch"
        f" {torch.__version__}, threads {torch.get_num_threads()}",
        flush=True,
    )
    for _ in range(args.warmup):
        ours.step()
        bare.step()
    rates = {"ours": [], "bare": []}
    for r in range(args.rounds):
        order = (("ours", ours), ("bare", bare)) if r % 2 == 0 else (("bare", bare), ("ours", ours))
        for name, side in order:
            rates[name].append(timed(side.step, args.steps, args.batch_size, ours.device))
    pipe = pipeline_rate(ours, max(args.steps * 5, 20), args.batch_size)

    print(f"{'':22s} {'img/s median':>13s} {'min':>10s} {'max':>10s}")
    for name in ("ours", "bare"):
        v = rates[name]
        print(
            f"{name + ' train step':22s} {statistics.median(v):13.1f} {min(v):10.1f} {max(v):10.1f}"
        )
    print(
        f"{'pipeline only':22s} {pipe:13.1f}   ({pipe / statistics.median(rates['ours']):.0f}x the"
        " training throughput)"
    )
    print(
        f"{'image decode (once)':22s} {decode_rate(args):13.1f}   (images/s: PNG+JPEG, 32..128 px"
        " -> 32x32)"
    )
    if device.type == "cpu" and not args.no_scaling:
        results = scaling(args)
        base = results[0][1]
        for config, rate in results:
            print(
                f"{'scaling ' + config:22s} {rate:13.1f}   (global batch {args.batch_size};"
                f" {rate / base:.2f}x of 1 process)"
            )
    print(f"ratio={statistics.median(rates['ours']) / statistics.median(rates['bare']):.3f}")


def both_formats(args) -> None:
    """One precision, NCHW and channels_last, ours and bare: all four alternate in each round."""
    device = torch.device(args.device)
    sides = {}
    for fmt, cl in (("NCHW", False), ("channels_last", True)):
        args.channels_last = cl
        args.output_dir = tempfile.mkdtemp(prefix=f"accel_train_bench_{fmt}_")
        ours = Ours(args, device)
        sides[(fmt, "ours")], sides[(fmt, "bare")] = ours, Bare(args, ours.device)
    for _ in range(args.warmup):
        for side in sides.values():
            side.step()
    rates = {k: [] for k in sides}
    keys = list(sides)
    for r in range(args.rounds):
        for k in keys if r % 2 == 0 else keys[::-1]:
            rates[k].append(timed(sides[k].step, args.steps, args.batch_size, device))
    for fmt in ("NCHW", "channels_last"):
        ours, bare = rates[(fmt, "ours")], rates[(fmt, "bare")]
        print(
            f"mode {args.precision} {fmt} ours={statistics.median(ours):.2f}"
            f" bare={statistics.median(bare):.2f}"
            f" ratio={statistics.median(ours) / statistics.median(bare):.3f}"
            f" range={min(ours):.1f}..{max(ours):.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
