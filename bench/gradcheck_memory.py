"""The precision check's cost next to one training step: peak memory and time of
one bf16 training step, of the check on the slice a run checks (gradcheck.CHECK_BATCH rule) and of
the check on the whole batch (as it once was), each in a fresh process. Peak memory over
what the process held just before: the accelerator's allocator peak where there is one, else the
growth of the peak resident set (Linux).

    python bench/gradcheck_memory.py [--model resnet50] [--image_size 224] [--batch 64]
        [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def current_bytes() -> int:
    import torch

    if torch.accelerator.is_available():
        return torch.accelerator.memory_allocated()
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def peak_bytes() -> int:
    import torch

    if torch.accelerator.is_available():
        return torch.accelerator.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(args) -> dict:
    import timm
    import torch

    from accel_train.precision import check as gradcheck

    device = (
        torch.accelerator.current_accelerator()
        if torch.accelerator.is_available()
        else torch.device("cpu")
    )
    torch.manual_seed(0)
    model = timm.create_model(args.model, num_classes=1000).to(device).train()
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    criterion, dtype = torch.nn.CrossEntropyLoss(), gradcheck.DTYPES[args.precision]
    n = (
        min(args.batch, max(gradcheck.CHECK_BATCH, args.batch // 4))
        if args.what == "check"
        else args.batch
    )
    if torch.accelerator.is_available():
        torch.accelerator.reset_peak_memory_stats()
    before, start = current_bytes(), time.perf_counter()
    if args.what == "step":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with torch.autocast(device.type, dtype=dtype):
            loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        float(loss)
    else:
        # (its cost, whatever its verdict)
        gradcheck.check(model, x[:n], y[:n], criterion, args.precision)
    return dict(
        what=args.what,
        samples=n,
        seconds=time.perf_counter() - start,
        peak_gib=(peak_bytes() - before) / 2**30,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16"])
    p.add_argument(
        "--what", choices=["step", "check", "whole"], help="one measurement, in this process"
    )
    args = p.parse_args()
    if args.what:
        print(json.dumps(measure(args)))
        return
    import torch

    print(
        f"# {args.model}, {args.image_size} px, batch {args.batch}, {args.precision}, torch"
        f" {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(f"{'':34}{'samples':>8}{'seconds':>9}{'peak GiB':>10}")
    rows = {}
    for what in ("step", "check", "whole"):
        out = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--what", what],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        ).stdout
        rows[what] = r = json.loads(out.strip().splitlines()[-1])
        label = {
            "step": "one training step",
            "check": "check on its slice (now)",
            "whole": "check on the whole batch",
        }
        print(f"{label[what]:34}{r['samples']:>8}{r['seconds']:>9.1f}{r['peak_gib']:>10.2f}")
    for what in ("check", "whole"):
        print(
            f"{what}: peak {rows[what]['peak_gib'] / rows['step']['peak_gib'] - 1:+.0%} over the"
            f" step's, {rows[what]['seconds'] / rows['step']['seconds']:.1f} steps of time"
        )


if __name__ == "__main__":
    main()
