#!/usr/bin/env bash
# launch.sh: the one launcher for accel_train on clusters and as a ModelArts boot command.
#
# Works out the number of machines, this machine's rank, the rank-0 host and port and the processes
# per machine, picks the accelerate config for the hardware it finds, and runs
#   python3 -m accelerate.commands.launch (accelerate launch) --config_file accelerate_configs/<cfg>.yaml
#     <what YAML cannot carry> -m accel_train <args>
#
# Sources, first match wins for each value:
#   1. explicit:   NNODES NODE_RANK MASTER_ADDR MASTER_PORT NPROC_PER_NODE
#   2. ModelArts:  MA_NUM_HOSTS|VC_WORKER_NUM  VC_TASK_INDEX  first of VC_WORKER_HOSTS  MA_NUM_GPUS
#                  (MA_NUM_GPUS=0: a CPU-only flavour) and the boot arguments
#                  --init_method tcp://HOST:PORT --rank N --world_size N
#   3. Kubeflow:   PET_NNODES PET_NODE_RANK (MASTER_ADDR MASTER_PORT) PET_NPROC_PER_NODE (a number, or the
#                  operator's default auto: the visible GPUs or NPUs, else 1; gpu: the GPUs; cpu: one CPU process);
#                  an elastic PyTorchJob (PET_NNODES=MIN:MAX, PET_RDZV_BACKEND) is refused: no elasticPolicy
#   4. SLURM:      SLURM_NNODES SLURM_NODEID  first host of the step's SLURM_STEP_NODELIST (else SLURM_NODELIST,
#                  SLURM_JOB_NODELIST)  SLURM_GPUS_ON_NODE
#   5. else one machine; processes per machine = the visible GPUs or NPUs, else 1.
# ModelArts' Ascend-Powered-Engine preset runs this file once per card (ASCEND_DEVICE_ID, RANK_ID, RANK_SIZE,
# RANK_TABLE_FILE set): only device 0's copy starts the job, for every card of the node (without npu-smi:
# RANK_SIZE / machines of them); the other copies exit 0 at once.
# NPUs: HCCL_CONNECT_TIMEOUT and HCCL_EXEC_TIMEOUT are set below the trainer's --timeout_s unless set.
# A failed collective raises in the trainer instead of ending the rank, unless you set these yourself:
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (GPUs), TORCH_HCCL_ASYNC_ERROR_HANDLING=HCCL_ASYNC_ERROR_HANDLING=0 (NPUs);
# the backend's watchdog monitor on, after --timeout_s: TORCH_{NCCL,HCCL}_ENABLE_MONITORING=1,
# TORCH_{NCCL,HCCL}_HEARTBEAT_TIMEOUT_SEC=<--timeout_s>.
# Devices: nvidia-smi (torch.cuda.device_count() without it, where it fails: a warning, or where it lists MIG
# instances), npu-smi; CUDA_VISIBLE_DEVICES and ASCEND_RT_VISIBLE_DEVICES limit them ("" or -1: none visible, so one
# CPU process).
#
# Own options (everything else goes to the trainer):
#   --dry-run             print the exact command and exit
#   --smoke-test          instead of training, run Accelerate's test script on this setup and fail
#                         unless every rank joined one group of the expected size (accel-train smoke)
#   --preflight           check the rank-0 host and port before each attempt (always done for
#                         several machines; --no-preflight skips it)
#   --rdzv_wait S         how long the preflight of a non-zero rank waits for rank 0 to come up
#                         (or ACCEL_RDZV_WAIT=S; default 600, like torchrun's rendezvous timeout)
#   --accel_config NAME   config name or path (or ACCEL_CONFIG=...); default: by hardware. A named config for
#                         one machine also gives the processes (its num_processes, at most one per visible
#                         GPU/NPU) unless NPROC_PER_NODE or the platform gives a count
#   --max_restarts N      relaunch a failed job up to N times, resuming from the newest checkpoint of
#                         the run it started (or ACCEL_MAX_RESTARTS=N; after --overwrite never the run
#                         that --overwrite replaces); only a lost peer (3) or a killed rank (137) is relaunched:
#                         bad input (2), an error (1) or divergence (5) never are
#   --restart_on_preempt  also relaunch after a preemption (exit 4) that did not come through this script
#                         (or ACCEL_RESTART_ON_PREEMPT=1); SIGTERM/SIGUSR1 to this script is passed to the
#                         job, which checkpoints and stops with exit status 4
#   -h, --help            this text
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIG_DIR="$HERE/accelerate_configs"
PYTHON="${PYTHON:-python3}"

die() { echo "launch.sh: error: $*" >&2; exit 2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

# ---- arguments: our own, the ModelArts boot arguments, and the trainer's ----------------------
dry_run=0 smoke_test=0 preflight=auto accel_config="${ACCEL_CONFIG:-}" max_restarts="${ACCEL_MAX_RESTARTS:-0}"
rdzv_wait="${ACCEL_RDZV_WAIT:-${PREFLIGHT_TIMEOUT:-600}}"
restart_on_preempt="${ACCEL_RESTART_ON_PREEMPT:-0}"
ma_init_method="" ma_rank="" ma_world_size=""
trainer_args=()
while (($#)); do
  case "$1" in
    --dry-run|--dry_run) dry_run=1 ;;
    --smoke-test|--smoke_test) smoke_test=1 ;;
    --rdzv_wait=*) rdzv_wait="${1#*=}" ;;
    --rdzv_wait) (($# > 1)) || die "--rdzv_wait needs a value"; rdzv_wait="$2"; shift ;;
    --preflight) preflight=1 ;;
    --no-preflight|--no_preflight) preflight=0 ;;
    --accel_config=*) accel_config="${1#*=}" ;;
    --accel_config) (($# > 1)) || die "--accel_config needs a value"; accel_config="$2"; shift ;;
    --max_restarts=*) max_restarts="${1#*=}" ;;
    --max_restarts) (($# > 1)) || die "--max_restarts needs a value"; max_restarts="$2"; shift ;;
    --restart_on_preempt) restart_on_preempt=1 ;;
    --init_method=*) ma_init_method="${1#*=}" ;;
    --init_method) (($# > 1)) || die "--init_method needs a value"; ma_init_method="$2"; shift ;;
    --rank=*) ma_rank="${1#*=}" ;;
    --rank) (($# > 1)) || die "--rank needs a value"; ma_rank="$2"; shift ;;
    --world_size=*) ma_world_size="${1#*=}" ;;
    --world_size) (($# > 1)) || die "--world_size needs a value"; ma_world_size="$2"; shift ;;
    -h|--help) awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) trainer_args+=("$1") ;;
  esac
  shift
