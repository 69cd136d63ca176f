#!/usr/bin/env bash
# Creates a Cloud TPU VM (one host or a multi-host slice) with the runtime JAX needs.
#
#   deploy/create-tpu-vm.sh --tpu NAME --zone ZONE --type v5e-8 [--project ID] [--spot]
#                           [--dry-run]
# Types: v5e-8 and v6e-8 (one host, 8 chips), v5e-16 and v4-32 (4 hosts x 4 chips),
# v5e-256 (64 hosts x 4 chips).
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

TYPE=""
SPOT=0
usage() { sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --type) TYPE="${2:-}"; shift 2 ;;
    --spot) SPOT=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) parse_target_flag "$1" "${2:-}" || die "unknown argument $1"; shift 2 ;;
  esac
done
need "$TPU_NAME" --tpu
need "$ZONE" --zone
need "$TYPE" --type

# The accelerator type and the TPU software version for JAX, per generation.
case "$TYPE" in
  v5e-*) ACCELERATOR="v5litepod-${TYPE#v5e-}"; VERSION="v2-alpha-tpuv5-lite" ;;
  v6e-*) ACCELERATOR="$TYPE"; VERSION="v2-alpha-tpuv6e" ;;
  v4-*) ACCELERATOR="$TYPE"; VERSION="tpu-ubuntu2204-base" ;;
  *) die "unknown --type $TYPE (v5e-8, v6e-8, v5e-16, v4-32, v5e-256, ...)" ;;
esac

args=(create "$TPU_NAME" --accelerator-type="$ACCELERATOR" --version="$VERSION")
[[ "$SPOT" == 0 ]] || args+=(--spot)
gcloud_tpu "${args[@]}"
gcloud_tpu describe "$TPU_NAME" --format="value(state,networkEndpoints[].ipAddress)"
