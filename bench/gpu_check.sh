#!/usr/bin/env bash
# GPU check, for a lent GPU machine (its own preinstalled torch, accelerate, timm, safetensors; no
# network; install nothing). From the repo root:  bash bench/gpu_check.sh   (under 5 minutes)
#   1. the bench on CUDA: resnet18, cifar stem, bf16, channels_last, without and with torch.compile
#   2. a 2-epoch random-data training run through accelerate launch (1node_gpu.yaml, 1 process)
# Paste what it prints, the date and the hardware into bench/RESULTS.md.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
out="${OUT:-/tmp}/gpu_check"
mkdir -p "$out"
date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c 'import torch, accelerate, timm, safetensors; print("torch", torch.__version__, "accelerate", accelerate.__version__, "timm", timm.__version__, "safetensors", safetensors.__version__)'

bench=(python bench/bench.py --device cuda --batch_size 512 --precision bf16 --channels_last --rounds 5 --steps 25
       --output_dir "$out/bench")
echo "== bench: eager"
timeout 150 "${bench[@]}" || echo "bench (eager) failed: exit $?"
echo "== bench: torch.compile"
timeout 240 "${bench[@]}" --compile || echo "bench (compile) failed: exit $?"
echo "== training: 2 epochs of random data (50,000 images), accelerate launch, 1node_gpu.yaml"
timeout 180 python -m accelerate.commands.launch --config_file accelerate_configs/1node_gpu.yaml --num_processes 1 \
  -m accel_train --data random --epochs 2 --batch_size 512 --channels_last --output_dir "$out/train" 2>&1 \
  | grep -v 'it/s]$' || echo "training failed"
cat "$out/train/metrics.jsonl" 2>/dev/null