done

# ModelArts' Ascend-Powered-Engine preset (rank-table mode) runs the boot file once per card, with
# ASCEND_DEVICE_ID, RANK_ID, RANK_SIZE and RANK_TABLE_FILE set; its documentation: "check the ASCEND_DEVICE_ID
# value. If it is 0, execute the logic; otherwise, exit directly" (ModelArts user guide, "Starting a Preset
# Image's Boot File"). Device 0's copy starts one process per card of this node; the other copies exit 0.
ascend_per_card=0
if [[ -n "${ASCEND_DEVICE_ID:-}" && -n "${RANK_SIZE:-}" && -n "${RANK_TABLE_FILE:-}" ]]; then
  ascend_per_card=1
  if [[ "$ASCEND_DEVICE_ID" != 0 ]]; then
    echo "launch.sh: ASCEND_DEVICE_ID=$ASCEND_DEVICE_ID: this is one copy of the boot file per card (Ascend-Powered-Engine); the job for all of this node's cards is started by device 0's copy, this copy exits" >&2
    exit 0
  fi
fi

ma_host="" ma_port=""
if [[ -n "$ma_init_method" ]]; then
  [[ "$ma_init_method" =~ ^tcp://([^:/]+|\[[0-9a-fA-F:]+\]):([0-9]+)/?$ ]] \
    || die "--init_method must look like tcp://HOST:PORT, got '$ma_init_method'"
  ma_host="${BASH_REMATCH[1]}" ma_port="${BASH_REMATCH[2]}"
fi
vc_first_host="${VC_WORKER_HOSTS:-}"
vc_first_host="${vc_first_host%%,*}"

# SLURM: rank 0 is the first node of this job step, whose nodes SLURM_NNODES / SLURM_NODEID count. Under srun,
# SLURM_STEP_NODELIST (and SLURM_NODELIST) list the step's nodes, SLURM_JOB_NODELIST the whole allocation's:
# `srun -N2 -w gpu03,gpu04` inside gpu[01-04] meets on gpu03, not gpu01. Outside srun only the job's lists exist.
slurm_first_host="" slurm_nodes="${SLURM_STEP_NODELIST:-${SLURM_NODELIST:-${SLURM_JOB_NODELIST:-}}}"
if [[ -n "$slurm_nodes" ]]; then
  if command -v scontrol >/dev/null 2>&1; then
    slurm_first_host="$(scontrol show hostnames "$slurm_nodes" | head -n 1)"
  else  # node[01-04,07],other -> node01
    first="${slurm_nodes%%,*}"
    if [[ "$slurm_nodes" =~ ^([^,\[]*)\[([0-9]+) ]]; then
      first="${BASH_REMATCH[1]}${BASH_REMATCH[2]}"
    fi
    slurm_first_host="$first"
  fi
fi

first_set() { local v; for v in "$@"; do if [[ -n "$v" ]]; then echo "$v"; return; fi; done; }

nnodes="$(first_set "${NNODES:-}" "${MA_NUM_HOSTS:-}" "${VC_WORKER_NUM:-}" "$ma_world_size" \
  "${PET_NNODES:-}" "${SLURM_NNODES:-}" 1)"
node_rank="$(first_set "${NODE_RANK:-}" "${VC_TASK_INDEX:-}" "$ma_rank" "${PET_NODE_RANK:-}" "${SLURM_NODEID:-}" 0)"
# Kubeflow's elastic PyTorchJob (an elasticPolicy): PET_NNODES "MIN:MAX" (or the worker count), PET_RDZV_BACKEND
# (c10d), PET_RDZV_ENDPOINT, and no node rank: torchrun's c10d rendezvous would rank the pods (training-operator
# pkg/controller.v1/pytorch envvar.go, elastic.go, elastic_test.go). launch.sh starts a fixed set of machines with a
# static rendezvous: refused in one line that names the form it runs, unless NNODES is given explicitly.
if [[ -z "${NNODES:-}" && ( "${PET_NNODES:-}" == *:* || -n "${PET_RDZV_BACKEND:-}${PET_RDZV_ENDPOINT:-}" ) ]]; then
  die "an elastic PyTorchJob (PET_NNODES=${PET_NNODES:-}, PET_RDZV_BACKEND=${PET_RDZV_BACKEND:-}, PET_RDZV_ENDPOINT=${PET_RDZV_ENDPOINT:-}) is not supported: launch.sh runs a fixed number of machines; remove the job's elasticPolicy and give it Master and Worker replicas (the operator then sets PET_NNODES=N, PET_NODE_RANK, MASTER_ADDR, MASTER_PORT)"
fi
master_addr="$(first_set "${MASTER_ADDR:-}" "$vc_first_host" "$ma_host" "$slurm_first_host")"
master_port="$(first_set "${MASTER_PORT:-}" "$ma_port" "")"
# MA_NUM_GPUS=0 / SLURM_GPUS_ON_NODE=0 (CPU-only flavours, CPU jobs) say "no devices", not "0 processes".
ma_gpus="${MA_NUM_GPUS:-}" slurm_gpus="${SLURM_GPUS_ON_NODE:-}"
[[ "$ma_gpus" == 0 ]] && ma_gpus=""
[[ "$slurm_gpus" == 0 ]] && slurm_gpus=""
# Kubeflow's training operator always writes PET_NPROC_PER_NODE: nprocPerNode, or "auto" when the job leaves it
# unset (training-operator pytorch_defaults.go DefaultNprocPerNode, envvar.go); "gpu" and "cpu" are allowed too.
# torchrun reads these words itself; here they are resolved once the devices are counted (below).
pet_nproc="${PET_NPROC_PER_NODE:-}" pet_word=""
if [[ "$pet_nproc" =~ ^(auto|gpu|cpu)$ ]]; then pet_word="$pet_nproc" pet_nproc=""; fi
nproc="$(first_set "${NPROC_PER_NODE:-}" "$ma_gpus" "$pet_nproc" "$slurm_gpus")"

# ---- hardware and config ----------------------------------------------------------------------
# Each count is what this process may use: the devices found, limited by the visible-device variable.
visible() {  # NAME -> number of devices NAME lets through, or nothing when NAME is unset
  [[ -v "$1" ]] || return 0
  local list="${!1}" n=0 entry entries
  IFS=, read -r -a entries <<< "$list"
  for entry in "${entries[@]}"; do  # like the CUDA runtime: stop at the first invalid entry (-1, empty)
    entry="${entry// /}"
    [[ -z "$entry" || "$entry" == -* ]] && break
    n=$((n + 1))
  done
  echo "$n"
}
cuda_count() {  # the GPUs the CUDA driver shows one process, through torch (honours CUDA_VISIBLE_DEVICES)
  timeout "${ACCEL_PROBE_TIMEOUT:-60}" "$PYTHON" -c 'import ctypes, sys
try:
    ctypes.CDLL("libcuda.so.1")
except OSError:
    print(0); sys.exit()
import torch
print(torch.cuda.device_count())' 2>/dev/null || true
}
count_nvidia() {  # what CUDA will show each process: nvidia-smi's GPUs, or CUDA's own count where nvidia-smi cannot say
  command -v nvidia-smi >/dev/null 2>&1 || { cuda_count; return; }  # an image without nvidia-smi
  local listing n what
  if ! listing="$(timeout "${ACCEL_PROBE_TIMEOUT:-60}" nvidia-smi -L 2>&1)"; then  # a broken driver, a hung GPU
    n="$(cuda_count)"
    is_uint "$n" || n=0
    what="counting the $n GPU(s) CUDA shows"
    ((n)) || what="CUDA shows no GPU either: a CPU job"
    echo "launch.sh: warning: nvidia-smi fails ($(head -n 1 <<< "${listing:-no output}")): $what" >&2
    echo "$n"
  elif grep -q '^ *MIG ' <<< "$listing"; then
    # a MIG instance is listed under its physical GPU; CUDA shows one process a single MIG instance, whatever
    # CUDA_VISIBLE_DEVICES lists (NVIDIA MIG User Guide, "CUDA Device Enumeration"): count as CUDA does
    n="$(cuda_count)"
    is_uint "$n" || n=1
    echo "launch.sh: MIG instances here ($(grep -c '^ *MIG ' <<< "$listing") listed by nvidia-smi -L): CUDA shows a process one of them: $n GPU(s) counted" >&2
    echo "$n"
  else
    grep -c '^GPU ' <<< "$listing" || true
  fi
}
count_npu() {
  command -v npu-smi >/dev/null 2>&1 || return 0
  npu-smi info -l 2>/dev/null | awk -F: '/Total Count/ {gsub(/ /, "", $2); print $2; exit}'
}
ascend_cards_per_node() {  # without npu-smi: RANK_SIZE counts the rank table's cards, all nodes together
  if ! is_uint "$RANK_SIZE" || ((RANK_SIZE < 1)); then die "RANK_SIZE must be a positive integer, got '$RANK_SIZE'"; fi
  if ! is_uint "$nnodes" || ((nnodes < 1)); then echo "$RANK_SIZE"; return; fi  # (a bad count is reported below)
  ((RANK_SIZE % nnodes == 0)) || die "RANK_SIZE=$RANK_SIZE cards cannot be split evenly over $nnodes machines"
  echo $((RANK_SIZE / nnodes))
}
limit() { local found="${1:-0}" shown="$2"; is_uint "$found" || found=0; if [[ -n "$shown" ]] && ((shown < found)); then echo "$shown"; else echo "$found"; fi; }
n_gpu="$(limit "$(count_nvidia)" "$(visible CUDA_VISIBLE_DEVICES)")"
n_npu="$(count_npu)"
if ((ascend_per_card)) && [[ -z "$n_npu" ]]; then n_npu="$(ascend_cards_per_node)"; fi
n_npu="$(limit "$n_npu" "$(visible ASCEND_RT_VISIBLE_DEVICES)")"
if ((n_gpu > 0)); then device=gpu found="$n_gpu"
elif ((n_npu > 0)); then device=npu found="$n_npu"
else device=cpu found=1
fi
if [[ -n "$pet_word" && -z "$nproc" ]]; then  # as torchrun: the visible devices, but one process on a CPU node
  case "$pet_word" in  # (torchrun starts one per CPU core there: they would only compete for the cores)
    cpu) device=cpu found=1 ;;  # a CPU job, even where GPUs are visible
    gpu) ((n_gpu > 0)) || die "PET_NPROC_PER_NODE=gpu but no GPU is visible here (torchrun refuses it too: 'Cuda is not available'); set the PyTorchJob's nprocPerNode to auto, cpu or a number" ;;
  esac
  nproc="$found"
fi
if [[ -z "${NPROC_PER_NODE:-}$pet_nproc$pet_word" && -n "$nproc" ]] && is_uint "$nproc"; then
  # MA_NUM_GPUS / SLURM_GPUS_ON_NODE count the machine's devices; only the visible ones get a process.
  if [[ "$device" != cpu ]] && ((nproc > found)); then
    echo "launch.sh: the platform says $nproc devices, $found are visible here: $found process(es)" >&2
    nproc="$found"
  elif [[ "$device" == cpu ]]; then
    echo "launch.sh: warning: the platform says $nproc devices, but no GPU or NPU is visible here; running $nproc CPU processes" >&2
  fi
fi
platform_nproc="$nproc"  # a process count the platform or NPROC_PER_NODE gave (empty: none)
nproc="${nproc:-$found}"

for pair in "nnodes=$nnodes" "node_rank=$node_rank" "nproc_per_node=$nproc" "max_restarts=$max_restarts" "rdzv_wait=$rdzv_wait"; do
  is_uint "${pair#*=}" || die "${pair%%=*} must be a non-negative integer, got '${pair#*=}' (check NNODES/NODE_RANK/NPROC_PER_NODE or the platform variables)"
done
((nnodes >= 1)) || die "the number of machines must be >= 1, got $nnodes"
((nproc >= 1)) || die "processes per machine must be >= 1, got $nproc"
((node_rank < nnodes)) || die "this machine's rank $node_rank is not below the number of machines $nnodes"
if [[ -n "$master_port" ]]; then
  if ! is_uint "$master_port" || ((master_port < 1 || master_port > 65535)); then
    die "MASTER_PORT must be a port number, got '$master_port'"
  fi
fi
rank0_at=""  # (the start line's: one machine needs no rendezvous address, and ModelArts gives it no port)
if ((nnodes > 1)); then
  [[ -n "$master_addr" ]] || die "$nnodes machines but no rank-0 host: set MASTER_ADDR (or VC_WORKER_HOSTS, --init_method tcp://HOST:PORT, SLURM_STEP_NODELIST)"
  master_port="${master_port:-29500}"
  rank0_at=", rank 0 at $master_addr:$master_port"
fi

named_config="$accel_config"  # a config the user named keeps its precision where the device has it
if [[ -z "$accel_config" ]]; then
  case "$device:$((nnodes > 1)):$((nproc > 1))" in
    cpu:0:0) accel_config=cpu ;;
    cpu:0:1) accel_config=2proc_cpu ;;
    cpu:1:*) accel_config=2node_cpu ;;
    gpu:0:*) accel_config=1node_gpu ;;
    gpu:1:*) accel_config=2node_gpu ;;
    npu:0:*) accel_config=1node_npu ;;
    npu:1:*) accel_config=2node_npu ;;
  esac
