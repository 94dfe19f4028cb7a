#!/usr/bin/env bash
# Stop a cluster started by tests/system/cluster/slurm-up.sh and delete its state folder.
#
#   bash tests/system/cluster/slurm-down.sh STATE_DIR      # the folder slurm-up.sh printed
#
# Cancels every job, waits (at most 20 s) until none is left, then stops slurmd, slurmctld
# and the munged that slurm-up.sh started (a munged that was already running is left alone),
# waiting at most 10 s before it kills them. Safe to run twice, or after a failed bring-up.
set -uo pipefail

log() { echo "slurm-down: $*" >&2; }

# shellcheck source=cluster.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cluster.sh"
open_state slurm-down.sh slurm.conf "${1:-}"
export SLURM_CONF="$state/slurm.conf"

if timeout 5 scontrol ping 2>/dev/null | grep -q "is UP"; then
  jobs="$(timeout 10 squeue -h -o %i 2>/dev/null)"
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086  # one argument per job id
    timeout 10 scancel $jobs 2>/dev/null
    for _ in $(seq 200); do
      [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
fi

stop_watchdog "$state"

# Read every PID first: the daemons delete their PID files while they exit.
daemons=()
for f in "$state"/slurmd*.pid "$state/slurmctld.pid" "$state/munge/munged.pid"; do
  if [ -s "$f" ]; then
    pid="$(cat "$f")"
    kill -0 "$pid" 2>/dev/null && daemons+=("$pid")
  fi
done
daemon_pids() {
  local pid
  for pid in "${daemons[@]}"; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done
}
terminate 10 daemon_pids
rm -rf "$state"
log "stopped; removed $state"
