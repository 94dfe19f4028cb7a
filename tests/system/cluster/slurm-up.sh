#!/usr/bin/env bash
# Start a throw-away one-node Slurm cluster on this machine, to try the job scripts in jobs/
# with a real sbatch (the test suite uses it; see docs/slurm.md). Needs root and Debian's or
# Ubuntu's Slurm packages, which it installs with apt-get when they are missing.
#
#   bash tests/system/cluster/slurm-up.sh [STATE_DIR]    # prints: export SLURM_CONF=STATE_DIR/slurm.conf
#   eval "$(bash tests/system/cluster/slurm-up.sh)"      # then sbatch, squeue, scontrol use that cluster
#   bash tests/system/cluster/slurm-down.sh "$(dirname "$SLURM_CONF")"
#
# Everything it writes (slurm.conf, state, spool, logs, PID files) lives in STATE_DIR (default:
# a new temporary folder), so nothing under /etc/slurm changes; it also adds one symlink that
# Slurm's PMIx plugin needs (libpmix.so). It starts munged (unless one already answers),
# slurmctld and slurmd, and waits until the node is idle. On failure it prints the daemons'
# logs, stops what it started and exits non-zero.
#
# Environment: MPIDIST_SLURM_CPUS (default: the number of cores) is the CPU count the node
# declares; declaring more than there are lets more tasks than cores be granted.
# MPIDIST_SLURM_GPUS (default 0) declares that many GPUs, backed by empty stand-in files in
# STATE_DIR, so that job scripts asking for GPUs (--gpus-per-task=1) are granted them on a
# machine without any; their programs must then run in CPU mode (MPIDIST_DEVICE=cpu).
# MPIDIST_SLURM_OWNER_PID: when that process ends, a watchdog stops the cluster (so a test run
# that is killed leaves nothing running).
# MPIDIST_SLURM_NODES_DIR: the folder of a cluster of namespace nodes (tests/system/cluster/nodes-up.sh):
# slurmctld then listens on its bridge address and every node runs its own slurmd (in the node's
# namespaces, with its own spool, PID and log files); each node declares the CPUs and GPUs above.
# STATE_DIR must then lie outside the paths each node replaces with its own (NODE_PRIVATE: /tmp).
# MPIDIST_SLURM_PORT: slurmctld's port (default 6817; with nodes, 6900 + the subnet's third octet).
set -euo pipefail

log() { echo "slurm-up: $*" >&2; }
die() { log "$*"; exit 1; }

[ "$(id -u)" = 0 ] || die "must run as root (it starts munged, slurmctld and slurmd)"

# -- packages --------------------------------------------------------------------------------
need=()
for prog in sbatch slurmctld slurmd munged; do
  command -v "$prog" >/dev/null 2>&1 || need+=("$prog")