fi
config_file="$accel_config"
[[ -f "$config_file" ]] || config_file="$CONFIG_DIR/${accel_config%.yaml}.yaml"
[[ -f "$config_file" ]] || die "accelerate config '$accel_config' not found (looked for it as a path and in $CONFIG_DIR); name one of: $(cd "$CONFIG_DIR" && printf '%s ' *.yaml)"
if grep -qE '^use_cpu: *true' "$config_file"; then device=cpu; fi
if grep -qE '^distributed_type: *MULTI_NPU' "$config_file"; then device=npu; fi
# A config named on one machine that states its own process count (num_machines: 1) gets that count, unless
# the platform or NPROC_PER_NODE gave one; on GPUs/NPUs at most one process per visible device.
if [[ -n "$named_config" && -z "$platform_nproc" ]] && ((nnodes == 1)); then
  cfg_machines="$(sed -nE 's/^num_machines: *([0-9]+).*/\1/p' "$config_file" | head -n 1)"
  cfg_nproc="$(sed -nE 's/^num_processes: *([0-9]+).*/\1/p' "$config_file" | head -n 1)"
  if [[ "${cfg_machines:-1}" == 1 && -n "$cfg_nproc" ]] && ((cfg_nproc >= 1)); then
    nproc="$cfg_nproc"
    if [[ "$device" != cpu ]] && ((nproc > found)); then nproc="$found"; fi
  fi
