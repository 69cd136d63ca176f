#!/usr/bin/env bash
# Shows the service's log (the systemd journal) on every worker.
#
#   deploy/logs.sh --tpu NAME --zone ZONE [--lines 100] [--follow] [--dry-run]
#   deploy/logs.sh --hosts gpu1,gpu2 [--lines 100] [--dry-run]
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

LINES=100
FOLLOW=""
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --lines) LINES="${2:-}"; shift 2 ;;
    --follow) FOLLOW=" --follow"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) parse_target_flag "$1" "${2:-}" || die "unknown argument $1"; shift 2 ;;
  esac
done
check_target
[[ "$LINES" =~ ^[0-9]+$ ]] || die "--lines must be a number"
on_all "sudo journalctl -u metrale --no-pager -n $LINES$FOLLOW"