done
if [ "${#need[@]}" -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || die "missing ${need[*]} and no apt-get to install Slurm with"
  log "installing Slurm and munge with apt-get (missing: ${need[*]})"
  export DEBIAN_FRONTEND=noninteractive
  timeout 600 apt-get update -qq >&2 || die "apt-get update failed"
  timeout 600 apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurm-client munge libpmix2 >&2 || die "apt-get install failed"
fi
# Slurm's PMIx plugin opens libpmix.so, which only libpmix-dev provides: link it by hand.
for dir in /usr/lib/*-linux-gnu/pmix2/lib; do
  if [ -e "$dir/libpmix.so.2" ] && [ ! -e "$dir/libpmix.so" ]; then
    ln -s libpmix.so.2 "$dir/libpmix.so"
  fi
done

# -- state folder ----------------------------------------------------------------------------
state="${1:-}"
if [ -z "$state" ]; then
  state="$(mktemp -d -t mpidist-slurm.XXXXXX)"
fi
mkdir -p "$state"
state="$(cd "$state" && pwd)"
mkdir -p "$state/ctld" "$state/spool" "$state/munge"
chmod 755 "$state"

cleanup_on_error() {
  log "bring-up failed; logs follow"
  for f in "$state"/*.log "$state/munge/munged.log"; do
    [ -f "$f" ] && { echo "--- $f" >&2; tail -n 30 "$f" >&2; }
  done
  bash "$(dirname "${BASH_SOURCE[0]}")/slurm-down.sh" "$state" >&2 || true
}
trap cleanup_on_error ERR

# -- munge -----------------------------------------------------------------------------------
if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
  log "munged is already running: using it"
else
  mkdir -p /run/munge
  chown munge:munge /run/munge "$state/munge"
  chmod 755 /run/munge
  runuser -u munge -- munged --force --pid-file="$state/munge/munged.pid" \
    --log-file="$state/munge/munged.log"
  for _ in $(seq 50); do
    munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
    sleep 0.1
  done
  munge -n </dev/null | unmunge >/dev/null || die "munged did not come up"
fi

# -- configuration ---------------------------------------------------------------------------
host="$(hostname -s)"
ctld_addr=127.0.0.1
port="${MPIDIST_SLURM_PORT:-6817}"
node_names=("$host") node_addrs=(127.0.0.1)
nodes_dir="${MPIDIST_SLURM_NODES_DIR:-}"
if [ -n "$nodes_dir" ]; then
  [ -f "$nodes_dir/nodes.env" ] || die "MPIDIST_SLURM_NODES_DIR=$nodes_dir holds no nodes.env (see nodes-up.sh)"
  NAMES="" ADDRS="" BRIDGE_ADDR="" NODE_PRIVATE=""
  # shellcheck disable=SC1091
  source "$nodes_dir/nodes.env"
  for private in $NODE_PRIVATE; do
    case "$state/" in "$private"/*) die "STATE_DIR $state lies under $private, which each node replaces with its own" ;; esac
  done
  ctld_addr="$BRIDGE_ADDR"
  # slurmctld listens on every address: a port of its own keeps it apart from another test
  # cluster on this machine (the subnet's third octet is unique among running clusters).
  subnet_octet="${SUBNET%.*}"; port="${MPIDIST_SLURM_PORT:-$((6900 + ${subnet_octet##*.}))}"
  read -ra node_names <<<"$NAMES"
  read -ra node_addrs <<<"$ADDRS"
fi
cpus="${MPIDIST_SLURM_CPUS:-$(nproc)}"
gpus="${MPIDIST_SLURM_GPUS:-0}"
gres_node=""
gres_types=""
if [ "$gpus" -gt 0 ]; then
  gres_node=" Gres=gpu:${gpus}"
  gres_types="GresTypes=gpu"
  # Stand-in device files: Slurm's gpu plugin counts GPUs by their files.
  mkdir -p "$state/dev"
  for ((i = 0; i < gpus; i++)); do : > "$state/dev/gpu$i"; done
  echo "Name=gpu File=${state}/dev/gpu[0-$((gpus - 1))]" > "$state/gres.conf"
fi
first_job_id=$(( (EPOCHSECONDS % 600000) * 100 + 1000 + RANDOM % 100 ))
cat > "$state/slurm.conf" <<CONF
# Written by mpidist's tests/system/cluster/slurm-up.sh: a one-node test cluster.
ClusterName=mpidist-test
SlurmctldHost=${host}(${ctld_addr})
SlurmctldPort=${port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# No cgroups and no systemd needed.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Start batch jobs at once instead of on 3 s ticks.
SchedulerParameters=batch_sched_delay=0
# Keep finished jobs visible for 5 s (scontrol show job), and sbatch --wait polling every 2 s.
MinJobAge=5
# Job ids of their own: a cluster that starts again from job 1 reuses the ids of the last one, and
# MPICH names its shared memory after "<job id>.<step id>" (a segment left by a killed step of an
# earlier cluster's job of that id makes a new step hang or fail inside MPI_Init).
FirstJobId=${first_job_id}
# Reject impossible requests at submission instead of leaving them pending forever.
EnforcePartLimits=ALL
# Trust the CPU count below even when the machine has fewer cores.
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
${gres_types}
SlurmctldPidFile=${state}/slurmctld.pid
SlurmdPidFile=${state}/slurmd-%n.pid
StateSaveLocation=${state}/ctld
SlurmdSpoolDir=${state}/spool/%n
SlurmctldLogFile=${state}/slurmctld.log
SlurmdLogFile=${state}/slurmd-%n.log
CONF
for ((k = 0; k < ${#node_names[@]}; k++)); do
  echo "NodeName=${node_names[k]} NodeAddr=${node_addrs[k]} CPUs=${cpus}${gres_node} State=UNKNOWN" >> "$state/slurm.conf"
  mkdir -p "$state/spool/${node_names[k]}"
done
node_list="${node_names[*]}"
echo "PartitionName=debug Nodes=${node_list// /,} Default=YES MaxTime=INFINITE State=UP" >> "$state/slurm.conf"
# Open MPI from pip under srun --mpi=pmix needs PMIx's native security module.
echo "PMIxEnv=PMIX_MCA_psec=native" > "$state/mpi.conf"
export SLURM_CONF="$state/slurm.conf"

# -- daemons ---------------------------------------------------------------------------------
if timeout 5 scontrol ping 2>/dev/null | grep -q "is UP"; then
  die "a slurmctld already answers for this configuration's host and port; stop it first"
fi
slurmctld -c
if [ -n "$nodes_dir" ]; then
  for name in "${node_names[@]}"; do "$nodes_dir/on" "$name" slurmd -c -N "$name"; done
else
  slurmd -c
fi
ok=
for _ in $(seq 300); do
  if [ "$(timeout 5 sinfo -h -o %T 2>/dev/null)" = idle ]; then ok=1; break; fi
  sleep 0.1
done
[ -n "$ok" ] || { log "the node did not become idle within 30 s"; false; }
trap - ERR
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=cluster.sh
source "$here/cluster.sh"
start_watchdog "${MPIDIST_SLURM_OWNER_PID:-}" "$state" slurm.conf "$here/slurm-down.sh"
log "cluster up: nodes ${node_list}, ${cpus} CPUs and ${gpus} GPUs each, state in ${state}"
echo "export SLURM_CONF=${state}/slurm.conf"
