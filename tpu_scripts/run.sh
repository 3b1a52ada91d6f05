#!/usr/bin/env bash
# Run the GPT-2 training job on every worker of a TPU VM (one job per pod), or of every slice of a Multislice job.
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--project PROJECT] [--num-cores 4] [--node-count 1]
       [--spmd | --per-chip] [--remote-dir xla_fsdp] [--auto-resume N] [--no-default-args] [--dry-run]
       [-- TRAINING_ARGS...]

Runs 'PJRT_DEVICE=TPU python3 launch/xla_spawn.py --num_cores N launch/run_clm.py ARGS'
on every worker (--worker=all); PJRT joins the workers of a pod into one job.
--num-cores is the TPU devices per worker (4 on v4). run_clm runs one process per
worker driving all of its chips (single-controller runtime, asynchronous
collectives) unless --per-chip asks for one process per chip (pinned
collectives, as torch_xla's FSDP); --spmd says the default explicitly. ARGS are the 2B GPT-2 job of the PyTorch/XLA FSDP recipe, then
TRAINING_ARGS (a repeated flag: the last one wins); --no-default-args drops the
recipe's flags.

--node-count N > 1 (a Multislice job from create.sh --node-count N): the same job
on every worker of every slice at once, through one 'gcloud compute tpus
queued-resources ssh NAME --node=all --worker=all'; the platform sets the
MEGASCALE_* variables on every host, and the job shards within each slice and
replicates across slices.

--auto-resume N runs the job again, at most N times, after it saved a checkpoint
for a SIGTERM (a spot VM's preemption, a maintenance event) and exited 75; and
after the ssh connection broke (exit 255) while the TPU VM is READY again. run_clm
resumes from the newest checkpoint in --output_dir: on a spot VM, give a bucket
(gs://...), which outlives the VM. A VM that is not READY (PREEMPTED, deleted) is
named with what to do: create it again, then run this command again. With
--node-count N > 1 the queued resource NAME must be ACTIVE instead."
VALUE_OPTIONS=(name zone project num-cores remote-dir auto-resume node-count)
FLAG_OPTIONS=(no-default-args spmd per-chip)
OPT_NAME=""
OPT_ZONE=""
OPT_PROJECT=""
OPT_NUM_CORES="4"
OPT_REMOTE_DIR="xla_fsdp"
OPT_AUTO_RESUME="0"
OPT_NODE_COUNT="1"
FLAG_NO_DEFAULT_ARGS=0
FLAG_SPMD=0
FLAG_PER_CHIP=0
parse_options "$@"
if ((FLAG_SPMD && FLAG_PER_CHIP)); then die_usage "--spmd and --per-chip contradict each other; pass one"; fi
require_options name zone
[[ "$OPT_NUM_CORES" =~ ^[1-9][0-9]*$ ]] ||
  die_usage "--num-cores must be a positive integer, got '${OPT_NUM_CORES}'"
[[ "$OPT_AUTO_RESUME" =~ ^[0-9]+$ ]] ||
  die_usage "--auto-resume must be a count of reruns (0 or more), got '${OPT_AUTO_RESUME}'"
check_node_count
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

job="$(quote_command PJRT_DEVICE=TPU python3 -u launch/xla_spawn.py \
  "${launcher_args[@]}" launch/run_clm.py "${train_args[@]}")"
if ((OPT_AUTO_RESUME > 0)); then
  # on every worker: the job again after its preemption exit (75: a checkpoint of the step it reached
  # is complete), as many times as asked; every worker's job stopped at the same step
  job="( tries=0; while :; do ${job}; rc=\$?; if [ \$rc -ne ${EXIT_PREEMPTED} ] || [ \$tries -ge ${OPT_AUTO_RESUME} ]; then exit \$rc; fi; tries=\$((tries + 1)); echo \"run.sh: the job saved a checkpoint and exited ${EXIT_PREEMPTED}; resuming (\$tries of ${OPT_AUTO_RESUME})\" >&2; done )"
fi
remote="$(remote_script \
  "$(quote_command cd "$OPT_REMOTE_DIR")" \
  "$(quote_command . .venv/bin/activate)" \
  "$job")"
if ((OPT_NODE_COUNT == 1)); then
  ssh_job=(gcloud compute tpus tpu-vm ssh "$OPT_NAME" "${GCLOUD_LOCATION[@]}" --worker=all "--command=${remote}")
  describe=(gcloud compute tpus tpu-vm describe "$OPT_NAME" "${GCLOUD_LOCATION[@]}" --format='value(state)')
  resource="the TPU VM"
  ready="READY"
  recreate="create it again (tpu_scripts/create.sh, tpu_scripts/install.sh)"
else
  # Multislice: every worker of every slice must start the job, so one command reaches them all at
  # once (per-node ssh would wait for the first node's job, which waits for the other slices).
  ssh_job=(gcloud compute tpus queued-resources ssh "$OPT_NAME" "${GCLOUD_LOCATION[@]}" --node=all --worker=all
    "--command=${remote}")
  describe=(gcloud compute tpus queued-resources describe "$OPT_NAME" "${GCLOUD_LOCATION[@]}"
    --format='value(state.state)')
  resource="the queued resource"
  ready="ACTIVE"
  recreate="delete it and create it again (tpu_scripts/delete.sh, tpu_scripts/create.sh, tpu_scripts/install.sh,"
  recreate+=" each with --node-count ${OPT_NODE_COUNT})"
fi

if ((OPT_AUTO_RESUME == 0 || DRY_RUN)); then
  run "${ssh_job[@]}"
  exit 0
fi
# The connection itself can break (exit 255): the VM restarted for maintenance, or a spot VM was
# taken back. Run again while the VM is READY (a Multislice queued resource: ACTIVE); say what to do
# when it is not.
reconnects=0
while :; do
  rc=0
  "${ssh_job[@]}" || rc=$?
  ((rc == 255 && reconnects < OPT_AUTO_RESUME)) || exit "$rc"
  state="$("${describe[@]}" || true)"
  if [[ "$state" != "$ready" ]]; then
    echo "${SCRIPT_NAME}: the connection to ${OPT_NAME} broke and ${resource} is '${state:-not found}', not ${ready}:" \
      "${recreate}, then run this command again; the job" \
      "resumes from the newest checkpoint in its --output_dir (a gs:// bucket outlives a spot VM)" >&2
    exit "$rc"
  fi
  reconnects=$((reconnects + 1))
  echo "${SCRIPT_NAME}: the connection broke (exit 255) and ${OPT_NAME} is ${ready}; running the job again" \
    "(${reconnects} of ${OPT_AUTO_RESUME})" >&2
done