fi

# ---- environment these platforms need ---------------------------------------------------------
# A dead peer must be found by the trainer's own collective timeout (--timeout_s) on every backend. torch_npu
# asks for a process-group timeout above HCCL's own (HCCL_CONNECT_TIMEOUT, default 120 s, 120..7200;
# HCCL_EXEC_TIMEOUT, default 1836 s, a multiple of 68 on 910A), so HCCL's are set below --timeout_s unless
# the user set them (the trainer then refuses values that are not below it). HCCL_EXEC_TIMEOUT at most 17340:
# CANN's bound for the Atlas training series (910A), (0, 17340]; A2/A3 take up to 2147483647, the smaller holds
# for all (CANN 8.0.0 environment variable reference, HCCL_EXEC_TIMEOUT,
# https://www.hiascend.com/document/detail/zh/canncommercial/800/apiref/envvar/envref_07_0078.html;
# accel_train/accelerator.py HCCL_EXEC_TIMEOUT_MAX).
HCCL_EXEC_TIMEOUT_MAX=17340
DEFAULT_TIMEOUT_S=300  # TrainConfig.timeout_s (tests/test_platform_faults.py checks that they agree)
DEFAULT_HEARTBEAT_TIMEOUT_S=15  # TrainConfig.heartbeat_timeout_s (the same test)
trainer_seconds() {  # $1 a flag, $2 its default: whole seconds as the trainer will read it (the last one given wins,
  local value="$2" i  # as in argparse)
  for ((i = 0; i < ${#trainer_args[@]}; i++)); do
    case "${trainer_args[i]}" in
      "$1"=*) value="${trainer_args[i]#*=}" ;;
      "$1") value="${trainer_args[i + 1]:-}" ;;
    esac
  done
  if [[ "$value" =~ ^([0-9]+)(\.([0-9]*))?$ ]]; then  # (whole seconds, rounded up; 08 is decimal)
    value=$((10#${BASH_REMATCH[1]}))
    if [[ "${BASH_REMATCH[3]}" =~ [1-9] ]]; then value=$((value + 1)); fi
  else
    value="$2"  # the trainer reports a bad value itself (1e2, a --config file's value: not read here)
  fi
  echo "$value"
}
trainer_timeout_s() { trainer_seconds --timeout_s "$DEFAULT_TIMEOUT_S"; }
# How long a rank may stay stopped (state T) in a job of several processes: as long as its peers' heartbeat waits for
# it (--heartbeat_timeout_s), or their collective timeout where heartbeats are off (0), plus FROZEN_MARGIN_S (the
# peers, whose last beat came up to --heartbeat_s before the stop, give up first); none in a one-process job.
FROZEN_MARGIN_S=3
frozen_limit_s() {
  local beat
  ((nnodes * nproc > 1)) || { echo 0; return; }
  beat="$(trainer_seconds --heartbeat_timeout_s "$DEFAULT_HEARTBEAT_TIMEOUT_S")"
  if ((beat == 0)); then beat="$(trainer_timeout_s)"; fi
  echo $((beat + FROZEN_MARGIN_S))
}
is_rank() {  # $1 a pid: a rank torchrun started (LOCAL_RANK set, not in its parent: not a DataLoader worker, not the agent)
  local stat parent
  grep -qsaz '^LOCAL_RANK=' "/proc/$1/environ" || return 1
  stat="$(cat "/proc/$1/stat" 2>/dev/null)" || return 1
  parent="${stat##*) }"; parent="${parent#* }"; parent="${parent%% *}"
  ! grep -qsaz '^LOCAL_RANK=' "/proc/$parent/environ"
}
hccl_timeouts() {  # --timeout_s -> "CONNECT EXEC": three quarters of it, EXEC a multiple of 68 in 68..17340
  local budget=$(($1 * 3 / 4))
  local connect=$((budget < 120 ? 120 : (budget > 7200 ? 7200 : budget))) exec=$((budget / 68 * 68))
  exec=$((exec < 68 ? 68 : (exec > HCCL_EXEC_TIMEOUT_MAX ? HCCL_EXEC_TIMEOUT_MAX : exec)))
  echo "$connect" "$exec"
}
# A failed collective reaches the trainer as an exception instead of ending the rank (docs/failures.md): NCCL's
# watchdog aborts the communicator without SIGABRT (TORCH_NCCL_ASYNC_ERROR_HANDLING=2, PyTorch's default 3 tears the
# rank down); HCCL leaves the collective to HCCL_EXEC_TIMEOUT ({TORCH_,}HCCL_ASYNC_ERROR_HANDLING=0, default 1). A
# value the user set under either name is kept (accel_train/accelerator.py FAILURE_ENV: the same; torchrun passes
# this environment to every rank).
set_unless_given() {  # VALUE NAME...: every NAME=VALUE, unless one of the NAMEs is set
  local value="$1" name; shift
  for name in "$@"; do [[ -n "${!name:-}" ]] && return; done
  for name in "$@"; do env_vars+=("$name=$value"); done
}
env_vars=(PYTHONUNBUFFERED=1 "PYTHONPATH=$HERE${PYTHONPATH:+:$PYTHONPATH}")
case "$device" in
  cpu) env_vars+=(ACCELERATE_USE_CPU=1) ;;
  gpu) [[ -n "${NCCL_ASYNC_ERROR_HANDLING:-}" ]] || set_unless_given 2 TORCH_NCCL_ASYNC_ERROR_HANDLING
       set_unless_given 1 TORCH_NCCL_ENABLE_MONITORING  # (accelerator.py MONITOR_ENV: the watchdog's monitor)
       set_unless_given "$(trainer_timeout_s)" TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC ;;
  npu) read -r hccl_connect hccl_exec <<< "$(hccl_timeouts "$(trainer_timeout_s)")"
       if [[ -z "${HCCL_EXEC_TIMEOUT:-}" ]] && ((hccl_exec == HCCL_EXEC_TIMEOUT_MAX)); then
         echo "launch.sh: HCCL_EXEC_TIMEOUT=$hccl_exec: capped at CANN's upper bound (Atlas training series), below three quarters of --timeout_s" >&2
       fi
       env_vars+=("HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-$hccl_connect}" "HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-$hccl_exec}")
       set_unless_given 0 TORCH_HCCL_ASYNC_ERROR_HANDLING HCCL_ASYNC_ERROR_HANDLING
       set_unless_given 1 TORCH_HCCL_ENABLE_MONITORING
       set_unless_given "$(trainer_timeout_s)" TORCH_HCCL_HEARTBEAT_TIMEOUT_SEC ;;
