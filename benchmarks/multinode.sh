#!/usr/bin/env bash
# Allreduce across nodes at the link limit: a cluster of network-namespace nodes on this machine
# (tests/system/cluster/nodes-up.sh, docs/multinode.md) with each node's link shaped to RATE both
# ways, and benchmarks/multinode_bench.py run across it under Open MPI and MPICH: raw
# MPI_Allreduce, mpidist flat, two-level and default, against the link bound measured in the same
# run. As root (namespaces, a bridge, tc).
#
#   benchmarks/multinode.sh [OUT]                       # 2 nodes x 2 ranks, 1 and 10 Gbit/s, both MPIs
#   NODES=4 PER_NODE=1 RATES=1gbit benchmarks/multinode.sh OUT-4x1
#   SMOKE=1 benchmarks/multinode.sh [OUT]               # the smallest run: proves the script works
#   COMPRESSION=1 RATES=1gbit MPIS=openmpi MIN_BYTES=16777216 MAX_BYTES=67108864 benchmarks/multinode.sh OUT
#                                                        # wire compression: the MEAN update exact, fp16, bf16
#
# Settings (environment): RATES (default "1gbit 10gbit"; tc's units, "none" for the bare veth
# links), NODES (2), PER_NODE (2: ranks per node), MPIS ("openmpi mpich": the virtual environments
# .venv-openmpi and .venv-mpich in VENVS, default the checkout), REPEATS (5), MIN_BYTES (64 KiB),
# MAX_BYTES (256 MiB), RAW_MAX_BYTES (MAX_BYTES), BURST_MS (1), QUEUE_MS (8), COMPRESSION (set: time
# the mirrored MEAN update exact and with fp16 and bf16 wire compression instead). OUT (default
# multinode-DATE, outside /tmp: every node has its own /tmp) gets NODESxPER_NODE/RATE/MPI/ with
# results.json and results.md, and multinode.md and multinode.png for all runs under OUT.
#
# The links: each node's veth pair gets a token bucket filter (tc tbf) on both ends, the node's
# eth0 (what the node sends) and the host end on the bridge (what it receives), each at RATE with
#   burst = RATE x BURST_MS   (1 ms: 125 KB at 1 Gbit/s, 1.25 MB at 10 Gbit/s)
#   limit = RATE x QUEUE_MS   (8 ms of queue: 1 MB at 1 Gbit/s, 10 MB at 10 Gbit/s)
# The burst is what the link may send above RATE after an idle moment: as small as lets one TCP
# stream both ways (a Python socket test) reach the rate here: with 64 KB, less than a full-size
# segment of the veth's segmentation offload, a 1 Gbit/s link carried 0.6-0.75 Gbit/s each way
# and a 10 Gbit/s one 1.2-1.4. The limit is the queue a switch port would hold: with 64-256 KB the
# stream got half the rate (0.50-0.53 Gbit/s); with 1 MB (and the 1 ms burst) 0.88-0.95 Gbit/s;
# at 10 Gbit/s about 7 (the CPU's limit). What a link delivers still depends on the MPI's use of
# it and on the CPU: hence the bound measured in the same run, never the nominal rate. The cluster goes down when the script ends, also on failure
# (and, through the cluster's watchdog, when the script is killed).
set -euo pipefail
cd "$(dirname "$0")/.."
checkout=$(pwd)

