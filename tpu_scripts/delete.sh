#!/usr/bin/env bash
# Delete a Cloud TPU VM (every worker of a pod slice goes with it).
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--project PROJECT] [--yes] [--dry-run]

Deletes the TPU VM. gcloud asks for confirmation unless --yes is given.
Copy results first (copy_results.sh): the workers' disks are deleted too."
VALUE_OPTIONS=(name zone project)
FLAG_OPTIONS=(yes)
OPT_NAME=""
OPT_ZONE=""
OPT_PROJECT=""
FLAG_YES=0
parse_options "$@"
require_options name zone
((${#EXTRA_ARGS[@]} == 0)) || die_usage "takes no arguments after --"
gcloud_location_flags

confirm=()
if ((FLAG_YES)); then confirm=(--quiet); fi
run gcloud compute tpus tpu-vm delete "$OPT_NAME" "${GCLOUD_LOCATION[@]}" "${confirm[@]}"
