# Sourced by the test clusters' scripts (nodes-up.sh, nodes-down.sh, slurm-up.sh, slurm-down.sh):
# a cluster's state folder, the watchdog that tears the cluster down when its owner dies, and
# stopping processes.

# open_state SCRIPT MARKER DIR: set $state to DIR as an absolute path. Exits 0 when DIR does not
# exist (nothing to take down), 1 when it has no MARKER file (not a cluster's state folder).
open_state() {
  local script="$1" marker="$2"
  state="${3:?usage: $script STATE_DIR}"
  [ -d "$state" ] || { echo "$script: no such folder: $state (nothing to take down)" >&2; exit 0; }
  state="$(cd "$state" && pwd)"
  [ -f "$state/$marker" ] || { echo "$script: $state has no $marker: not a ${script%-down.sh}-up.sh folder" >&2; exit 1; }
}

# stop_watchdog STATE_DIR: end the watchdog of STATE_DIR, unless it is what runs this script.
stop_watchdog() {
  local pid
  [ -s "$1/watchdog.pid" ] || return 0
  pid="$(cat "$1/watchdog.pid")"
  [ "$pid" != "$$" ] && [ "$pid" != "$PPID" ] && kill -TERM "$pid" 2>/dev/null
  return 0
}

#   start_watchdog OWNER_PID STATE_DIR MARKER_FILE DOWN_SCRIPT
#
# Starts a detached loop that, once OWNER_PID is gone while STATE_DIR/MARKER_FILE still exists
# (the cluster was not taken down by its owner), runs `bash DOWN_SCRIPT STATE_DIR`. Its PID goes
# to STATE_DIR/watchdog.pid, its output to STATE_DIR/watchdog.log. Nothing happens without a PID.
start_watchdog() {
  local owner="$1" state="$2" marker="$3" down="$4"
  [ -n "$owner" ] || return 0
  setsid bash -c 'while kill -0 "$1" 2>/dev/null && [ -f "$2/$3" ]; do sleep 1; done
                  [ -f "$2/$3" ] && exec bash "$4" "$2"' watchdog "$owner" "$state" "$marker" "$down" \
    </dev/null >>"$state/watchdog.log" 2>&1 &
  echo $! > "$state/watchdog.pid"
}

# terminate SECONDS LIST_FUNCTION: TERM the processes LIST_FUNCTION prints (one PID per line, only
# live ones), wait until it prints none, and after SECONDS KILL those left. It is called again on
# every check, so processes that appear meanwhile are stopped too. Uses the caller's `log`. (Bash
# scoping: LIST_FUNCTION sees this function's locals, so it must not read globals named seconds,
# list or running.)
terminate() {
  local seconds="$1" list="$2" running
  mapfile -t running < <("$list" | sort -u)
  [ "${#running[@]}" -gt 0 ] || return 0
  kill -TERM "${running[@]}" 2>/dev/null
  for _ in $(seq $((seconds * 10))); do
    mapfile -t running < <("$list" | sort -u)
    [ "${#running[@]}" -eq 0 ] && return 0
    sleep 0.1
  done
  log "killing ${running[*]} (still running after $seconds s)"
  kill -KILL "${running[@]}" 2>/dev/null
  sleep 0.2
}
