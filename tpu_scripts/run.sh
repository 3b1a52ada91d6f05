#!/usr/bin/env bash
# Run the GPT-2 training job on every worker of a TPU VM (one job per pod).
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--project PROJECT] [--num-cores 4]
       [--spmd | --per-chip] [--remote-dir xla_fsdp] [--no-default-args] [--dry-run] [-- TRAINING_ARGS...]

Runs 'PJRT_DEVICE=TPU python3 launch/xla_spawn.py --num_cores N launch/run_clm.py ARGS'
on every worker (--worker=all); PJRT joins the workers of a pod into one job.
--num-cores is the TPU devices per worker (4 on v4). run_clm runs one process per
worker driving all of its chips (single-controller runtime, asynchronous
collectives) unless --per-chip asks for one process per chip (pinned
collectives, as torch_xla's FSDP); --spmd says the default explicitly. ARGS are the 2B GPT-2 job of the PyTorch/XLA FSDP recipe, then
TRAINING_ARGS (a repeated flag: the last one wins); --no-default-args drops the
recipe's flags."
VALUE_OPTIONS=(name zone project num-cores remote-dir)
FLAG_OPTIONS=(no-default-args spmd per-chip)
OPT_NAME=""
OPT_ZONE=""
OPT_PROJECT=""
OPT_NUM_CORES="4"
OPT_REMOTE_DIR="xla_fsdp"
FLAG_NO_DEFAULT_ARGS=0
FLAG_SPMD=0
FLAG_PER_CHIP=0
parse_options "$@"
if ((FLAG_SPMD && FLAG_PER_CHIP)); then die_usage "--spmd and --per-chip contradict each other; pass one"; fi
require_options name zone
[[ "$OPT_NUM_CORES" =~ ^[1-9][0-9]*$ ]] ||
  die_usage "--num-cores must be a positive integer, got '${OPT_NUM_CORES}'"
gcloud_location_flags

RECIPE_ARGS=(
  --config_name configs/models/gpt2-2b.json
  --fsdp full_shard
  --fsdp_config configs/fsdp/gpt2_xla_fsdp.json
  --per_device_train_batch_size 32
  --block_size 1024
  --optim adafactor
  --num_train_epochs 1
  --output_dir /tmp/test-clm
)
train_args=()
if ((!FLAG_NO_DEFAULT_ARGS)); then train_args=("${RECIPE_ARGS[@]}"); fi
train_args+=("${EXTRA_ARGS[@]}")
launcher_args=(--num_cores "$OPT_NUM_CORES")
if ((FLAG_SPMD)); then launcher_args+=(--spmd); fi
if ((FLAG_PER_CHIP)); then launcher_args+=(--per_chip); fi

remote="$(remote_script \
  "$(quote_command cd "$OPT_REMOTE_DIR")" \
  "$(quote_command . .venv/bin/activate)" \
  "$(quote_command PJRT_DEVICE=TPU python3 -u launch/xla_spawn.py \
      "${launcher_args[@]}" launch/run_clm.py "${train_args[@]}")")"

run gcloud compute tpus tpu-vm ssh "$OPT_NAME" "${GCLOUD_LOCATION[@]}" --worker=all \
  "--command=${remote}"
