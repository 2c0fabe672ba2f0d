"""bench/gpu_check.sh runs only on a lent GPU machine; here: it parses, shellcheck is clean
(test_launch.py), its dry run names every check with the JSON files it writes, its limits fit the
one shot's time, and with a stub Python (and a fake nvidia-smi) in place of the GPU each check's
status is the status of what it ran."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, clean_env

SCRIPT = ROOT / "bench" / "gpu_check.sh"
CHECKS = [
    "precision",
    "launch",
    "fp16",
    "bench_eager",
    "syncs",
    "compile",
    "reduce_overhead",
    "resume",
    "bigdata",
]
BUDGET_S = 540  # the one shot at a lent GPU: ~15 minutes with the machine's start


def dry_run(tmp_path, *checks):
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *checks],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(OUT=str(tmp_path)),
    )


def test_gpu_check_dry_run_lists_each_check_and_its_json(tmp_path):
    proc = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    for check in ("syncs", "compile", "resume", "reduce_overhead"):
        assert (
            f"bench/cuda_checks.py {check.replace('reduce_overhead', 'compile')} --json "
            f"{tmp_path}/gpu_check/{check}.json" in proc.stdout
        )
    # the chosen precision
    assert "python3 -m accel_train.platform.hardware --config_precision bf16" in proc.stdout
    summary = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    assert list(summary) == CHECKS
    lines = proc.stdout.splitlines()
    # launch.sh on the GPU: what it counts and exports (--dry-run), its smoke test, a run with its
    # own precision probe
    for own in (
        "--dry-run --data random --timeout_s 120",
        "--smoke-test",
    ):
        # (its NCCL variables checked)
        assert f"bash launch.sh {own} " in lines
    assert any(line.startswith("bash launch.sh --data random --epochs 2 ") for line in lines)
    fp16 = next(
        line for line in lines if "--output_dir " + str(tmp_path / "gpu_check" / "fp16") in line
    )
    # GradScaler, forced on any GPU
    assert "--mixed_precision fp16 " in fp16 and "-m accel_train " in fp16
    # the first from an empty cache
    compiled = [line for line in lines if "cuda_checks.py compile" in line]
    assert "TORCHINDUCTOR_CACHE_DIR=" in compiled[0] and compiled[1].endswith(
        "--compile_mode reduce-overhead "
    )
    # the trainer never runs that copy on a device (survivor.readable_step)
    assert "side_copy" not in proc.stdout
    # the large-folder case: a folder made, the data-only bench on CUDA, then a run whose
    # decoded images do not fit --device_data_mb, with the default workers (no --num_workers), its
    # data wait in bigdata.json
    out = tmp_path / "gpu_check"
    assert f"python3 bench/data_bench.py --make {out}/bigdata_photos 1600" in proc.stdout
    assert (
        f"python3 bench/data_bench.py --data_dir {out}/bigdata_photos --device cuda" in proc.stdout
    )
    train = next(line for line in lines if "--output_dir " + str(out / "bigdata") in line)
    assert (
        "--device_data_mb 1 " in train
        and "--image_size 224" in train
        and "--num_workers" not in train
    )


def test_the_checks_deadlines_fit_the_one_shot(tmp_path):
    """Every check has one deadline, each command a SIGKILL by it (timeout -k: the trainer answers
    SIGTERM with a checkpoint), and the header plus every check's limit stay within ~9 minutes (a
    cold compile cache included).
    """
    proc = dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    header = int(re.search(r"^HEADER_S=(\d+)", SCRIPT.read_text(), re.M).group(1))
    assert header + sum(c["limit"] for c in summary.values()) <= BUDGET_S
    assert (
        f"== budget: {header + sum(c['limit'] for c in summary.values())}s of {BUDGET_S}s"
        in proc.stdout
    )
    for script in (
        SCRIPT,
        ROOT / "bench" / "npu_check.sh",
    ):
        # (the NPU check's own limits: SIGKILL after them too)
        timeouts = re.findall(r"^[^#]*\btimeout (.{0,12})", script.read_text(), re.M)
        assert timeouts and all(t.startswith("-k ") for t in timeouts), (script, timeouts)
    # a check named alone runs alone (a rerun of one failed check); an unknown name is refused
    assert list(
        json.loads(
            (
                dry_run(tmp_path, "fp16").returncode == 0
                and tmp_path / "gpu_check" / "summary.json"
            ).read_text()
        )
    ) == ["fp16"]
    wrong = dry_run(tmp_path, "fp61")
    assert wrong.returncode == 2 and "no check 'fp61'" in wrong.stderr


STUB = """#!{python}
# a stub for the GPU machine's Python: the script's own helpers run (python -c without torch), the
# precision probes answer bf16, and every workload (a trainer, a bench, a check) writes its metrics
# row / JSON as a good run would, then fails: a status nothing may hide
import json, os, sys
from pathlib import Path
a = sys.argv[1:]
if a[0] == "-c" and "import torch" not in a[1]:
    os.execv({python!r}, [{python!r}] + a)
if a[:2] == ["-m", "accel_train.platform.hardware"]:
    sys.exit(print("bf16 precision bf16: the stub's"))