esac
if ((ascend_per_card)); then  # they describe the one card this copy was started for, not the job's ranks
  unset ASCEND_DEVICE_ID RANK_ID RANK_SIZE
fi
for var in GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME HCCL_SOCKET_IFNAME HCCL_IF_IP TP_SOCKET_IFNAME; do
  if [[ -n "${!var:-}" ]]; then env_vars+=("$var=${!var}"); fi
done

# ---- the command ------------------------------------------------------------------------------
launch_args=(--config_file "$config_file" --num_machines "$nnodes" --num_processes "$((nnodes * nproc))")
if ((nnodes > 1)); then
  launch_args+=(--machine_rank "$node_rank" --main_process_ip "$master_addr" --main_process_port "$master_port"
                --rdzv_backend static --same_network)
elif [[ -n "$master_port" ]]; then
  launch_args+=(--main_process_port "$master_port")
fi
# The config must load with accelerate's own loader (an unknown key is an error), before anything starts
# (and before the precision probe prints its line); a file that loaded before is not read again
# (accel_train/accel_config.py).
# Status 3: the interpreter cannot import accelerate (a venv not activated): say which one, not "invalid config".
if ((dry_run == 0)); then
  check_err="$(mktemp)"
  check_status=0
  problem="$(PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m accel_train.accel_config "$config_file" \
    2>"$check_err")" || check_status=$?
  last_err="$(grep -v '^\s*$' "$check_err" | sed -n '$p' || true)"
  rm -f "$check_err"
  case "$check_status" in
    0) ;;
    1) die "accelerate config $config_file is invalid: ${problem:-it does not load}" ;;
    3) die "$problem" ;;
    *) die "$PYTHON ($(command -v "$PYTHON" || echo 'not found')) could not check accelerate config $config_file: ${last_err:-exit status $check_status}" ;;
  esac
fi

# Precision: one the device has (accel_train/hardware.py; docs/speed.md: Precision and memory format per platform):
# bf16 where native, fp16 with loss scaling on pre-Ampere GPUs and Ascend 910A, fp32 on CPUs without bf16.
# Our own configs get the device's best; a config the user named keeps its own where the device has it (one that
# states no mixed_precision, as our CPU configs, leaves it to the device too).
# Skipped when the trainer's --mixed_precision (or --force_precision) decides, and in --dry-run on GPU/NPU (the probe imports torch)
# unless ACCEL_TRAIN_DEVICE_FACTS states the facts.
config_precision="$(sed -nE "s/^mixed_precision: *['\"]?([A-Za-z0-9]+)['\"]?.*/\1/p" "$config_file" | head -n 1)"
asked_by_flag=0
for arg in "${trainer_args[@]}"; do [[ "$arg" == --mixed_precision* || "$arg" == --force_precision* ]] && asked_by_flag=1; done
if ((asked_by_flag == 0)) && [[ "$device" == cpu || "$dry_run" == 0 || -n "${ACCEL_TRAIN_DEVICE_FACTS:-}" ]]; then
  probe=(--config_precision "$config_precision")
  [[ "$device" == cpu ]] && probe+=(--cpu)
  [[ -n "$named_config" ]] && probe+=(--keep)
  chosen="$(PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" timeout "${ACCEL_PROBE_TIMEOUT:-60}" \
    "$PYTHON" -m accel_train.hardware "${probe[@]}" 2>/dev/null || true)"
  precision="${chosen%% *}"
  if [[ "$precision" =~ ^(no|fp16|bf16)$ ]]; then
    echo "launch.sh: ${chosen#* }" >&2
    if [[ "$precision" != "${config_precision:-no}" ]]; then launch_args+=(--mixed_precision "$precision"); fi
    # launch.sh's own pick (not a precision the user's named config asked for): the trainer's start-up check may
    # fall back to fp32 where this precision computes wrong gradients for the run's shapes (docs/speed.md: Precision)
    if [[ -z "$named_config" || -z "$config_precision" || "$precision" != "$config_precision" ]]; then
      env_vars+=("ACCEL_TRAIN_AUTO_PRECISION=$precision")
    fi
  else
    echo "launch.sh: warning: could not read the device's precision facts; the config's mixed_precision (${config_precision:-no}) stays" >&2
  fi
