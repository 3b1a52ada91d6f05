#!/usr/bin/env bash
# Delete a Cloud TPU VM (every worker of a pod slice goes with it), or a Multislice queued resource.
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--project PROJECT] [--node-count 1] [--yes] [--dry-run]

Deletes the TPU VM. gcloud asks for confirmation unless --yes is given.
Copy results first (copy_results.sh): the workers' disks are deleted too.
--node-count N > 1 (a Multislice job from create.sh --node-count N) deletes the
queued resource NAME with --force, which deletes its nodes (every slice) first."
VALUE_OPTIONS=(name zone project node-count)
FLAG_OPTIONS=(yes)
OPT_NAME=""
OPT_ZONE=""
OPT_PROJECT=""
OPT_NODE_COUNT="1"
FLAG_YES=0
parse_options "$@"
require_options name zone
check_node_count
((${#EXTRA_ARGS[@]} == 0)) || die_usage "takes no arguments after --"
gcloud_location_flags

confirm=()
if ((FLAG_YES)); then confirm=(--quiet); fi
if ((OPT_NODE_COUNT == 1)); then
  run gcloud compute tpus tpu-vm delete "$OPT_NAME" "${GCLOUD_LOCATION[@]}" "${confirm[@]}"
else
  # --force: without it a queued resource whose nodes still exist is not deleted.
  run gcloud compute tpus queued-resources delete "$OPT_NAME" "${GCLOUD_LOCATION[@]}" --force "${confirm[@]}"
fi
