#!/usr/bin/env bash
# Converts a checkpoint (a Hugging Face folder, a .gguf file or "default") to Metrale's orbax
# format on local disk, and optionally uploads it to a Cloud Storage bucket, from where
# deploy/launch.sh copies it to every worker's local disk.
#
#   deploy/convert.sh --model SRC --out DIR [--dtype bfloat16] [--bucket gs://BUCKET/PATH]
#                     [--metrale PATH] [--dry-run]
# Run it on a machine with the source checkpoint and RAM for the params (a 70B model in
# bfloat16: about 140 GB); --metrale is the metrale executable (default: the one on PATH).
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

MODEL=""
OUT=""
DTYPE="bfloat16"
BUCKET=""
METRALE="metrale"
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) MODEL="${2:-}"; shift 2 ;;
    --out) OUT="${2:-}"; shift 2 ;;
    --dtype) DTYPE="${2:-}"; shift 2 ;;
    --bucket) BUCKET="${2:-}"; shift 2 ;;
    --metrale) METRALE="${2:-}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1" ;;
  esac
done
need "$MODEL" --model
need "$OUT" --out
[[ "$DTYPE" == float32 || "$DTYPE" == bfloat16 ]] || die "--dtype must be float32 or bfloat16"
[[ -z "$BUCKET" || "$BUCKET" == gs://* ]] || die "--bucket must be a gs:// URL"

run "$METRALE" convert "$MODEL" "$OUT" --dtype "$DTYPE"
if [[ -n "$BUCKET" ]]; then
  run gcloud storage rsync --recursive "$OUT" "$BUCKET"
fi
