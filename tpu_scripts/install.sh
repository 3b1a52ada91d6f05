#!/usr/bin/env bash
# Put this repository on every worker of a TPU VM (or of every slice) and install it in a venv.
set -euo pipefail
# shellcheck source=tpu_scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

USAGE="usage: ${SCRIPT_NAME} --name NAME --zone ZONE [--project PROJECT] [--node-count 1]
       [--repo-url URL [--ref main]] [--remote-dir xla_fsdp] [--python python3] [--dry-run]

On every worker (--worker=all): gets the code into ~/REMOTE_DIR, creates
REMOTE_DIR/.venv, installs the pinned requirements.txt plus the TPU runtime
(torch_xla[tpu], libtpu) and this package (editable).

Without --repo-url the committed HEAD of this checkout is copied (git archive;
uncommitted changes are not included). With --repo-url each worker clones the
repository (or fetches, if REMOTE_DIR is already a clone) and checks out --ref.

--node-count N > 1 (a Multislice job from create.sh --node-count N): the same on
every worker of each node NAME-0 .. NAME-(N-1), one node after the other."
VALUE_OPTIONS=(name zone project repo-url ref remote-dir python node-count)
FLAG_OPTIONS=()
OPT_NAME=""
OPT_ZONE=""
OPT_PROJECT=""
OPT_REPO_URL=""
OPT_REF="main"
OPT_REMOTE_DIR="xla_fsdp"
OPT_PYTHON="python3"
OPT_NODE_COUNT="1"
parse_options "$@"
require_options name zone
check_node_count
((${#EXTRA_ARGS[@]} == 0)) || die_usage "takes no arguments after --"
gcloud_location_flags
node_names

# requirements.txt pins torch_xla without its TPU extra (CPU machines need no
# libtpu); workers need the extra at the same version.
torch_xla_pin="$(grep -E '^torch_xla==' "${REPO_ROOT}/requirements.txt" || true)"
[[ -n "$torch_xla_pin" ]] || die_usage "requirements.txt has no 'torch_xla==VERSION' pin"
tpu_runtime="torch_xla[tpu]==${torch_xla_pin#torch_xla==}"

dir="$OPT_REMOTE_DIR"
if [[ -n "$OPT_REPO_URL" ]]; then
  get_code=(
    "($(quote_command test -d "${dir}/.git") || $(quote_command git clone "$OPT_REPO_URL" "$dir"))"
    "$(quote_command git -C "$dir" fetch --tags origin)"
    "$(quote_command git -C "$dir" checkout "$OPT_REF")"
  )
else
  archive="${TMPDIR:-/tmp}/xla_fsdp-src.tar.gz"
  run git -C "$REPO_ROOT" archive --format=tar.gz "--output=${archive}" HEAD
  get_code=(
    "$(quote_command mkdir -p "$dir")"
    "$(quote_command tar -xzf xla_fsdp-src.tar.gz -C "$dir")"
  )
fi

# Ubuntu's python3 cannot create a venv until python3-venv is installed; libjemalloc2: the
# launcher starts the job with it for libtpu's compile ([Note: libtpu's compile and the host's malloc]).
remote="$(remote_script \
  "$(quote_command sudo apt-get update -q)" \
  "$(quote_command sudo apt-get install -y -q python3-venv libjemalloc2)" \
  "${get_code[@]}" \
  "$(quote_command cd "$dir")" \
  "$(quote_command "$OPT_PYTHON" -m venv .venv)" \
  "$(quote_command .venv/bin/pip install --upgrade pip)" \
  "$(quote_command .venv/bin/pip install -r requirements.txt "$tpu_runtime")" \
  "$(quote_command .venv/bin/pip install --no-deps -e .)")"

# One node (TPU VM) after the other; every worker of a node at once.
for node in "${NODE_NAMES[@]}"; do
  if [[ -z "$OPT_REPO_URL" ]]; then
    run gcloud compute tpus tpu-vm scp "$archive" "${node}:xla_fsdp-src.tar.gz" \
      "${GCLOUD_LOCATION[@]}" --worker=all
  fi
  run gcloud compute tpus tpu-vm ssh "$node" "${GCLOUD_LOCATION[@]}" --worker=all \
    "--command=${remote}"
done
