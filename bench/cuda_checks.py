"""Device checks for bench/gpu_check.sh, one per call; each prints one line and writes its figures as JSON.

    python bench/cuda_checks.py syncs  --json F --output_dir D [--device cuda]   host syncs per optimizer step
    python bench/cuda_checks.py compile --json F --output_dir D                  graphs torch.compile compiled
    python bench/cuda_checks.py resume --json F --output_dir D                   stopped + resumed == uninterrupted
    python bench/cuda_checks.py side_copy --json F --output_dir D [--device cuda] the survivor copy skips a stuck stream
    python bench/cuda_checks.py deterministic-train -- <trainer arguments>       (used by resume)

Each runs the real trainer (accel_train.cli.main) in this process. `syncs` turns on
torch.cuda.set_sync_debug_mode("warn") once training has started and counts the warnings per window between
two optimizer steps (a global optimizer step post-hook marks the boundaries), apart from the steps at which
the ranks ran an agreed check (AgreedChecks.agree). On --device cpu (a dry run of the script itself) the
same counting wraps Tensor.item / tolist / cpu / __bool__ instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = ["--data", "random", "--train_samples", "5120", "--test_samples", "1000", "--batch_size", "256"]


def train(args: list[str]) -> int:
    from accel_train.cli import main
    return main([str(a) for a in args])


def check_syncs(a) -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from accel_train.preempt import AgreedChecks
    state = {"step": 0, "syncs": {}, "checks": []}

    def count():
        key = state["step"]
        state["syncs"][key] = state["syncs"].get(key, 0) + 1

    def on_step(optimizer, args, kwargs):
        state["step"] += 1
        if state["step"] == 1 and a.device == "cuda":
            torch.cuda.set_sync_debug_mode("warn")  # from here on every synchronizing call warns

    register_optimizer_step_post_hook(on_step)
    agree = AgreedChecks.agree

    def recorded(self, accelerator, step, *rest, **kw):
        if rest or kw:  # the training loop's checks (evaluation's run after the last step)
            state["checks"].append(state["step"])
        return agree(self, accelerator, step, *rest, **kw)

    AgreedChecks.agree = recorded
    if a.device == "cuda":
        shown = warnings.showwarning

        def showwarning(message, category, *rest, **kw):
            if "synchroniz" in str(message):
                count()
            else:
                shown(message, category, *rest, **kw)
        warnings.simplefilter("always")
        warnings.showwarning = showwarning
    else:
        for name in ("item", "tolist", "cpu", "__bool__"):
            method = getattr(torch.Tensor, name)

            def wrapped(*args, _method=method, **kw):
                if state["step"]:
                    count()
                return _method(*args, **kw)
            setattr(torch.Tensor, name, wrapped)
    code = train(SMALL + ["--epochs", "1", "--log_every", "100000", "--output_dir", a.output_dir])
    steps = state["step"]
    stray = {k: n for k, n in state["syncs"].items() if 0 < k < steps and k not in state["checks"]}
    return {"check": "syncs", "ok": code == 0 and not stray, "exit": code, "steps": steps,
            "agreed_checks": state["checks"], "syncs_outside_checks": stray,
            "syncs_per_window": {str(k): n for k, n in sorted(state["syncs"].items())}}


def check_compile(a) -> dict:
    code = train(SMALL + ["--test_samples", "1001", "--epochs", "2", "--compile", "--output_dir", a.output_dir])
    from torch._dynamo.utils import counters
    graphs, frames = counters["stats"]["unique_graphs"], counters["frames"]["ok"]
    return {"check": "compile", "ok": code == 0 and graphs == 2, "exit": code, "graphs": graphs,
            "traced_frames": frames, "expected": "2 graphs (train, eval)"}


def check_resume(a) -> dict:
    """Three runs, each its own process with deterministic kernels: uninterrupted, stopped at --max_steps
    (5 steps into epoch 2), resumed; the exported weights must be equal."""
    import subprocess

    from safetensors.torch import load_file
    out = Path(a.output_dir)
    run = [sys.executable, __file__, "deterministic-train", "--"] + SMALL + ["--epochs", "2"]
    codes = [subprocess.run(run + extra, timeout=600).returncode for extra in (
        ["--output_dir", out / "full"], ["--max_steps", "25", "--output_dir", out / "stopped"],  # 20 steps/epoch
        ["--resume", "auto", "--output_dir", out / "stopped"])]
    if codes != [0, 0, 0]:
        return {"check": "resume", "ok": False, "exits": codes}
    x, y = load_file(out / "full" / "model.safetensors"), load_file(out / "stopped" / "model.safetensors")
    diff = max((x[k].double() - y[k].double()).abs().max().item() for k in x)
    return {"check": "resume", "ok": diff <= 1e-6, "exits": codes, "max_abs_diff": diff}


def check_side_copy(a) -> dict:
    """accel_train.device_copy.state_to_host, the survivor save's copy (docs/failures.md), on a device whose training
    stream is stuck: a ~10 s kernel (torch.cuda._sleep, 2e10 cycles at ~2 GHz) holds the current stream, with an
    update of the weights queued behind it, as a hung collective holds the next optimizer step. The copy must return
    while the stream is still busy, with the weights from before the update; the update then runs as queued."""
    import time

    import torch

    from accel_train.device_copy import state_to_host
    device = torch.device(a.device)
    weights = torch.arange(1 << 20, dtype=torch.float32, device=device)
    before = weights.cpu().clone()  # (on the cpu, .cpu() is the tensor itself)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(2 * 10**10)  # the stuck collective
    weights.add_(1)  # the step queued behind it
    start = time.monotonic()
    copied = state_to_host({"weights": weights}, timeout_s=30)["weights"]
    seconds = time.monotonic() - start
    stuck = not torch.cuda.current_stream().query() if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.synchronize()
    same = torch.equal(copied, before) if device.type == "cuda" else torch.equal(copied, before + 1)
    return {"check": "side_copy", "ok": bool(same and stuck is not False and torch.equal(weights.cpu(), before + 1)),
            "copy_seconds": round(seconds, 3), "stream_still_busy_after_copy": stuck, "copy_is_pre_update": same}


def deterministic_train(args: list[str]) -> int:
    import os

    import torch
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return train(args)


CHECKS = {"syncs": check_syncs, "compile": check_compile, "resume": check_resume, "side_copy": check_side_copy}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=CHECKS)
    p.add_argument("--json", required=True, help="file for the figures")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    if sys.argv[1:2] == ["deterministic-train"]:
        return deterministic_train(sys.argv[sys.argv.index("--") + 1:])
    a = p.parse_args()
    result = CHECKS[a.check](a)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{a.check}: {'ok' if result['ok'] else 'FAILED'} " + json.dumps({k: v for k, v in result.items()
                                                                           if k not in ("syncs_per_window",)}))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
