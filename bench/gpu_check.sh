#!/usr/bin/env bash
# GPU check, for a lent GPU machine (its own preinstalled torch, accelerate, timm, safetensors; no network; install
# nothing). From the repo root:  bash bench/gpu_check.sh [--dry-run] [CHECK...]   (all checks: at most BUDGET_S, 9 min)
#   precision       the precision accel_train chooses for this GPU (bf16 from compute capability 8.0, else fp16)
#   launch          launch.sh itself: its --dry-run (the GPUs it counts, the NCCL variables it exports: error handling,
#                   the watchdog's monitor after --timeout_s), --smoke-test
#                   (every rank in one NCCL group), a 2-epoch random-data run with its own precision probe
#   fp16            fp16 with GradScaler forced by flag (the V100/T4 path, on any GPU), 1 epoch, start-up check included
#   bench_eager     the bench on CUDA: resnet18, cifar stem, bf16, channels_last, ratio ours/bare
#   syncs           host syncs per optimizer step (torch.cuda.set_sync_debug_mode): none outside the agreed checks,
#                   and at least one window judged
#   compile         graphs torch.compile compiled over 2 epochs with a partial last evaluation batch: 2 (train, eval);
#                   from an empty inductor/triton cache: compile_seconds is a cold start's
#   reduce_overhead the same with --compile_mode reduce-overhead (CUDA graphs), the cache the compile check left
#   resume          a run stopped at --max_steps and resumed equals the uninterrupted one (deterministic kernels)
#   bigdata         a folder of 1600 JPEGs (~450x350) larger than --device_data_mb: the data-only bench on CUDA (cpu
#                   pipeline, its cache, timm's loader) and a 2-epoch resnet18 run at 224 px under --pipeline auto with
#                   the default workers; bigdata.json: the 2nd epoch's data wait fraction
# What one GPU cannot show (a lost NCCL peer, several machines): bench/RESULTS.md.
# Each check has one deadline (its CHECKS entry, in seconds from its start) shared by its commands: each gets SIGTERM
# GRACE_S before it (the trainer answers it as a preemption: a checkpoint) and SIGKILL at it (timeout -k); what it
# left running (launch.sh's job, in a session of its own) is ended after it (sweep). A check's
# exit status is the first failing command's (the script's: 1 if any check failed). Each check writes under
# $OUT/gpu_check/<check>/, emptied at its start. Text goes to stdout, figures to $OUT/gpu_check/<check>.json, and
# $OUT/gpu_check/summary.json (each check's exit status, seconds and limit) is rewritten after every check.
# A new check: write a function check_<name> and add <name> and its limit to CHECKS, within BUDGET_S.
# Paste what it prints, the date and the hardware into bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
export PYTHON="${PYTHON:-python3}"  # (launch.sh runs the same one)
out="${OUT:-/tmp}/gpu_check"
dry=0
if [[ "${1:-}" == --dry-run ]]; then dry=1; shift; fi
BUDGET_S=540  # the whole script, header included: the one shot at a lent GPU is ~15 minutes with the machine's start
HEADER_S=20   # nvidia-smi (5 s) and the versions (15 s: torch's first import from a cold disk)
GRACE_S=5
CHECKS=("precision 15" "launch 90" "fp16 40" "bench_eager 45" "syncs 35" "compile 90" "reduce_overhead 50"
        "resume 55" "bigdata 95")  # name, limit (s)

