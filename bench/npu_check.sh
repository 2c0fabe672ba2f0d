#!/usr/bin/env bash
# Ascend check, for an Ascend node with torch_npu (its own preinstalled torch, torch_npu, accelerate, timm,
# safetensors; no network; install nothing): the counterpart of bench/gpu_check.sh.
# From the repo root:  bash bench/npu_check.sh [--dry-run]   (a few minutes; by its limits at most ~18: each timeout
# sends SIGTERM, which the trainer answers with a checkpoint, and SIGKILL 10 s later)
#   1. smoke:      launch.sh --smoke-test on 1node_npu.yaml (every rank in one HCCL group of the right size)
#   2. train:      2 short epochs of random data on every NPU, bf16 where the chip has it
#                  (the SoC name: accel_train.platform.hardware, as the trainer), else fp16; dropout and drop path on
#   3. resume:     the same run stopped at a checkpoint, its random_states_*.pkl deleted, resumed:
#                  the largest weight difference to the uninterrupted run
#   4. throughput: images/s of the training run's last epoch (metrics.jsonl)
# --dry-run prints the plan (every command) without an NPU. Paste the block printed at the end, with the
# date and the hardware, into bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
dry=0
[[ "${1:-}" == --dry-run || "${1:-}" == --dry_run ]] && dry=1
out="${OUT:-/tmp}/npu_check"
PYTHON="${PYTHON:-python3}"

run() {  # print a step's command; run it unless --dry-run
  printf '+'; printf ' %q' "$@"; echo
  ((dry)) || "$@"
}
probe() {  # a fact from torch_npu, or a placeholder in --dry-run
  if ((dry)); then echo "$2"; else timeout -k 10 120 "$PYTHON" -c "import torch, torch_npu; print($1)" 2>/dev/null; fi
}

if ((!dry)); then
  if ! timeout -k 10 120 "$PYTHON" -c 'import torch, torch_npu, sys; sys.exit(0 if torch.npu.is_available() and torch.npu.device_count() else 1)' \
      >/dev/null 2>&1; then
    echo "npu_check.sh: no Ascend NPU here (torch_npu does not import or sees no device); run it on an Ascend node, or with --dry-run to see the plan" >&2
    exit 2
  fi
  rm -rf "$out"
fi
mkdir -p "$out"
date -u
((dry)) || npu-smi info 2>/dev/null | head -n 12
nproc="$(probe 'torch.npu.device_count()' N)"
# the precision the trainer itself chooses for this SoC (accel_train/platform/hardware.py), so the run is never refused
if ((dry)); then precision='bf16|fp16'; else
  precision="$(timeout -k 10 120 "$PYTHON" -m accel_train.platform.hardware --config_precision bf16 2>/dev/null)"; precision="${precision%% *}"
fi
versions="$(probe '"torch", torch.__version__, "torch_npu", torch_npu.__version__' 'torch ? torch_npu ?')"
echo "$versions; $nproc NPU(s), $precision"

launch=("$PYTHON" -m accelerate.commands.launch --config_file accelerate_configs/1node_npu.yaml --num_processes "$nproc"
        --mixed_precision "$precision" -m accel_train)
# 40 steps of global batch 256 x NPUs per epoch; a checkpoint every 10 steps
job=(--data random --train_samples "$((10240 * ${nproc//[^0-9]/1}))" --test_samples 2048 --epochs 2 --batch_size 256
     --model_kwargs '{"drop_rate": 0.2, "drop_path_rate": 0.1}' --checkpoint_every 10 --log_every 10)

echo "== smoke: Accelerate's test script, every rank in one HCCL group"
smoke=FAILED
run timeout -k 10 120 bash launch.sh --smoke-test --accel_config 1node_npu && smoke=ok
echo "== train: 2 epochs, $precision"
train=FAILED
run timeout -k 10 150 "${launch[@]}" "${job[@]}" --output_dir "$out/full" && train=ok
echo "== resume: stopped at step 50, random_states_*.pkl deleted, resumed with --resume auto"
resume=FAILED
if run timeout -k 10 120 "${launch[@]}" "${job[@]}" --max_steps 50 --output_dir "$out/part"; then
  run find "$out/part/checkpoints" -name 'random_states_*.pkl' -delete
  run timeout -k 10 120 "${launch[@]}" "${job[@]}" --resume auto --output_dir "$out/part" && resume=ok
fi
echo "== throughput"
summary() {
  ((dry)) && { echo "(figures)"; return; }
  "$PYTHON" - "$out" <<'EOF'
import json, sys
from pathlib import Path
from safetensors.torch import load_file
out = Path(sys.argv[1])
try:
    rows = [json.loads(r) for r in (out / "full" / "metrics.jsonl").read_text().splitlines()]
    print(f"{rows[-1]['images_per_sec']:.0f} img/s ({rows[-1]['images_per_sec_per_process']:.0f}/NPU), "
          f"test acc {rows[-1]['test_acc']:.4f}", end="; ")
    a, b = load_file(out / "full" / "model.safetensors"), load_file(out / "part" / "model.safetensors")
    print(f"resume: max weight difference {max((a[k].double() - b[k].double()).abs().max().item() for k in a):.3g}")
except Exception as e:  # a failed step above: say which file is missing
    print(f"no figures ({type(e).__name__}: {e})")
EOF
}
figures="$(summary)"
echo "$figures"

echo "== paste into bench/RESULTS.md (with the date and the hardware above)"
echo "| npu_check.sh | $versions, $nproc NPU(s), $precision | smoke $smoke | train $train | resume without RNG files $resume | $figures |"
[[ "$smoke$train$resume" == okokok ]] || ((dry))
