"""Device checks for bench/gpu_check.sh, one per call; each prints a line and writes JSON figures.

    python bench/cuda_checks.py syncs --json F --output_dir D [--device cuda]
        host syncs per optimizer step
    python bench/cuda_checks.py compile --json F --output_dir D [--compile_mode M]
        graphs torch.compile compiled
    python bench/cuda_checks.py resume --json F --output_dir D
        stopped + resumed == uninterrupted
    python bench/cuda_checks.py deterministic-train -- <trainer arguments>
        (used by resume)

Each runs the real trainer (accel_train.cli.main) in this process. `syncs` turns on
torch.cuda.set_sync_debug_mode("warn") once training has started and counts the warnings per window
between two optimizer steps (a global optimizer step post-hook marks the boundaries), apart from the
steps at which the ranks ran an agreed check (AgreedChecks.agree); it fails when no window was left
to judge (on a slow device every step may run an agreed check). On --device cpu (a dry run of the
script itself) the same counting wraps Tensor.item / tolist / cpu / __bool__ instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = [
    "--data",
    "random",
    "--train_samples",
    "5120",
    "--test_samples",
    "1000",
    "--batch_size",
    "256",
]


def train(args: list[str]) -> int:
    from accel_train.cli import main

    return main([str(a) for a in args])


def check_syncs(a) -> dict:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from accel_train.resilience.preempt import AgreedChecks

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
    judged = judge_syncs(state["step"], state["syncs"], state["checks"])
    return {"check": "syncs", **judged, "ok": code == 0 and judged["ok"], "exit": code}


def judge_syncs(steps: int, syncs: dict[int, int], checks: list[int]) -> dict:
    """The windows between optimizer steps 1..steps-1 that ran no agreed check are judged: none may
    sync. No window judged (every step an agreed check, as on a slow device) is a failure too:
    nothing was shown."""
    judged = [k for k in range(1, steps) if k not in checks]
    stray = {k: syncs[k] for k in judged if syncs.get(k)}
    return {
        "ok": bool(judged) and not stray,
        "steps": steps,
        "windows_judged": len(judged),
        "agreed_checks": checks,
        "syncs_outside_checks": stray,
        "syncs_per_window": {str(k): n for k, n in sorted(syncs.items())},
    }


def check_compile(a) -> dict:
    """Also the seconds dynamo and inductor spent compiling (a cold start's with an empty
    TORCHINDUCTOR_CACHE_DIR)."""
    import time

    start = time.monotonic()
    code = train(
        SMALL
        + [
            "--test_samples",
            "1001",
            "--epochs",
            "2",
            "--compile",
            "--compile_mode",
            a.compile_mode,
            "--output_dir",
            a.output_dir,
        ]
    )
    from torch._dynamo import utils

    graphs, frames = utils.counters["stats"]["unique_graphs"], utils.counters["frames"]["ok"]
    spent = utils.calculate_time_spent() if hasattr(utils, "calculate_time_spent") else {}
    return {
        "check": "compile",
        "mode": a.compile_mode,
        "ok": code == 0 and graphs == 2,
        "exit": code,
        "graphs": graphs,
        "traced_frames": frames,
        "expected": "2 graphs (train, eval)",
        "compile_seconds": round(spent.get("total_wall_time", -1.0), 1),
        "run_seconds": round(time.monotonic() - start, 1),
    }


def check_resume(a) -> dict:
    """Three runs, each its own process with deterministic kernels: uninterrupted, stopped at
    --max_steps (5 steps into epoch 2), resumed; the exported weights must be equal."""
    import subprocess

    from safetensors.torch import load_file

    out = Path(a.output_dir)
    run = [sys.executable, __file__, "deterministic-train", "--"] + SMALL + ["--epochs", "2"]
    codes = [
        subprocess.run(run + extra, timeout=600).returncode
        for extra in (
            ["--output_dir", out / "full"],
            ["--max_steps", "25", "--output_dir", out / "stopped"],  # 20 steps/epoch
            ["--resume", "auto", "--output_dir", out / "stopped"],
        )
    ]
    if codes != [0, 0, 0]:
        return {"check": "resume", "ok": False, "exits": codes}
    x, y = (
        load_file(out / "full" / "model.safetensors"),
        load_file(out / "stopped" / "model.safetensors"),
    )
    diff = max((x[k].double() - y[k].double()).abs().max().item() for k in x)
    return {"check": "resume", "ok": diff <= 1e-6, "exits": codes, "max_abs_diff": diff}


def deterministic_train(args: list[str]) -> int:
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return train(args)


CHECKS = {"syncs": check_syncs, "compile": check_compile, "resume": check_resume}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("check", choices=CHECKS)
    p.add_argument("--json", required=True, help="file for the figures")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument(
        "--compile_mode",
        default="default",
        help="compile: torch.compile's mode (reduce-overhead: CUDA graphs)",
    )
    if sys.argv[1:2] == ["deterministic-train"]:
        return deterministic_train(sys.argv[sys.argv.index("--") + 1 :])
    a = p.parse_args()
    result = CHECKS[a.check](a)
    Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{a.check}: {'ok' if result['ok'] else 'FAILED'} "
        + json.dumps({k: v for k, v in result.items() if k not in ("syncs_per_window",)})
    )
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
