#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice) for xla_fsdp, or the slices of a Multislice job.
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--accelerator-type v4-8]
       [--runtime-version tpu-ubuntu2204-base] [--project PROJECT] [--node-count 1] [--spot] [--dry-run]

Creates the TPU VM with 'gcloud compute tpus tpu-vm create'. A pod slice
(e.g. v4-32) gets several workers; install.sh and run.sh address all of them.
--node-count N > 1 asks for N slices of --accelerator-type joined over the
data-center network (Cloud TPU Multislice), which needs a queued resource:
'gcloud compute tpus queued-resources create NAME' whose nodes are NAME-0 ..
NAME-(N-1). Pass the same --node-count to the other scripts.
--spot asks for spot capacity (cheaper; taken back with a SIGTERM and about 30 s
of notice): run the job with run.sh --auto-resume and a gs:// --output_dir."
VALUE_OPTIONS=(name zone accelerator-type runtime-version project node-count)
FLAG_OPTIONS=(spot)
OPT_NAME=""
OPT_ZONE=""
OPT_ACCELERATOR_TYPE="v4-8"
OPT_RUNTIME_VERSION="tpu-ubuntu2204-base"
OPT_PROJECT=""
OPT_NODE_COUNT="1"
FLAG_SPOT=0
parse_options "$@"
require_options name zone
check_node_count
((${#EXTRA_ARGS[@]} == 0)) || die_usage "takes no arguments after --"
gcloud_location_flags

capacity=()
if ((FLAG_SPOT)); then capacity=(--spot); fi
if ((OPT_NODE_COUNT == 1)); then
  run gcloud compute tpus tpu-vm create "$OPT_NAME" "${GCLOUD_LOCATION[@]}" \
    "--accelerator-type=${OPT_ACCELERATOR_TYPE}" "--version=${OPT_RUNTIME_VERSION}" "${capacity[@]}"
else
  # Multislice needs a queued resource; its id is NAME and its nodes NAME-0 .. NAME-(N-1).
  run gcloud compute tpus queued-resources create "$OPT_NAME" "--node-count=${OPT_NODE_COUNT}" \
    "--node-prefix=${OPT_NAME}" "--accelerator-type=${OPT_ACCELERATOR_TYPE}" \
    "--runtime-version=${OPT_RUNTIME_VERSION}" "${GCLOUD_LOCATION[@]}" "${capacity[@]}"
fi
