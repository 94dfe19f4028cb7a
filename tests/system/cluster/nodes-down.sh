#!/usr/bin/env bash
# Remove a cluster started by tests/system/cluster/nodes-up.sh and delete its state folder.
#
#   bash tests/system/cluster/nodes-down.sh STATE_DIR
#
# Kills every process still running on a node (anything in a node's network namespace), then the
# node holders, deletes the namespaces, the veth pairs and the bridge. Safe to run twice, or
# after a failed bring-up. Stop a Slurm started on the nodes (slurm-down.sh) first.
set -uo pipefail

log() { echo "nodes-down: $*" >&2; }

# shellcheck source=cluster.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/cluster.sh"
open_state nodes-down.sh nodes.env "${1:-}"
NAMESPACES="" PIDS="" BRIDGE=""
# shellcheck disable=SC1091
source "$state/nodes.env"

stop_watchdog "$state"

# Every process in a node's network namespace (MPI daemons, ranks, the holders): TERM, then KILL.
node_pids() {
  local ns pid
  for ns in $NAMESPACES; do
    [ -e "/run/netns/$ns" ] && ip netns pids "$ns" 2>/dev/null
  done
  for pid in $PIDS; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done
}
terminate 5 node_pids
for ns in $NAMESPACES; do
  [ -e "/run/netns/$ns" ] && { ip netns delete "$ns" || log "could not delete namespace $ns"; }
done
# The veth pairs go with their namespaces; remove any host end left over, then the bridge.
while IFS='=' read -r key veth; do
  [[ "$key" == VETH_* ]] && ip link show "$veth" >/dev/null 2>&1 && ip link delete "$veth"
done < "$state/nodes.env"
if [ -n "$BRIDGE" ] && ip link show "$BRIDGE" >/dev/null 2>&1; then
  ip link delete "$BRIDGE" || log "could not delete bridge $BRIDGE"
fi
rm -rf "$state"
log "removed $state"
