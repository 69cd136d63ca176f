#!/usr/bin/env bash
# Installs Metrale-JAX on every worker of a TPU VM (or on SSH hosts), in /opt/metrale/venv,
# with a `metrale` system user and the systemd unit (deploy/metrale.service), then checks that
# JAX sees the accelerators.
#
#   deploy/install.sh --tpu NAME --zone ZONE [--project ID] [--extra tpu] [--dry-run]
#   deploy/install.sh --hosts gpu1,gpu2 --extra gpu [--dry-run]
# --extra: tpu (default with --tpu) or gpu (NVIDIA, CUDA 12; default with --hosts).
# --package: what pip installs (default metrale-jax), e.g. a wheel path or a git URL.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"

EXTRA=""
PACKAGE="metrale-jax"
usage() { sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --extra) EXTRA="${2:-}"; shift 2 ;;
    --package) PACKAGE="${2:-}"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) parse_target_flag "$1" "${2:-}" || die "unknown argument $1"; shift 2 ;;
  esac
done
check_target
if [[ -z "$EXTRA" ]]; then
  if [[ -n "$TPU_NAME" ]]; then EXTRA=tpu; else EXTRA=gpu; fi
fi
[[ "$EXTRA" == tpu || "$EXTRA" == gpu ]] || die "--extra must be tpu or gpu"

# The unit travels base64-encoded: no quoting of its text in the remote command.
UNIT_B64="$(base64 <"$(dirname "$0")/metrale.service" | tr -d '\n')"
VENV=/opt/metrale/venv
steps=(
  "sudo apt-get update -qq"
  "sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv curl"
  "(id metrale >/dev/null 2>&1 || sudo useradd --system --home-dir /var/lib/metrale metrale)"
  "sudo mkdir -p /opt/metrale /etc/metrale /var/lib/metrale/models"
  "sudo chown -R metrale: /var/lib/metrale"
  "sudo python3 -m venv $VENV"
  "sudo $VENV/bin/pip install --quiet --upgrade pip"
  "sudo $VENV/bin/pip install --quiet $(quote "${PACKAGE}[${EXTRA}]")"
  "echo $UNIT_B64 | base64 -d | sudo tee /etc/systemd/system/metrale.service >/dev/null"
  "sudo systemctl daemon-reload"
  "$VENV/bin/python -c 'import jax; print(jax.process_index(), jax.local_device_count(), jax.devices())'"
)
remote="$(printf '%s && ' "${steps[@]}")"
on_all "${remote% && }"
