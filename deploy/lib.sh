# shellcheck shell=bash
# Shared by the deploy scripts (sourced, never run): a dry-run aware runner, and where a command
# runs: every worker of a Cloud TPU VM (gcloud ... ssh --worker=all) or plain SSH hosts.

DRY_RUN=0
TPU_NAME=""
ZONE=""
PROJECT=""
HOSTS=""

# quote ARG: ARG as one shell word: bare when it is plain, else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    local q="'\\''"
    printf "'%s'" "${1//\'/$q}"
  fi
}

# run CMD ARGS...: runs the command, or with --dry-run prints it as one line, each word
# shell-quoted, prefixed by "+ " (the tests parse these lines).
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local word line="+"
    for word in "$@"; do
      line+=" $(quote "$word")"
    done
    printf '%s\n' "$line"
  else
    "$@"
  fi
}

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# need VALUE FLAG: fails unless the flag got a value.
need() {
  [[ -n "${1:-}" ]] || die "$2 is required (see --help)"
}

# parse_target_flag FLAG VALUE: takes the flags every remote script shares; returns 1 for any
# other flag. --tpu NAME --zone ZONE [--project ID] or --hosts h1,h2,...
parse_target_flag() {
  case "$1" in
    --tpu) TPU_NAME="$2" ;;
    --zone) ZONE="$2" ;;
    --project) PROJECT="$2" ;;
    --hosts) HOSTS="$2" ;;
    *) return 1 ;;
  esac
}

check_target() {
  if [[ -n "$TPU_NAME" ]]; then
    [[ -z "$HOSTS" ]] || die "give --tpu or --hosts, not both"
    need "$ZONE" --zone
  else
    [[ -n "$HOSTS" ]] || die "give --tpu NAME --zone ZONE (a Cloud TPU VM) or --hosts h1,h2"
  fi
}

# gcloud_tpu ARGS...: gcloud compute tpus tpu-vm ARGS with the zone (and project).
gcloud_tpu() {
  local project=()
  [[ -z "$PROJECT" ]] || project=(--project="$PROJECT")
  run gcloud compute tpus tpu-vm "$@" --zone="$ZONE" "${project[@]}"
}

# on_all COMMAND: one remote shell command on every worker / host.
on_all() {
  if [[ -n "$TPU_NAME" ]]; then
    gcloud_tpu ssh "$TPU_NAME" --worker=all --command="$1"
  else
    local host
    for host in ${HOSTS//,/ }; do
      run ssh "$host" "$1"
    done
  fi
}

# host_list: the --hosts entries, one per line.
host_list() {
  tr ',' '\n' <<<"$HOSTS"
}