fi
if ((smoke_test)); then  # Accelerate's test script on the same launch arguments, checked for the group size
  cmd=("$PYTHON" -m accel_train smoke "${launch_args[@]}")
else
  # `accelerate launch` itself, run by the same Python as the probes above (not whichever `accelerate` is first on
  # PATH) and without the `accelerate` command's imports of all its subcommands (estimate-memory imports timm
  # and torchvision: ~3.5 s more CPU at every start of a 2-core machine)
  # ACCEL_TRAIN_SCRIPT=my_script.py: your script (it calls accel_train.train(); docs/own_data_and_models.md: Your own model) in its place
  entry=(-m accel_train) && [[ -n "${ACCEL_TRAIN_SCRIPT:-}" ]] && entry=("$ACCEL_TRAIN_SCRIPT")
  cmd=("$PYTHON" -m accelerate.commands.launch "${launch_args[@]}" "${entry[@]}" "${trainer_args[@]}")
fi

if ((dry_run)); then
  printf '%q ' env "${env_vars[@]}" "${cmd[@]}"; echo
  exit 0
fi

# Before each attempt: the rank-0 host resolves and rank 0 can listen (rank 0), or its port answers
# within --rdzv_wait seconds (other ranks: machines may start minutes apart). It prints its own one-line cause.
run_preflight() {
  if [[ "$preflight" == 1 || ( "$preflight" == auto && nnodes -gt 1 ) ]]; then
    run_child env "${env_vars[@]}" "$PYTHON" -m accel_train preflight --host "${master_addr:-127.0.0.1}" \
      --port "${master_port:-29500}" --rank "$node_rank" --timeout "$rdzv_wait" >&2 || stopped_before_start || exit 2
  fi
}
stopped_before_start() {
  if [[ -n "$signalled" ]]; then
    echo "launch.sh: stopped by SIG$signalled before the job started (nothing to save)" >&2; exit 4
  fi
  return 1
}

