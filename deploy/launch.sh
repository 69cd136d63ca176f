#!/usr/bin/env bash
# Starts `metrale serve` as the systemd service on every worker of a TPU VM (single host or
# multi-host slice), or on SSH hosts (NVIDIA GPUs; several hosts form one multi-host server).
#
#   deploy/launch.sh --tpu NAME --zone ZONE --model PATH|gs://... [--mesh data=2,model=4]
#                    [--memory-gb X] [--max-slots N] [--max-len S] [--port 8000]
#                    [--listen 0.0.0.0] [--dry-run] [-- MORE SERVE FLAGS]
#   deploy/launch.sh --hosts gpu1,gpu2 --model PATH [--coordinator-port 8476] ...
# A gs:// model is copied first to /var/lib/metrale/models/ on every machine. On a TPU slice
# every worker gets the same flags (JAX reads the process layout from the TPU environment);
# on N > 1 SSH hosts, host i gets --coordinator FIRST_HOST:PORT --num-processes N
# --process-id i. Process 0 (TPU worker 0, the first host) serves HTTP; the others only
# /health.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

MODEL=""
SERVE=()
PORT=8000
LISTEN="0.0.0.0"
COORD_PORT=8476
usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="${2:-}"; shift 2 ;;
    --mesh|--memory-gb|--max-slots|--max-len) SERVE+=("$1" "${2:-}"); shift 2 ;;
    --port) PORT="${2:-}"; shift 2 ;;
    --listen) LISTEN="${2:-}"; shift 2 ;;
    --coordinator-port) COORD_PORT="${2:-}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; SERVE+=("$@"); break ;;
    *) parse_target_flag "$1" "${2:-}" || die "unknown argument $1"; shift 2 ;;
  esac
done
check_target
need "$MODEL" --model

MODELS=/var/lib/metrale/models
if [[ "$MODEL" == gs://* ]]; then
  local_model="$MODELS/$(basename "$MODEL")"
  on_all "sudo gcloud storage rsync --recursive $MODEL $local_model && sudo chown -R metrale: $local_model"
  MODEL="$local_model"
fi

# systemd splits $METRALE_ARGS at whitespace: no flag value may hold whitespace or quotes.
for arg in "$MODEL" "$LISTEN" "$PORT" "$COORD_PORT" "${SERVE[@]}"; do
  [[ "$arg" =~ ^[^[:space:]\"\'\\]+$ ]] || die "flag value '$arg' is empty or has spaces or quotes"
done

# env_line EXTRA...: the line of /etc/metrale/metrale.env.
env_line() {
  local args
  args="$(printf '%s ' --model "$MODEL" --host "$LISTEN" --port "$PORT" "${SERVE[@]}" "$@")"
  printf 'METRALE_ARGS="%s"' "${args% }"
}

# start_command ENV_LINE: the remote command that writes the env file and (re)starts.
start_command() {
  printf '%s' "echo $(quote "$1") | sudo tee /etc/metrale/metrale.env >/dev/null" \
    " && sudo systemctl enable metrale >/dev/null 2>&1; sudo systemctl restart metrale"
}

mapfile -t hosts < <(host_list)
if [[ -n "$TPU_NAME" || ${#hosts[@]} -le 1 ]]; then
  on_all "$(start_command "$(env_line)")"
else
  first="${hosts[0]#*@}"
  for i in "${!hosts[@]}"; do
    line="$(env_line --coordinator "$first:$COORD_PORT" --num-processes "${#hosts[@]}" \
      --process-id "$i")"
    run ssh "${hosts[$i]}" "$(start_command "$line")"
  done
fi
