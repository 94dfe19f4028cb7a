# Sourced by nodes-up.sh and slurm-up.sh: tear a test cluster down when its owner dies.
#
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
