#!/usr/bin/env bash
# Create a Cloud TPU VM (single host or pod slice) for xla_fsdp.
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--accelerator-type v4-8]
       [--runtime-version tpu-ubuntu2204-base] [--project PROJECT] [--spot] [--dry-run]

Creates the TPU VM with 'gcloud compute tpus tpu-vm create'. A pod slice
(e.g. v4-32) gets several workers; install.sh and run.sh address all of them.
--spot asks for spot capacity (cheaper; taken back with a SIGTERM and about 30 s
of notice): run the job with run.sh --auto-resume and a gs:// --output_dir."
VALUE_OPTIONS=(name zone accelerator-type runtime-version project)
FLAG_OPTIONS=(spot)
OPT_NAME=""
OPT_ZONE=""
OPT_ACCELERATOR_TYPE="v4-8"
OPT_RUNTIME_VERSION="tpu-ubuntu2204-base"
OPT_PROJECT=""
FLAG_SPOT=0
parse_options "$@"
require_options name zone
((${#EXTRA_ARGS[@]} == 0)) || die_usage "takes no arguments after --"
gcloud_location_flags

capacity=()
if ((FLAG_SPOT)); then capacity=(--spot); fi
run gcloud compute tpus tpu-vm create "$OPT_NAME" "${GCLOUD_LOCATION[@]}" \
  "--accelerator-type=${OPT_ACCELERATOR_TYPE}" "--version=${OPT_RUNTIME_VERSION}" "${capacity[@]}"