deadline=0
run() {  # one command of the current check, ended by the check's deadline (or, with --dry-run, printed)
  if ((dry)); then printf '%q ' "$@"; echo; return 0; fi
  local left=$((deadline - SECONDS))
  if ((left <= GRACE_S)); then echo "(the check's time is up: not run: $*)"; return 124; fi
  timeout -k "$GRACE_S" "$((left - GRACE_S))" "$@"
}
export GPU_CHECK_RUN="$$.$RANDOM"  # in the environment of everything a check starts: what `sweep` ends
sweep() {  # what a check left running: a job in a session of its own (launch.sh's) outlives timeout's SIGKILL
  local pids  # (grep, run without the marker, is the only process started here)
  mapfile -t pids < <(env -u GPU_CHECK_RUN grep -lzx "GPU_CHECK_RUN=$GPU_CHECK_RUN" /proc/[0-9]*/environ 2>/dev/null)
  ((${#pids[@]})) || return 0
  pids=("${pids[@]#/proc/}") && pids=("${pids[@]%/environ}")
  echo "-- $name left ${#pids[*]} process(es) running (${pids[*]}): ended with SIGKILL"
  kill -KILL "${pids[@]}" 2>/dev/null || true
}
keep() { ((status)) || status=$1; }  # the first failure's status, in a check's local `status`
# The readers of a check's pipes end by its deadline too: a job that outlived timeout (launch.sh's) still holds them
bounded() { timeout -k 1 "$((deadline - SECONDS > 1 ? deadline - SECONDS : 1))" "$@"; }
quiet() { bounded grep --line-buffered -v 'it/s]$' || true; }  # (a pipeline's status stays its command's: pipefail)
small=(--data random --train_samples 5120 --test_samples 1000 --batch_size 256)
gpu_launch=("$PYTHON" -m accelerate.commands.launch --config_file accelerate_configs/1node_gpu.yaml --num_processes 1)

check_precision() {  # first word: the choice; the rest: why (accel_train.platform.hardware, as launch.sh asks it)
  local line
  line="$(run "$PYTHON" -m accel_train.platform.hardware --config_precision bf16)" || return
  echo "$line"
  ((dry)) || "$PYTHON" -c 'import json, sys; print(json.dumps(dict(chosen=sys.argv[1].split()[0], reason=sys.argv[1])))' \
    "$line" > "$out/precision.json"
}
check_launch() {  # launch.sh picks the config, process count, precision and NCCL variables itself
  local status=0 printed v
  printed="$(run bash launch.sh --dry-run --data random --timeout_s 120)" || return
  echo "$printed"
  # NCCL's settings (docs/failures.md, accel_train/platform/backend_env.py FAILURE_ENV and MONITOR_ENV: the watchdog's
  # monitor after --timeout_s), exported on a real GPU host; the 2-epoch run below starts its group under them
  for v in TORCH_NCCL_ASYNC_ERROR_HANDLING=2 TORCH_NCCL_ENABLE_MONITORING=1 TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=120; do
    ((dry)) || [[ "$printed" == *" $v "* ]] || { echo "launch: launch.sh --dry-run does not export $v"; keep 1; }
  done
  run bash launch.sh --smoke-test 2>&1 | quiet || keep $?
  run bash launch.sh --data random --epochs 2 --batch_size 512 --channels_last --output_dir "$out/launch" 2>&1 | quiet \
    || keep $?
  ((dry)) || cat "$out/launch/metrics.jsonl" || keep $?
  return "$status"
}
check_fp16() {  # accelerate's GradScaler; the start-up precision check compares fp16 with an fp32 reference (no TF32)
  run "${gpu_launch[@]}" -m accel_train "${small[@]}" --epochs 1 --mixed_precision fp16 --output_dir "$out/fp16" 2>&1 \
    | quiet || return
  ((dry)) || cat "$out/fp16/metrics.jsonl"
}
bench=("$PYTHON" bench/bench.py --device cuda --batch_size 512 --precision bf16 --channels_last --rounds 5 --steps 25
       --output_dir "$out/bench_eager")
check_bench_eager() { run "${bench[@]}" | bounded tee "$out/bench_eager.txt"; }
cuda_check() { run "$PYTHON" bench/cuda_checks.py "$1" --json "$out/$2.json" --output_dir "$out/$2" "${@:3}"; }
check_syncs() { cuda_check syncs syncs; }
check_compile() {  # an empty cache: the compile seconds of a first start on a fresh machine
  ((dry)) || rm -rf "$out/compile_cache"
  run env TORCHINDUCTOR_CACHE_DIR="$out/compile_cache/inductor" TRITON_CACHE_DIR="$out/compile_cache/triton" \
    "$PYTHON" bench/cuda_checks.py compile --json "$out/compile.json" --output_dir "$out/compile"
}
check_reduce_overhead() {
  run env TORCHINDUCTOR_CACHE_DIR="$out/compile_cache/inductor" TRITON_CACHE_DIR="$out/compile_cache/triton" \
    "$PYTHON" bench/cuda_checks.py compile --json "$out/reduce_overhead.json" --output_dir "$out/reduce_overhead" \
    --compile_mode reduce-overhead
}
check_resume() { cuda_check resume resume; }

check_bigdata() {  # (the decoded cache goes to $out/bigdata/cache, not the machine's ~/.cache)
  local photos="$out/bigdata_photos"
  run "$PYTHON" bench/data_bench.py --make "$photos" 1600 || return
  run env XDG_CACHE_HOME="$out/bigdata/cache" "$PYTHON" bench/data_bench.py --data_dir "$photos" --device cuda \
    --batch_size 256 --batches 6 --rounds 1 --cases cpu,cache,timm | bounded tee "$out/bigdata_bench.txt" || return
  run env XDG_CACHE_HOME="$out/bigdata/cache" "${gpu_launch[@]}" -m accel_train --data imagefolder \
    --data_dir "$photos" --image_size 224 --epochs 2 --batch_size 256 --device_data_mb 1 --channels_last \
    --output_dir "$out/bigdata/run" 2>&1 | quiet || return
  ((dry)) || "$PYTHON" -c 'import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
print(json.dumps({"data_wait_frac_epoch2": rows[-1]["data_wait_frac"], "images_per_sec": rows[-1]["images_per_sec"],
                  "data_wait_frac_epoch1": rows[0]["data_wait_frac"]}))' "$out/bigdata/run/metrics.jsonl" \
    | tee "$out/bigdata.json"
}

total=$HEADER_S
for entry in "${CHECKS[@]}"; do total=$((total + ${entry#* })); done
if ((total > BUDGET_S)); then
  echo "gpu_check.sh: the checks' limits and the header add up to ${total}s, over BUDGET_S=${BUDGET_S}s: trim them" >&2
  exit 2
fi
selected=()
for entry in "${CHECKS[@]}"; do
  if (($# == 0)) || [[ " $* " == *" ${entry%% *} "* ]]; then selected+=("$entry"); fi
done
for name in "$@"; do
  if [[ " ${CHECKS[*]} " != *" $name "* ]]; then
    echo "gpu_check.sh: no check '$name'; the checks: ${CHECKS[*]}" >&2
    exit 2
  fi
done

mkdir -p "$out"
if ((!dry)); then
  if ! command -v nvidia-smi >/dev/null || ! timeout -k 1 4 nvidia-smi \
      --query-gpu=name,memory.total,driver_version,mig.mode.current --format=csv,noheader; then
    echo "gpu_check.sh: nvidia-smi fails or is missing here: run it on the lent GPU machine, or with --dry-run" >&2
    exit 2
  fi
  date -u
  timeout -k 1 "$((HEADER_S - 6))" "$PYTHON" -c 'import torch, accelerate, timm, safetensors
print("torch", torch.__version__, "accelerate", accelerate.__version__, "timm", timm.__version__, "safetensors",
      safetensors.__version__)'
fi
echo "== budget: ${total}s of ${BUDGET_S}s (header ${HEADER_S}s + the checks' limits)"
summary=() failed=0
for entry in "${selected[@]}"; do
  read -r name limit <<< "$entry"
  echo "== $name (at most ${limit}s)"
  start=$SECONDS deadline=$((SECONDS + limit))
  ((dry)) || rm -rf "${out:?}/$name"  # a rerun starts fresh: the trainer refuses another run's checkpoints
  status=0
  "check_$name" || status=$?
  ((dry)) || sweep
  ((status == 0)) || failed=$((failed + 1))
  echo "-- $name: exit status $status, $((SECONDS - start))s"
  summary+=("\"$name\": {\"exit\": $status, \"seconds\": $((SECONDS - start)), \"limit\": $limit}")
  (IFS=,; echo "{${summary[*]}}") > "$out/summary.json"  # after each check: a machine taken back early keeps these
done
cat "$out/summary.json"
((failed == 0))  # the script's own status: 1 when any check failed
