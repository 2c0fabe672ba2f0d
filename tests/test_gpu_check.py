"""bench/gpu_check.sh runs only on a lent GPU machine; here: it parses, shellcheck is clean, and its dry run
names every check (syncs, compile, resume among them) with the JSON files it writes (shellcheck: test_launch.py)."""

import json
import subprocess

from conftest import ROOT, clean_env

SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_gpu_check_dry_run_lists_each_check_and_its_json(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
                          env=clean_env(OUT=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr
    for check in ("syncs", "compile", "resume", "side_copy"):
        assert f"bench/cuda_checks.py {check} --json {tmp_path}/gpu_check/{check}.json" in proc.stdout
    assert "python -m accel_train.hardware --config_precision bf16" in proc.stdout  # the chosen precision
    summary = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    assert list(summary) == ["precision", "bench_eager", "train", "syncs", "compile", "resume", "side_copy",
                             "bigdata"]
    # the large-folder case (issue 25): a folder made, the data-only bench on CUDA, then a run whose decoded images
    # do not fit --device_data_mb, with the default workers (no --num_workers), its data wait in bigdata.json
    out = tmp_path / "gpu_check"
    assert f"python bench/data_bench.py --make {out}/bigdata_photos 1600" in proc.stdout
    assert f"python bench/data_bench.py --data_dir {out}/bigdata_photos --device cuda" in proc.stdout
    train = next(line for line in proc.stdout.splitlines() if "--output_dir " + str(out / "bigdata") in line)
    assert "--device_data_mb 1 " in train and "--image_size 224" in train and "--num_workers" not in train
