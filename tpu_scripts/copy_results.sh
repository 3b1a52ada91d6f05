#!/usr/bin/env bash
# Copy a training output directory back from TPU VM workers (of every slice, for a Multislice job).
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--project PROJECT] [--node-count 1]
       [--output-dir /tmp/test-clm] [--dest results] [--worker 0 | --worker 0,1 | --worker all --num-workers N]
       [--dry-run]

Copies OUTPUT_DIR from each chosen worker into DEST/worker-ID/. Worker 0 holds
the saved model and logs; other workers hold their own logs (and shards, for
sharded checkpoints). --worker all needs --num-workers (hosts in the slice,
e.g. 4 for v4-32).

--node-count N > 1 (a Multislice job from create.sh --node-count N): the chosen
workers of each node NAME-0 .. NAME-(N-1) in turn, node i's into
DEST/node-i/worker-ID/ (--num-workers counts the hosts of one slice)."
VALUE_OPTIONS=(name zone project output-dir dest worker num-workers node-count)
FLAG_OPTIONS=()
OPT_NAME=""
OPT_ZONE=""
OPT_PROJECT=""
OPT_OUTPUT_DIR="/tmp/test-clm"
OPT_DEST="results"
OPT_WORKER="0"
OPT_NUM_WORKERS=""
OPT_NODE_COUNT="1"
parse_options "$@"
require_options name zone
check_node_count
((${#EXTRA_ARGS[@]} == 0)) || die_usage "takes no arguments after --"
gcloud_location_flags
node_names

# Each worker's copy gets its own folder: the same OUTPUT_DIR on several
# workers would otherwise overwrite each other locally.
if [[ "$OPT_WORKER" == all ]]; then
  [[ "$OPT_NUM_WORKERS" =~ ^[1-9][0-9]*$ ]] ||
    die_usage "--worker all needs --num-workers N (hosts in the slice, e.g. 4 for v4-32)"
  workers=()
  for ((w = 0; w < OPT_NUM_WORKERS; w++)); do workers+=("$w"); done
elif [[ "$OPT_WORKER" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
  IFS=, read -r -a workers <<<"$OPT_WORKER"
else
  die_usage "--worker must be a worker id (0), a list (0,1) or all, got '${OPT_WORKER}'"
fi

# With several nodes (slices) each gets its folder too: DEST/node-I/worker-ID.
for i in "${!NODE_NAMES[@]}"; do
  node_dest="$OPT_DEST"
  if ((OPT_NODE_COUNT > 1)); then node_dest="${OPT_DEST}/node-${i}"; fi
  for w in "${workers[@]}"; do
    run mkdir -p "${node_dest}/worker-${w}"
    run gcloud compute tpus tpu-vm scp --recurse "${NODE_NAMES[i]}:${OPT_OUTPUT_DIR}" \
      "${node_dest}/worker-${w}/" "${GCLOUD_LOCATION[@]}" "--worker=${w}"
  done
done
