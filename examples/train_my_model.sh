#!/usr/bin/env bash
# Train the model in my_model.py (beside this script) with --model, on 2 CPU processes; any other accelerate config,
# or launch.sh, starts it the same way (the working directory is searched for my_model on every rank).
#   examples/train_my_model.sh --epochs 2 --output_dir /tmp/my_model_run
set -euo pipefail
cd "$(dirname "$0")"
exec "${PYTHON:-python3}" -m accelerate.commands.launch --config_file ../accelerate_configs/2proc_cpu.yaml \
  -m accel_train --model my_model:build --model_kwargs '{"width": 16}' --train_samples 256 --test_samples 64 "$@"
