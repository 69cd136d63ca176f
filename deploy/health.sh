#!/usr/bin/env bash
# Checks /health on every worker (each answers on its own loopback), or on one URL.
#
#   deploy/health.sh --tpu NAME --zone ZONE [--port 8000] [--dry-run]
#   deploy/health.sh --hosts gpu1,gpu2 [--port 8000] [--dry-run]
#   deploy/health.sh --url http://HOST:8000 [--dry-run]
# Exits non-zero when a machine does not answer 200 within 5 seconds.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

PORT=8000
URL=""
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) PORT="${2:-}"; shift 2 ;;
    --url) URL="${2:-}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) parse_target_flag "$1" "${2:-}" || die "unknown argument $1"; shift 2 ;;
  esac
done

if [[ -n "$URL" ]]; then
  run curl -fsS --max-time 5 "${URL%/}/health"
else
  check_target
  on_all "curl -fsS --max-time 5 http://127.0.0.1:$PORT/health && echo \" \$(hostname) ok\""
fi
