#!/usr/bin/env bash
# GPU check, for a lent GPU machine (its own preinstalled torch, accelerate, timm, safetensors; no
# network; install nothing). From the repo root:  bash bench/gpu_check.sh [--dry-run]   (under 5 minutes)
#   bench_eager  the bench on CUDA: resnet18, cifar stem, bf16, channels_last, ratio ours/bare
#   train     a 2-epoch random-data run through accelerate launch (1node_gpu.yaml, 1 process)
#   precision the precision accel_train chooses for this GPU (bf16 from compute capability 8.0, else fp16)
#   syncs     host syncs per optimizer step (torch.cuda.set_sync_debug_mode): none outside the agreed checks
#   compile   graphs torch.compile compiled over 2 epochs with a partial last evaluation batch: 2 (train, eval)
#   resume    a run stopped at --max_steps and resumed equals the uninterrupted one (deterministic kernels)
#   side_copy the survivor save's copy reads the device while the training stream is stuck (docs/failures.md)
#   bigdata   a folder of 1600 JPEGs (~450x350) larger than --device_data_mb: the data-only bench on CUDA (cpu
#             pipeline, its cache, timm's loader) and a 2-epoch resnet18 run at 224 px under --pipeline auto with
#             the default workers; bigdata.json: the 2nd epoch's data wait fraction (issue 25)
# Text goes to stdout, figures to $OUT/gpu_check/<check>.json and a summary to $OUT/gpu_check/summary.json.
# A new check: write a function check_<name> and add <name> and its time limit to CHECKS.
# Paste what it prints, the date and the hardware into bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
out="${OUT:-/tmp}/gpu_check"
dry=0
if [[ "${1:-}" == --dry-run ]]; then dry=1; fi
CHECKS=("precision 20" "bench_eager 60" "train 50" "syncs 40" "compile 90" "resume 60"
        "side_copy 40" "bigdata 180")  # name, time limit (s)

limit=60
run() {  # run a command within the check's time limit (or, with --dry-run, print it)
  if ((dry)); then printf '%q ' "$@"; echo; else timeout "$limit" "$@"; fi
}

bench=(python bench/bench.py --device cuda --batch_size 512 --precision bf16 --channels_last --rounds 5 --steps 25
       --output_dir "$out/bench")
check_bench_eager() { run "${bench[@]}" | tee "$out/bench_eager.txt"; }
check_train() {
  run python -m accelerate.commands.launch --config_file accelerate_configs/1node_gpu.yaml --num_processes 1 \
    -m accel_train --data random --epochs 2 --batch_size 512 --channels_last --output_dir "$out/train" 2>&1 \
    | grep -v 'it/s]$'
  ((dry)) || cat "$out/train/metrics.jsonl"
}
check_precision() {  # first word: the choice; the rest: why (accel_train.hardware, as launch.sh asks it)
  local line
  line="$(run python -m accel_train.hardware --config_precision bf16)" || return
  echo "$line"
  ((dry)) || python -c 'import json, sys; print(json.dumps(dict(chosen=sys.argv[1].split()[0], reason=sys.argv[1])))' \
    "$line" > "$out/precision.json"
}
cuda_check() { run python bench/cuda_checks.py "$1" --json "$out/$1.json" --output_dir "$out/$1"; }
check_syncs() { cuda_check syncs; }
check_compile() { cuda_check compile; }
check_resume() { cuda_check resume; }
check_side_copy() { cuda_check side_copy; }

check_bigdata() {  # (the decoded cache goes to $out/cache, not the machine's ~/.cache)
  local photos="$out/bigdata_photos"
  run python bench/data_bench.py --make "$photos" 1600 || return
  XDG_CACHE_HOME="$out/cache" run python bench/data_bench.py --data_dir "$photos" --device cuda --batch_size 256 \
    --batches 6 --rounds 1 --cases cpu,cache,timm | tee "$out/bigdata_bench.txt"
  XDG_CACHE_HOME="$out/cache" run python -m accelerate.commands.launch --config_file accelerate_configs/1node_gpu.yaml \
    --num_processes 1 -m accel_train --data imagefolder --data_dir "$photos" --image_size 224 --epochs 2 \
    --batch_size 256 --device_data_mb 1 --channels_last --output_dir "$out/bigdata" 2>&1 | grep -v 'it/s]$'
  ((dry)) || python -c 'import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
print(json.dumps({"data_wait_frac_epoch2": rows[-1]["data_wait_frac"], "images_per_sec": rows[-1]["images_per_sec"],
                  "data_wait_frac_epoch1": rows[0]["data_wait_frac"]}))' "$out/bigdata/metrics.jsonl" \
    | tee "$out/bigdata.json"
}

mkdir -p "$out"
if ((!dry)); then
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import torch, accelerate, timm, safetensors; print("torch", torch.__version__, "accelerate", accelerate.__version__, "timm", timm.__version__, "safetensors", safetensors.__version__)'
fi
summary="{"
for entry in "${CHECKS[@]}"; do
  read -r name limit <<< "$entry"
  echo "== $name (at most ${limit}s)"
  start=$SECONDS
  status=0
  "check_$name" || status=$?
  echo "-- $name: exit status $status, $((SECONDS - start))s"
  summary+="\"$name\": {\"exit\": $status, \"seconds\": $((SECONDS - start))},"
done
echo "${summary%,}}" > "$out/summary.json"
cat "$out/summary.json"