[ "$(id -u)" = 0 ] || { echo "multinode.sh: must run as root (network namespaces, a bridge, tc)" >&2; exit 1; }
OUT=${1:-multinode-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
case "$OUT/" in /tmp/*) echo "multinode.sh: OUT must lie outside /tmp (each node has its own)" >&2; exit 1 ;; esac
RATES=${RATES:-1gbit 10gbit} NODES=${NODES:-2} PER_NODE=${PER_NODE:-2} MPIS=${MPIS:-openmpi mpich}
VENVS=${VENVS:-$checkout} BURST_MS=${BURST_MS:-1} QUEUE_MS=${QUEUE_MS:-8}
if [ -n "${SMOKE:-}" ]; then
    REPEATS=${REPEATS:-1} MIN_BYTES=${MIN_BYTES:-65536} MAX_BYTES=${MAX_BYTES:-262144}
else
    REPEATS=${REPEATS:-5} MIN_BYTES=${MIN_BYTES:-65536} MAX_BYTES=${MAX_BYTES:-268435456}
fi
RAW_MAX_BYTES=${RAW_MAX_BYTES:-$MAX_BYTES}

# bits per second of a tc rate (kbit, mbit, gbit)
bits() {
    local n=${1%%[a-z]*} unit=${1##*[0-9]}
    [[ "$n" =~ ^[0-9]+$ ]] || unit=bad
    case "$unit" in kbit) echo $((n * 1000)) ;; mbit) echo $((n * 1000000)) ;; gbit) echo $((n * 1000000000)) ;;
        *) echo "multinode.sh: rate $1: expected none or a number followed by kbit, mbit or gbit" >&2; return 1 ;; esac
}
for rate in $RATES; do  # every rate checked before anything is set up
    [ "$rate" = none ] || bits "$rate" >/dev/null || exit 1
done

state=$(mktemp -d /var/tmp/mpidist-multinode-bench.XXXXXX)
chmod 755 "$state"
down() {
    bash "$checkout/tests/system/cluster/nodes-down.sh" "$state/cluster" || true
    rm -rf "$state"
}
trap down EXIT
trap 'exit 130' INT TERM
MPIDIST_NODES=$NODES MPIDIST_NODES_SLOTS=$PER_NODE MPIDIST_NODES_OWNER_PID=$$ \
    bash tests/system/cluster/nodes-up.sh "$state/cluster" >/dev/null
cluster=$state/cluster
NAMES="" SUBNET="" NAMESPACES=""
# shellcheck disable=SC1091
source "$cluster/nodes.env"
read -ra names <<<"$NAMES"

shape() {  # RATE: tbf on both ends of every node's link ("none": remove them)
    local rate=$1 k veth burst limit per_second
    for ((k = 0; k < ${#names[@]}; k++)); do
        veth=VETH_$k
        if [ "$rate" = none ]; then
            tc qdisc del dev "${!veth}" root 2>/dev/null || true
            "$cluster/on" "${names[k]}" tc qdisc del dev eth0 root 2>/dev/null || true
            continue
        fi
        per_second=$(($(bits "$rate") / 8))
        burst=$((per_second * BURST_MS / 1000)) limit=$((per_second * QUEUE_MS / 1000))
        tc qdisc replace dev "${!veth}" root tbf rate "$rate" burst "$burst" limit "$limit"
        "$cluster/on" "${names[k]}" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" limit "$limit"
    done
}
launch() {  # MPI: the launcher's command line on the first node, every node with PER_NODE ranks
    local bin=$VENVS/.venv-$1/bin n=$((NODES * PER_NODE))
    if [ "$1" = openmpi ]; then
        echo "$cluster/on ${names[0]} $bin/mpiexec --hostfile $cluster/hostfile.openmpi -n $n" \
            "--map-by ppr:$PER_NODE:node --prtemca plm_ssh_agent $cluster/agent" \
            "--prtemca oob_tcp_if_include $SUBNET --mca btl_tcp_if_include $SUBNET $bin/python"
    else
        echo "$cluster/on ${names[0]} $bin/mpiexec -launcher ssh -launcher-exec $cluster/agent" \
            "-f $cluster/hostfile.mpich -n $n -ppn $PER_NODE -iface eth0 $bin/python"
    fi
}

echo "multinode: $NODES nodes x $PER_NODE ranks; links $RATES; $MPIS; $REPEATS rounds, $MIN_BYTES to $MAX_BYTES bytes${COMPRESSION:+; wire compression mode}"
echo "multinode: load average now: $(cut -d' ' -f1-3 /proc/loadavg) (link-limited rows stand some load; latency rows do not)"
started=$(date +%s)
for rate in $RATES; do
    shape "$rate"
    link="unshaped veth"
    [ "$rate" = none ] || link="$rate tbf (burst $BURST_MS ms, queue $QUEUE_MS ms)"
    for mpi in $MPIS; do
        if [ ! -x "$VENVS/.venv-$mpi/bin/mpiexec" ]; then
            echo "multinode: no $VENVS/.venv-$mpi/bin/mpiexec: skipping $mpi" >&2
            continue
        fi
        dir=$OUT/${NODES}x$PER_NODE/$rate/$mpi
        mkdir -p "$dir"
        echo "== $mpi, $rate: $dir"
        (
            # the launcher's environment of jobs/env.$mpi (variables already set keep their values), without
            # Open MPI's oversubscribe mapping, which would place every rank on the first node
            while IFS= read -r line; do
                [[ "$line" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || continue
                name=${line%%=*}
                [ "$name" != PRTE_MCA_rmaps_default_mapping_policy ] || continue
                [ -n "${!name+set}" ] || export "${line?}"
            done < "jobs/env.$mpi"
            export OMP_NUM_THREADS=1 PYTHONPATH=$checkout${PYTHONPATH:+:$PYTHONPATH}
            # the nodes share this machine's cores, which each node's slots do not say: where the ranks outnumber
            # the cores, Open MPI must yield while it waits (as it does when it sees more ranks than slots), or
            # the waiting ranks spin on the cores the ranks moving data need (raw 16 MiB allreduce at 1 Gbit/s:
            # 2.0 s spinning, 0.14 s yielding)
            if [ "$mpi" = openmpi ] && [ $((NODES * PER_NODE)) -gt "$(nproc)" ]; then
                export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
            fi
            # shellcheck disable=SC2046  # the launcher's words
            timeout 3600 $(launch "$mpi") benchmarks/multinode_bench.py --out "$dir" --rate "$rate" --link "$link" \
                --repeats "$REPEATS" --min-bytes "$MIN_BYTES" --max-bytes "$MAX_BYTES" \
                --raw-max-bytes "$RAW_MAX_BYTES" ${COMPRESSION:+--compression} 2>&1 | tee "$dir/bench.log"
        )
    done
done
shape none
PYTHONPATH=$checkout "$VENVS/.venv-${MPIS%% *}/bin/python" benchmarks/multinode_bench.py --report "$OUT"
echo "multinode: done in $(( $(date +%s) - started )) s; load average now: $(cut -d' ' -f1-3 /proc/loadavg)"