# Preemption: SIGTERM / SIGUSR1 to this script go to what it runs as SIGTERM (the trainer checkpoints and
# exits 4). The job is started with SIGUSR1 ignored: torchrun's agent has no handler for it and would die
# (the trainer installs its own). Children run in the background so a signal is handled at once.
# Ctrl-C: the job runs in a session of its own (torchrun puts each rank in one too), so the terminal's SIGINT
# reaches this script only, which passes each one on as SIGINT: torchrun's agent sends the first to the
# ranks (they checkpoint and exit 4) and a second as SIGTERM (they stop at once, exit 130).
# The signal goes to the job's process group but its launcher: with one process, accelerate's simple launcher does
# not pass signals on to the trainer, and answers one by SIGTERMing the trainer and SIGKILLing it 5 s later
# (accelerate 1.15 commands/launch.py _terminate_process_tree: a Ctrl-C then read as a second one, the step lost;
# campaign seed 1463180775), so the trainer (and its workers) alone hear it. torchrun's ranks run in sessions of their
# own: its group is the agent alone, which gets the signal and passes it on to its ranks.
child="" signalled="" own_group=0
command -v setsid >/dev/null && own_group=1
group_but_leader() {  # $1 a process group: its members other than its leader
  local f stat pgrp
  for f in /proc/[0-9]*/stat; do
    stat="$(cat "$f" 2>/dev/null)" || continue
    read -r _ _ pgrp _ <<< "${stat##*) }"
    f="${f#/proc/}"; f="${f%/stat}"
    if [[ "$pgrp" == "$1" && "$f" != "$1" ]]; then echo "$f"; fi
  done
}
forward() {
  signalled="${signalled:-$1}"
  local sig others=(); sig="$([[ "$1" == INT ]] && echo INT || echo TERM)"
  if [[ -z "$child" ]]; then return 0; fi
  if ((own_group)); then
    mapfile -t others < <(group_but_leader "$child")
    if ((${#others[@]})); then kill -s "$sig" "${others[@]}" 2>/dev/null || true
    else kill -s "$sig" -- "-$child" 2>/dev/null || true; fi
  else
    kill -s "$sig" "$child" 2>/dev/null || true
  fi
}
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT
trap 'forward TERM' HUP  # the terminal closed: the job (in its own session) would not hear of it
run_child() {  # run "$@" in the background, wait for it through any signal, return its status
  local status=0
  ( trap '' USR1; if ((own_group)); then exec setsid -w "$@"; else exec "$@"; fi ) &
  child=$!
  wait "$child" || status=$?
  while kill -0 "$child" 2>/dev/null; do status=0; wait "$child" || status=$?; done
  local waited=0  # the launcher is gone; a trainer it left (a signal) may still be writing its checkpoint
  while ((own_group && waited < 600)) && kill -0 -- "-$child" 2>/dev/null; do sleep 0.1; waited=$((waited + 1)); done
  child=""
  return "$status"
}

if ((smoke_test)); then
  run_preflight
  run_child env "${env_vars[@]}" "${cmd[@]}" || exit $?
  exit 0
fi

# The trainer's own exit status (accelerate launch returns 1 for any failed worker): every rank writes
# it to a file in ACCEL_TRAIN_STATUS_DIR; the most telling one decides what happens next.
# A rank that ended by SIGABRT wrote none: NCCL's watchdog (TORCH_NCCL_ASYNC_ERROR_HANDLING 1 or 3, the user's own)
# aborts a rank at the process-group timeout without a Python exception. Each rank's faulthandler notes
# the abort in ACCEL_TRAIN_STATUS_DIR/faults/; such a rank counts as a lost peer (3), and the SIGTERM that
# torchrun then sends the other ranks does not make their exit a preemption. Not in a gloo group (the note's
# "backend: gloo" line): gloo raises a lost peer in the rank's own thread and aborts only when a collective breaks its
# rules (a collective mismatch: "Is there a distributed collective mismatch in your code?"), a bug: an error (1),
# whatever the "lost contact" of the other ranks (accel_train/errors.py note_backend).
# A rank killed outright (SIGKILL: kill -9, the OOM killer) writes nothing: its note says neither a fault nor
# Python's exit ("exit: python") and no status file bears its name; accelerate would say 1, an error, which is not
# relaunched. It is 137 (128 + SIGKILL), relaunched, unless another rank says more (a survivor's lost peer, 3).
# Most telling first: bad input, diverged, a gloo rank aborted (a bug), an aborted rank (a lost peer), error, a
# second Ctrl-C, preempted, lost peer, killed. The order of STATUS_PRIORITY in accel_train/errors.py
# (tests/test_errors.py checks the two agree).
STATUS_PRIORITY="2 5 crash abort 1 130 4 3 137"
trainer_status() {
  local codes c
  codes=" $(cat "$1"/* 2>/dev/null | tr '\n' ' ' || true) "
  for c in $STATUS_PRIORITY; do
    if [[ "$c" == crash ]]; then
      if crashed "$1"; then echo 1; return; fi
    elif [[ "$c" == abort ]]; then
      if aborted "$1"; then echo 3; return; fi
    elif [[ "$c" == 137 ]]; then
      if [[ -n "$(killed_ranks "$1")" ]]; then echo 137; return; fi
    elif [[ "$codes" == *" $c "* ]]; then
      echo "$c"; return
    fi
  done
}
abort_backends() {  # one line per rank that ended by SIGABRT: its process group's backend (none: before the group)
  local note
  for note in "$1"/faults/*; do
    grep -qs '^Fatal Python error: Aborted' "$note" || continue
    sed -n 's/^backend: //p' "$note" | grep . || echo none
  done
}
killed_ranks() {  # host-pid of each rank that ended without a fault, without Python's exit and without a status
  local note
  for note in "$1"/faults/*; do
    [[ -f "$note" && ! -e "$1/${note##*/}" ]] || continue
    grep -qs -e '^Fatal Python error' -e '^exit: python' "$note" || echo "${note##*/}"
  done
}
finished() {  # every rank of this machine wrote status 0: the run ended, whatever its launcher says
  local n=0 f
  for f in "$1"/*; do
    [[ -f "$f" ]] || continue
    [[ "$(cat "$f")" == 0 ]] || return 1
    n=$((n + 1))
  done
  ((n == nproc))
}
aborted() { local b; b="$(abort_backends "$1")"; [[ -n "$b" ]] && grep -qvx gloo <<< "$b"; }
crashed() { local b; b="$(abort_backends "$1")"; grep -qx gloo <<< "$b"; }

# Ranks of this attempt that outlive its launcher (torchrun starts each in a session of its own: a SIGKILLed agent
# leaves them running) stop by themselves with a checkpoint (exit 3, accel_train/preempt.py watch_launcher); nothing
# is relaunched, and no status read, before every process this attempt started on this machine (found by the
# ACCEL_TRAIN_STATUS_DIR in its environment) has ended. Past RANK_STOP_S they are SIGKILLed (issue 33 item 3).
RANK_STOP_S="${ACCEL_RANK_STOP_S:-120}"
attempt_pids() {  # every process of the attempt whose status folder is $1 (one grep: a grep per process took ~1 s
  local env pid  # of a loaded 2-core machine per look, before every relaunch)
  grep -lsazxF "ACCEL_TRAIN_STATUS_DIR=$1" /proc/[0-9]*/environ | while read -r env; do
    pid="${env#/proc/}"; pid="${pid%/environ}"
    if ((pid != $$)); then echo "$pid"; fi
  done
}
# A process that cannot answer (stopped, state T: SIGSTOP, a frozen rank) once the job stops is SIGKILLed at once:
# torchrun's agent SIGTERMs the other ranks when one has ended and SIGKILLs them only after its 30-s grace
# (pytorch#119856), and a stopped process never acts on a SIGTERM. While the attempt runs: checked from the first
# status a rank wrote (a survivor's 3; issue 37 item 2).
kill_stopped() {  # $1...: the attempt's processes
  local pid stat state stopped=()
  for pid in "$@"; do
    stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || continue
    state="${stat##*) }"; state="${state%% *}"
    if [[ "$state" == [Tt] ]]; then stopped+=("$pid"); fi
  done
  ((${#stopped[@]})) || return 0
  echo "launch.sh: process(es) ${stopped[*]} of this attempt are stopped (state T) and cannot answer the job's stop: killed at once (SIGKILL)" >&2
  kill -9 "${stopped[@]}" 2>/dev/null || true
}
# A rank stopped for longer than frozen_limit_s has been given up by its peers (their survivor saves, exit 3). Where
# no rank of this machine is left to write a status (one process here: issue 36, seed 1856883070, a frozen rank on
# machine 0 of two hosts kept its launcher, and so the next rendezvous, waiting for ever), it is killed: its launcher
# then ends and launch.sh relaunches this machine into the job's next attempt. Only where every rank of this machine
# is stopped (a running one speaks for it), and ranks only: a stopped agent or DataLoader worker is left to the
# ranks' own watches (their launcher's end, --timeout_s).
watch_stopped() {  # in the background for the whole attempt: $1 its status folder, $2 frozen_limit_s (0: none)
  local f pid stat state tick=0 ranks frozen=()
  local -A since=()
  # (until launch.sh itself is gone: SIGKILLed, it would leave this loop running for ever; campaign seed 89765507)
  while sleep 0.5 && kill -0 "$$" 2>/dev/null; do
    for f in "$1"/*; do
      if [[ -f "$f" ]]; then mapfile -t pids < <(attempt_pids "$1"); kill_stopped "${pids[@]}"; break; fi
    done
    tick=$((tick + 1))
    if (($2 == 0 || tick % 2)); then continue; fi  # (a look a second)
    mapfile -t pids < <(attempt_pids "$1")
    frozen=() ranks=0
    for pid in "${pids[@]}"; do
      is_rank "$pid" || continue
      ranks=$((ranks + 1))
      stat="$(cat "/proc/$pid/stat" 2>/dev/null)" || continue
      state="${stat##*) }"; state="${state%% *}"
      if [[ "$state" == T ]]; then frozen+=("$pid"); fi  # (t: a debugger's stop, left alone)
    done
    # a rank of this machine still running speaks for it (its survivor's status: kill_stopped above)
    if ((${#frozen[@]} == 0 || ${#frozen[@]} < ranks)); then since=(); continue; fi
    for pid in "${frozen[@]}"; do
      since[$pid]="${since[$pid]:-$SECONDS}"
      if ((SECONDS - since[$pid] >= $2)); then
        echo "launch.sh: rank process $pid of this attempt has been stopped (state T) for $((SECONDS - since[$pid])) s, longer than its peers wait for it (--heartbeat_timeout_s): killed (SIGKILL), so that this machine joins the job's next attempt" >&2
        kill -9 "$pid" 2>/dev/null || true
        unset "since[$pid]"
      fi
    done
  done
}
ranks_ended() {
  local pid env left waited=0 said=0 termed=0
  while true; do
    # every process of this attempt (its environment names this attempt's folder: never a reused pid), found
    # whatever it has reached: a rank still importing, blocked in the rendezvous, or training
    mapfile -t left < <(attempt_pids "$1")
    ((${#left[@]})) || return 0
    kill_stopped "${left[@]}"
    if ((said == 0)); then
      echo "launch.sh: the launcher ended but process(es) ${left[*]} of this attempt still run: waiting for them to stop (the ranks checkpoint the step they reached)" >&2
      said=1
    fi
    if [[ -n "$signalled" ]] && ((termed == 0)); then  # this script was told to stop: so are they
      kill -s TERM "${left[@]}" 2>/dev/null || true
      termed=1
    fi
    if ((waited >= RANK_STOP_S * 2)); then
      echo "launch.sh: process(es) ${left[*]} did not stop within ${RANK_STOP_S} s: killed" >&2
      kill -9 "${left[@]}" 2>/dev/null || true
      sleep 1
      return 0
    fi
    sleep 0.5; waited=$((waited + 1))
  done
}

# One run id for every attempt (the trainer's ACCEL_TRAIN_RUN_ID: a fresh run takes it): a relaunch of an --overwrite
# run (then --overwrite with --resume auto) resumes that run's own checkpoints only, never the run it replaces.
printf -v run_id '%08x%04x' "${SRANDOM:-$((RANDOM << 15 | RANDOM))}" "$RANDOM"  # (bash alone: no od on PATH)
attempt=0
while true; do
  run_preflight
  echo "launch.sh: machine $node_rank of $nnodes, $nproc process(es) here, config $(basename "$config_file")${rank0_at} (attempt $((attempt + 1)) of $((max_restarts + 1)))" >&2
  stopped_before_start || true
  status_dir="$(mktemp -d "${TMPDIR:-/tmp}/accel_train_status.XXXXXX")"
  status=0
  watch_stopped "$status_dir" "$(frozen_limit_s)" &
  watcher=$!
  run_child env "${env_vars[@]}" ACCEL_TRAIN_STATUS_DIR="$status_dir" ACCEL_TRAIN_RUN_ID="$run_id" "${cmd[@]}" || status=$?
  kill "$watcher" 2>/dev/null || true
  wait "$watcher" 2>/dev/null || true
  ranks_ended "$status_dir"
  reported="$(trainer_status "$status_dir")"
  # A stop signal that came as the run ended (issue 36, the fault campaign): the ranks finished (status 0) but their
  # launcher died of the signal passed on to its group (accelerate's simple launcher: 143; torchrun's agent: 1)
  # A stop signal while the job started (issue 36, seed 1998505072): the ranks died of it before their handlers were
  # installed (no status, no note of any rank); as a signal before the job started, nothing to save: exit 4
  if ((status != 0)) && [[ -n "$signalled" && -z "$reported" ]] && ! compgen -G "$status_dir/*" >/dev/null; then
    echo "launch.sh: stopped by SIG$signalled while the job started (nothing to save)" >&2
    rm -rf "$status_dir"
    exit 4
  fi
  if ((status != 0)) && [[ -z "$reported" ]] && finished "$status_dir"; then
    echo "launch.sh: the launcher ended with status $status, but every rank here had finished the run: exit status 0" >&2
    status=0
  fi
  if [[ "$reported" == 3 ]] && aborted "$status_dir"; then
    echo "launch.sh: a rank ended by SIGABRT (NCCL's watchdog does this at the --timeout_s collective timeout when a peer is gone): a lost peer (exit status 3)" >&2
  elif [[ "$reported" == 137 ]]; then
    killed="$(killed_ranks "$status_dir")"
    echo "launch.sh: a rank was killed by a signal it cannot handle (SIGKILL: kill -9, the OOM killer; host-pid ${killed//$'\n'/ }) and reported nothing: exit status 137" >&2
  elif [[ "$reported" == 1 ]] && crashed "$status_dir"; then
    echo "launch.sh: a rank of a gloo process group ended by SIGABRT: gloo aborts only when a collective breaks its rules, e.g. ranks passing tensors of different sizes ('collective mismatch' above), a bug; the other ranks' 'lost contact' is that rank's end" >&2
  fi
  rm -rf "$status_dir"
  if ((status == 0)); then exit 0; fi
  case "$reported" in
    2) echo "launch.sh: bad input (exit status 2, the cause is above); not relaunched" >&2; exit 2 ;;
    5) echo "launch.sh: the training diverged (exit status 5); not relaunched" >&2; exit 5 ;;
    1) echo "launch.sh: the trainer failed with an error (exit status 1, traceback above); not relaunched" >&2; exit 1 ;;
    130) echo "launch.sh: stopped at once by a second Ctrl-C (exit status 130): no checkpoint of this step" >&2; exit 130 ;;
    4) if [[ -n "$signalled" || "$restart_on_preempt" != 1 ]]; then
         echo "launch.sh: preempted (exit status 4): a checkpoint of the reached step was written; continue with --resume auto" >&2
         exit 4
       fi ;;
  esac
  # a lost peer (3), a rank killed outright (137; or nothing reported), or a preemption --restart_on_preempt relaunches
  status="${reported:-$status}"
  if [[ -n "$signalled" ]]; then
    echo "launch.sh: stopped by SIG$signalled (exit status $status)" >&2; exit "$status"
  fi
  if ((attempt >= max_restarts)); then
    echo "launch.sh: the job failed with exit status $status after $((attempt + 1)) attempt(s)" >&2
    exit "$status"
  fi
  attempt=$((attempt + 1))
  echo "launch.sh: the job failed (exit status $status); relaunching to resume from the newest checkpoint" >&2
  sleep "${ACCEL_RESTART_DELAY:-1}"  # (the recovery's start-up: docs/failures.md, What a failure costs)
  if ((attempt == 1)); then cmd+=(--resume auto); fi
done
