#!/usr/bin/env bash
# Start a throw-away cluster of K "nodes" on this machine: network namespaces joined by a bridge,
# each with its own host name, /etc/hosts and private /tmp, so that MPI jobs (and slurmd, see
# slurm-up.sh) run across nodes over TCP as on a small cluster (see docs/multinode.md).
#
#   bash tests/system/cluster/nodes-up.sh STATE_DIR      # prints: export MPIDIST_NODES_DIR=STATE_DIR
#   bash tests/system/cluster/nodes-down.sh STATE_DIR
#
# STATE_DIR must not lie under NODE_PRIVATE (below: each node sees its own /tmp). It receives:
#   nodes.env        NAMES, ADDRS, PIDS (one per node), SUBNET, BRIDGE, BRIDGE_ADDR, IFACE, NODE_PRIVATE
#   agent            an ssh stand-in: `agent [options] NODE COMMAND...` runs COMMAND on NODE
#   on NODE CMD...   a shorthand: `STATE_DIR/on node0 hostname`
#   hostfile.openmpi, hostfile.mpich   every node with SLOTS slots, in each launcher's syntax
#   nodeK/PATH       node K's own PATH, for each PATH of NODE_PRIVATE (nodeK/tmp, nodeK/etc/hosts)
# Each node is one named network namespace (`ip netns list`) and one holder process whose UTS,
# IPC and mount namespaces every command run on the node enters (`nsenter -t PID -n -u -i -m`);
# the node's interface is eth0 with an address on SUBNET, and the host side of the bridge has the
# subnet's first address (slurmctld listens there). Nothing is routed elsewhere. The IPC namespace
# is what keeps UCX (MPICH's network layer) off shared memory between nodes: it takes processes
# with the same kernel boot id and IPC namespace for one host, and would carry their traffic
# through shared memory instead of over the node's link.
#
# Environment: MPIDIST_NODES (default 2) nodes; MPIDIST_NODES_SLOTS (default 2) slots per node in
# the hostfiles; MPIDIST_NODES_SUBNET (default: the first of 10.231.N.0/24 for N = 1..250 that no
# address or route of this machine overlaps) the private /24 to use; MPIDIST_NODES_OWNER_PID: when
# that process ends, a watchdog removes the cluster (so a killed test run leaves nothing behind).
# Needs root, iproute2 and util-linux (unshare, nsenter).
set -euo pipefail

# The paths of this machine that each node mounts its own copy over (the holders below
# bind-mount STATE_DIR/nodeK/PATH over PATH): nothing under them is shared between the nodes and
# this machine. What a job needs on every node (the checkout, the venvs, the working files) must
# lie elsewhere; the test suite reads this line to check that before it starts a cluster.
NODE_PRIVATE="/tmp /etc/hosts"

