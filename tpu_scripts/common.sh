# shellcheck shell=bash disable=SC2034
# (SC2034: REPO_ROOT, EXTRA_ARGS and the GCLOUD_LOCATION and NODE_NAMES arrays are read by the sourcing scripts.)
# Shared by the tpu_scripts/*.sh entry points (sourced, not run): option
# parsing, --dry-run, and the gcloud flags every TPU VM command needs.
#
# A script declares what it accepts, then parses:
#   VALUE_OPTIONS=(name zone)      # --name VALUE or --name=VALUE -> OPT_NAME
#   FLAG_OPTIONS=(yes)             # --yes -> FLAG_YES=1
#   OPT_ZONE="" ...                # defaults, one per option (also documents them)
#   parse_options "$@"             # words after `--` land in EXTRA_ARGS
# --dry-run and --help are always accepted.

# The repository root, for scripts that copy or read this checkout.
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SCRIPT_NAME="$(basename "$0")"
# run_clm's status after it saved the checkpoint a SIGTERM asked for (xla_fsdp/checkpoint/preemption.py)
EXIT_PREEMPTED=75
DRY_RUN=0
EXTRA_ARGS=()

die_usage() {
  echo "${SCRIPT_NAME}: error: $*" >&2
  exit 2
}

valid_options_text() {
  local words=() name
  for name in "${VALUE_OPTIONS[@]}"; do words+=("--${name} VALUE"); done
  for name in "${FLAG_OPTIONS[@]}"; do words+=("--${name}"); done
  words+=("--dry-run" "--help")
  local IFS=","
  local joined="${words[*]}"
  echo "${joined//,/, }"
}

# --accelerator-type -> ACCELERATOR_TYPE
option_var_suffix() {
  local name="${1//-/_}"
  echo "${name^^}"
}

is_listed() {
  local wanted="$1" item
  shift
  for item in "$@"; do [[ "$item" == "$wanted" ]] && return 0; done
  return 1
}

parse_options() {
  while (($#)); do
    local word="$1" name value
    shift
    case "$word" in
      --) EXTRA_ARGS=("$@"); return 0 ;;
      --dry-run) DRY_RUN=1; continue ;;
      -h | --help) echo "$USAGE"; exit 0 ;;
      --*=*) name="${word%%=*}"; name="${name#--}"; value="${word#*=}" ;;
      --*) name="${word#--}"; value="" ;;
      *) die_usage "unexpected argument '${word}' (training flags go after --); valid options: $(valid_options_text)" ;;
    esac
    if is_listed "$name" "${VALUE_OPTIONS[@]}"; then
      if [[ "$word" != *=* ]]; then
        (($#)) || die_usage "--${name} needs a value"
        value="$1"
        [[ "$value" != --* ]] || die_usage "--${name} needs a value, got option '${value}'"
        shift
      fi
      printf -v "OPT_$(option_var_suffix "$name")" '%s' "$value"
    elif is_listed "$name" "${FLAG_OPTIONS[@]}" && [[ "$word" != *=* ]]; then
      printf -v "FLAG_$(option_var_suffix "$name")" '%s' 1
    else
      die_usage "unknown option '${word}'; valid options: $(valid_options_text)"
    fi
  done
}

# Fail unless each named option was given, e.g. require_options name zone.
require_options() {
  local name var
  for name in "$@"; do
    var="OPT_$(option_var_suffix "$name")"
    [[ -n "${!var}" ]] || die_usage "--${name} is required; valid options: $(valid_options_text)"
  done
}

# Shell-quote one word so the printed command can be pasted back into a shell
# (`~` is quoted too: pasted bare it would expand to the local home).
quote_word() {
  local word="$1"
  if [[ "$word" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$word"
  else
    printf "'%s'" "${word//\'/\'\\\'\'}"
  fi
}

# All words of a command, each quoted, joined by spaces.
quote_command() {
  local out=() word
  for word in "$@"; do out+=("$(quote_word "$word")"); done
  echo "${out[*]}"
}

# Run a command, or with --dry-run print it (one line, shell-quoted) instead.
run() {
  if ((DRY_RUN)); then
    quote_command "$@"
  else
    "$@"
  fi
}

# Flags every `gcloud compute tpus tpu-vm` call needs: --zone, and --project when given.
gcloud_location_flags() {
  GCLOUD_LOCATION=("--zone=${OPT_ZONE}")
  if [[ -n "${OPT_PROJECT:-}" ]]; then
    GCLOUD_LOCATION+=("--project=${OPT_PROJECT}")
  fi
}

# --node-count N: the slices of a Cloud TPU Multislice job. 1 (the default) is one TPU VM named
# NAME; N > 1 is a queued resource NAME whose N nodes (slices) are NAME-0 .. NAME-(N-1)
# (create.sh gives the queued resource NAME as its --node-prefix).
check_node_count() {
  [[ "$OPT_NODE_COUNT" =~ ^[1-9][0-9]*$ ]] ||
    die_usage "--node-count must be a positive integer (the slices of a Multislice job), got '${OPT_NODE_COUNT}'"
}

# The TPU VMs (nodes) the job has -> NODE_NAMES: NAME alone, or NAME-0 .. NAME-(N-1) with --node-count N > 1.
node_names() {
  local i
  NODE_NAMES=()
  if ((OPT_NODE_COUNT == 1)); then
    NODE_NAMES=("$OPT_NAME")
  else
    for ((i = 0; i < OPT_NODE_COUNT; i++)); do NODE_NAMES+=("${OPT_NAME}-${i}"); done
  fi
}

# Commands run on a worker, joined with && so the first failure stops the rest.
remote_script() {
  local script="$1" part
  shift
  for part in "$@"; do script+=" && ${part}"; done
  echo "$script"
}