if a[:2] == ["-m", "accel_train.platform.accel_config"] or a[0] == "-c":
    sys.exit(0)
for flag in ("--output_dir", "--make"):
    if flag in a:
        out = Path(a[a.index(flag) + 1])
        if flag == "--output_dir" and (out / "metrics.jsonl").exists():
            # as the trainer does
            sys.exit(print("another run's output is here: refused", file=sys.stderr) or 2)
        out.mkdir(parents=True, exist_ok=True)
        row = dict(epoch=1, data_wait_frac=0.1, images_per_sec=1.0)
        (out / "metrics.jsonl").write_text(json.dumps(row) + "\\n")
if "--json" in a:
    Path(a[a.index("--json") + 1]).write_text(json.dumps(dict(ok=True)))
# a job left running in a session of its own, as launch.sh's job outlives timeout's SIGKILL
if "fp16" in a:
    import subprocess
    left = subprocess.Popen(["sleep", "300"], start_new_session=True, stdout=subprocess.DEVNULL,
                            # (one holding the check's pipes: ended at the deadline)
                            stderr=subprocess.DEVNULL)
    Path(os.environ["LEFT_PID"]).write_text(str(left.pid))
print("stub: a row written, now failing", file=sys.stderr)
sys.exit(3)
"""


def test_a_check_whose_trainer_fails_after_writing_a_row_is_a_failed_check(tmp_path):
    """A trainer that crashes after its first row, a failed data bench, are failed checks, whatever
    the check's last command (`cat metrics.jsonl`, a `| tee`) returns."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "python3"
    stub.write_text(STUB.format(python=sys.executable))
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\n[ "$1" = -L ] && echo "GPU 0: NVIDIA H200 (UUID: GPU-0)" || '
        'echo "NVIDIA H200, 143771 MiB"\n'
    )
    for f in (stub, smi):
        f.chmod(0o755)
    left = tmp_path / "left.pid"
    env = clean_env(
        OUT=str(tmp_path),
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(stub),
        LEFT_PID=str(left),
    )
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120, env=env
    )
    pid = int(left.read_text())
    # what a check leaves running is ended after it (the script's own runs only: its marker in their
    # environment)
    try:
        assert f"-- fp16 left 1 process(es) running ({pid}): ended with SIGKILL" in proc.stdout, (
            proc.stdout
        )
        assert (
            not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] in "ZX"
        )
    finally:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, 9)
    summary = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    assert summary["precision"]["exit"] == 0, proc.stdout  # the probe answered
    # the row was written, then the run failed
    assert (tmp_path / "gpu_check" / "fp16" / "metrics.jsonl").is_file()
    assert (tmp_path / "gpu_check" / "syncs.json").is_file()
    failed = {name: c["exit"] for name, c in summary.items() if name != "precision"}
    # (launch.sh passes the status on)
    assert failed == {name: 3 for name in CHECKS[1:]}, proc.stdout
    assert proc.returncode == 1
    # a rerun of two checks in the same $OUT: each starts from an empty folder of its own (the
    # trainer refuses a folder holding another run), and summary.json holds the rerun's checks
    proc = subprocess.run(
        ["bash", str(SCRIPT), "fp16", "resume"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    summary = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    assert {name: c["exit"] for name, c in summary.items()} == {"fp16": 3, "resume": 3}, proc.stdout


def test_syncs_judged_no_window_is_a_failure():
    """On a slow device every step runs an agreed check and every window is excluded: `syncs` that
    judged nothing is no ok."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cuda_checks

    every_step_checked = cuda_checks.judge_syncs(3, {1: 2, 2: 2}, checks=[1, 2])
    assert every_step_checked["windows_judged"] == 0 and not every_step_checked["ok"]
    assert cuda_checks.judge_syncs(4, {0: 5, 2: 1, 4: 3}, checks=[2]) | {
        "syncs_per_window": None
        # before the first step and after the last: evaluation, not judged
    } == {
        "ok": True,
        "steps": 4,
        "windows_judged": 2,
        "agreed_checks": [2],
        "syncs_outside_checks": {},
        "syncs_per_window": None,
    }
    assert cuda_checks.judge_syncs(4, {3: 1}, checks=[2])["syncs_outside_checks"] == {3: 1}


def test_results_md_lists_each_check_with_its_limit_and_what_one_gpu_cannot_show(tmp_path):
    assert dry_run(tmp_path).returncode == 0
    summary = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    text = (ROOT / "bench" / "RESULTS.md").read_text()
    section = text[text.index("## GPU (one H200)") : text.index("## Image folders larger")]
    rows = dict(re.findall(r"^\| (\w+) \| (\d+) s \|", section, re.M))
    assert rows == {name: str(c["limit"]) for name, c in summary.items()}
    assert "What this one shot cannot show" in section and "A lost NCCL peer" in section


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    # a PATH of the tools the script runs before its GPU check, without nvidia-smi
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("bash", "dirname", "mkdir", "timeout", "env"):
        (bindir / tool).symlink_to(shutil.which(tool))
    env = clean_env(OUT=str(tmp_path), PATH=str(bindir))
    proc = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "gpu_check.sh: nvidia-smi fails or is missing here: run it on the lent GPU machine, or with"
        " --dry-run"
    ]