log() { echo "nodes-up: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it creates network namespaces and a bridge)"
for prog in ip nsenter unshare python3; do
  command -v "$prog" >/dev/null 2>&1 || die "missing $prog (iproute2, util-linux, python3)"
done
state="${1:?usage: nodes-up.sh STATE_DIR}"
mkdir -p "$state"
state="$(cd "$state" && pwd)"
for private in $NODE_PRIVATE; do
  case "$state/" in "$private"/*) die "STATE_DIR $state lies under $private, which each node replaces with its own" ;; esac
done
[ -e "$state/nodes.env" ] && die "$state already holds a cluster (nodes-down.sh it first)"
chmod 755 "$state"
count="${MPIDIST_NODES:-2}"
slots="${MPIDIST_NODES_SLOTS:-2}"
[[ "$count" =~ ^[1-9][0-9]?$ ]] || die "MPIDIST_NODES=$count: expected 1 to 99"

# -- a private /24 nothing here uses ---------------------------------------------------------
# Every address and route of every table, IPv4; a candidate overlapping any of them is taken.
used="$(ip -4 -o addr show | awk '{print $4}'; ip -4 route show table all | awk '{print $1}')"
subnet="$(USED="$used" WANT="${MPIDIST_NODES_SUBNET:-}" python3 - <<'PY'
import ipaddress, os, sys
used = []
for word in os.environ["USED"].split():
    word = {"default": "0.0.0.0/0"}.get(word, word)
    try:
        net = ipaddress.ip_network(word, strict=False)
    except ValueError:  # broadcast, local, unreachable, ...: not an address
        continue
    if net.prefixlen > 0:  # the default route overlaps everything and says nothing
        used.append(net)
want = os.environ["WANT"]
candidates = [want] if want else [f"10.231.{n}.0/24" for n in range(1, 251)]
for text in candidates:
    net = ipaddress.ip_network(text, strict=False)
    if net.prefixlen != 24 or not net.is_private:
        sys.exit(f"{text}: expected a private /24")
    if not any(net.overlaps(u) for u in used):
        print(net)
        break
else:
    sys.exit(f"no unused subnet among {candidates[0]} .. {candidates[-1]}")
PY
)" || die "no subnet: $subnet"
prefix="${subnet%.0/24}"
tag="${prefix##*.}"   # the third octet names this cluster's bridge, links and namespaces
bridge="mpidbr${tag}"
bridge_addr="${prefix}.1"
ip link show "$bridge" >/dev/null 2>&1 && die "a link named $bridge exists already"

names=() addrs=() pids=() namespaces=()
for ((k = 0; k < count; k++)); do
  names+=("node$k")
  addrs+=("${prefix}.$((k + 11))")
  namespaces+=("mpidist${tag}-node$k")
done
{
  echo "# Written by nodes-up.sh; read by nodes-down.sh, the agent and slurm-up.sh."
  echo "NAMES=\"${names[*]}\""
  echo "ADDRS=\"${addrs[*]}\""
  echo "NAMESPACES=\"${namespaces[*]}\""
  echo "SUBNET=$subnet"
  echo "BRIDGE=$bridge"
  echo "BRIDGE_ADDR=$bridge_addr"
  echo "IFACE=eth0"
  echo "SLOTS=$slots"
  echo "NODE_PRIVATE=\"$NODE_PRIVATE\""
} > "$state/nodes.env"

cleanup_on_error() {
  log "bring-up failed; removing what was created"
  bash "$(dirname "${BASH_SOURCE[0]}")/nodes-down.sh" "$state" >&2 || true
}
trap cleanup_on_error ERR

# -- network: one bridge, one veth pair per node ----------------------------------------------
ip link add "$bridge" type bridge
ip addr add "$bridge_addr/24" dev "$bridge"
ip link set "$bridge" up
{
  echo "127.0.0.1 localhost"
  echo "$bridge_addr $(hostname -s) head"
  for ((k = 0; k < count; k++)); do echo "${addrs[k]} ${names[k]}"; done
} > "$state/hosts"
chmod 644 "$state/hosts"
for ((k = 0; k < count; k++)); do
  ns="${namespaces[k]}" veth="mpidv${tag}-$k"
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$bridge" up
  ip -n "$ns" addr add "${addrs[k]}/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  echo "VETH_$k=$veth" >> "$state/nodes.env"
done

# -- one holder process per node: host name, and its own copy of each NODE_PRIVATE path --------
for ((k = 0; k < count; k++)); do
  node="$state/${names[k]}"
  mkdir -p "$node/tmp" "$node/etc"
  chmod 1777 "$node/tmp"
  cp -p "$state/hosts" "$node/etc/hosts"
  setsid nsenter --net="/run/netns/${namespaces[k]}" unshare --uts --ipc --mount --propagation private -- \
    bash -c 'hostname "$1" || exit 1
             for path in $4; do mount --bind "$2$path" "$path" || exit 1; done
             touch "$3" && exec sleep infinity' holder "${names[k]}" "$node" "$node/ready" "$NODE_PRIVATE" \
    </dev/null >>"$state/holders.log" 2>&1 &
  pids+=("$!")
done
echo "PIDS=\"${pids[*]}\"" >> "$state/nodes.env"
for ((k = 0; k < count; k++)); do
  for _ in $(seq 100); do [ -e "$state/${names[k]}/ready" ] && break; sleep 0.05; done
  [ -e "$state/${names[k]}/ready" ] || { cat "$state/holders.log" >&2; die "node ${names[k]} did not start"; }
done

# -- the ssh stand-in, its shorthand and the hostfiles ----------------------------------------
cat > "$state/agent" <<AGENT
#!/usr/bin/env bash
# ssh stand-in for this test cluster: \`agent [ssh options] NODE COMMAND...\` runs COMMAND (joined
# with spaces, through bash, as ssh does) on NODE: in its network, UTS and mount namespaces.
# The environment is passed through as it is.
source "$state/nodes.env"
while [ "\$#" -gt 0 ]; do
  case "\$1" in
    -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;   # ssh options that take a value
    -*) shift ;;
    *) break ;;
  esac
done
node="\${1:?usage: agent [options] NODE COMMAND...}"; shift
node="\${node#*@}"
read -ra names <<<"\$NAMES"; read -ra addrs <<<"\$ADDRS"; read -ra pids <<<"\$PIDS"
for ((i = 0; i < \${#names[@]}; i++)); do
  if [ "\$node" = "\${names[i]}" ] || [ "\$node" = "\${addrs[i]}" ]; then
    [ "\$#" -gt 0 ] || set -- exec bash -l
    exec nsenter -t "\${pids[i]}" -n -u -i -m --wd="\$PWD" -- bash -c "\$*"
  fi
done
echo "agent: unknown node \$node (nodes: \$NAMES)" >&2
exit 255
AGENT
cat > "$state/on" <<ON
#!/usr/bin/env bash
# \`on NODE COMMAND [ARG...]\`: run COMMAND with its arguments as they are on NODE.
source "$state/nodes.env"
read -ra names <<<"\$NAMES"; read -ra pids <<<"\$PIDS"
for ((i = 0; i < \${#names[@]}; i++)); do
  [ "\$1" = "\${names[i]}" ] && { shift; exec nsenter -t "\${pids[i]}" -n -u -i -m --wd="\$PWD" -- "\$@"; }
done
echo "on: unknown node \$1 (nodes: \$NAMES)" >&2
exit 255
ON
chmod 755 "$state/agent" "$state/on"
: > "$state/hostfile.openmpi"
: > "$state/hostfile.mpich"
for name in "${names[@]}"; do
  echo "$name slots=$slots" >> "$state/hostfile.openmpi"
  echo "$name:$slots" >> "$state/hostfile.mpich"
done

# Every node reaches every other and the bridge address.
for ((k = 0; k < count; k++)); do
  for target in "$bridge_addr" "${addrs[@]}"; do
    # A refused TCP connection (port 9, nothing listens) proves the address answers.
    reply="$("$state/on" "${names[k]}" timeout 3 bash -c 'exec 3<>"/dev/tcp/$0/9"' "$target" 2>&1 || true)"
    [[ "$reply" == *refused* ]] || { log "${names[k]} cannot reach $target: ${reply:-no answer}"; false; }
  done
done
trap - ERR

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=cluster.sh
source "$here/cluster.sh"
start_watchdog "${MPIDIST_NODES_OWNER_PID:-}" "$state" nodes.env "$here/nodes-down.sh"
log "$count nodes up (${names[*]} on $subnet, bridge $bridge $bridge_addr), state in $state"
echo "export MPIDIST_NODES_DIR=$state"
